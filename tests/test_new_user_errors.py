"""Bad inputs that once escaped as raw Python errors: each is a JaxspecError naming the file or argument."""

import re

import pytest

import jaxspec
from jaxspec.cli import main as cli_main
from jaxspec.defaults import CHECKPOINTS
from jaxspec.model.checkpoint import convert_hf_checkpoint
from jaxspec.model.eagle import random_eagle_folder
from jaxspec.model.loading import check_target

HF = CHECKPOINTS / "hf"


@pytest.fixture
def head_folder(tmp_path):
    """A small random EAGLE-3 head for the embedded target (its config read, its weights not loaded)."""
    target = jaxspec.load_config(HF / "code-target-16m")
    return random_eagle_folder(tmp_path / "head", target, draft_vocab_size=64, intermediate_size=64)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_corrupt_config_json_is_a_config_error_naming_it(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    named = re.escape(str(tmp_path / "config.json")) + " (is not valid JSON|holds a JSON list)"
    with pytest.raises(jaxspec.ConfigError, match=named):
        jaxspec.load(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 100], ids=["data", "header"])
def test_a_truncated_head_is_a_checkpoint_error_naming_the_file(head_folder, keep):
    path = head_folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(jaxspec.CheckpointError, match=re.escape(f"cannot read safetensors file {path}")):
        jaxspec.load(head_folder)


def test_a_head_as_the_target_is_refused_by_name(head_folder):
    head = jaxspec.load(head_folder, dtype="float32")
    named = re.escape(f"got an EAGLE-3 head ({head_folder}): pass it as the draft")
    with pytest.raises(jaxspec.InputError, match=named):
        check_target(head)
    with pytest.raises(jaxspec.InputError, match=re.escape(f"got the path '{head_folder}': load it first")):
        check_target(str(head_folder))


def test_generate_refuses_a_head_as_the_target(head_folder):
    head = jaxspec.load(head_folder, dtype="float32")
    with pytest.raises(jaxspec.InputError, match="got an EAGLE-3 head"):
        jaxspec.generate(["def f():"], head, max_new_tokens=2)


def test_convert_into_an_existing_file_is_refused_by_name(tmp_path, capsys):
    file = tmp_path / "out.txt"
    file.write_text("")
    with pytest.raises(jaxspec.CheckpointError, match=re.escape(f"output folder {file} is an existing file")):
        convert_hf_checkpoint(HF / "code-draft-4m", file)
    under = re.escape(f"output folder {file / 'sub'} lies under {file}, which is an existing file")
    with pytest.raises(jaxspec.CheckpointError, match=under):
        convert_hf_checkpoint(HF / "code-draft-4m", file / "sub")
    assert cli_main(["convert", str(HF / "code-draft-4m"), str(file)]) == 2
    assert capsys.readouterr().err.strip() == f"error: output folder {file} is an existing file: name a folder to write"
