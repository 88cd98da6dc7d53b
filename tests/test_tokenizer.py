"""The tokenizer without transformers: what `tokenizers` gives from tokenizer.json is what
transformers gives from the same folder, and folders it cannot reproduce go to transformers."""

import json
import shutil

import pytest
import transformers

from jaxspec.bench.humaneval import load_prompts
from jaxspec.defaults import CHECKPOINTS
from jaxspec.model.tokenizer import Tokenizer, load_tokenizer, transformers_tokenizer

TARGET = CHECKPOINTS / "hf" / "code-target-16m"


@pytest.mark.parametrize("name", ["code-target-16m", "code-draft-4m"])
def test_encode_and_decode_match_transformers_on_every_humaneval_prompt(name):
    folder = CHECKPOINTS / "hf" / name
    ours = load_tokenizer(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(ours, Tokenizer) and ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    for text in load_prompts() + ["<|endoftext|>def f():\n\treturn 'ü' + \"\\n\"  # ok ,n't"]:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special)
        shifted = [(i * 7 + 3) % len(ours) for i in ids] + [0]  # any ids, the special one included
        for skip in (True, False):
            assert ours.decode(shifted, skip_special_tokens=skip) == theirs.decode(shifted, skip_special_tokens=skip)


def _folder_with(tmp_path, **config):
    folder = tmp_path / "tok"
    shutil.copytree(TARGET, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


@pytest.mark.parametrize("config", [{"add_bos_token": True}, {"tokenizer_class": "GPT2TokenizerFast"},
                                    {"added_tokens_decoder": {"1": {"content": "<extra>"}}}])
def test_folders_whose_config_changes_the_tokenizer_go_through_transformers(tmp_path, config):
    tok = load_tokenizer(_folder_with(tmp_path, **config))
    assert not isinstance(tok, Tokenizer) and isinstance(tok, transformers.PreTrainedTokenizerBase)


def test_chat_templates_and_other_attributes_come_from_transformers(tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tok = load_tokenizer(_folder_with(tmp_path, chat_template=template))
    assert isinstance(tok, Tokenizer) and tok.chat_template == template
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "<user>hi"
    assert tok.eos_token == transformers_tokenizer(TARGET, {}).eos_token == "<|endoftext|>"
