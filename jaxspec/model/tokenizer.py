"""A model folder's tokenizer, loaded in a tenth of a second where its tokenizer.json allows.

transformers' fast tokenizers run the `tokenizers` library underneath; importing transformers to
get there took 6.3 s of a 9.4 s load on the H200 machine (transformers 5.17), longer than the
16M model's weights. So a folder whose tokenizer.json says everything (a plain fast tokenizer
class, no option transformers would rewrite it with) is encoded and decoded by `tokenizers`
directly, exactly as transformers would (tests/test_tokenizer.py compares them on every
HumanEval prompt); chat templates, and every other folder, go through transformers.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import tokenizers

# tokenizer_config classes that are tokenizer.json as it is (transformers 5 names the first).
PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# tokenizer_config keys with which transformers changes what tokenizer.json does.
REWRITING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "from_slow")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def load_tokenizer(path: Path):
    """The folder's tokenizer: a Tokenizer where tokenizer.json says everything, else the class its
    tokenizer_config.json names, from transformers; None when the folder has no tokenizer files."""
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    config = _read_json(path / "tokenizer_config.json")
    if (path / "tokenizer.json").is_file() and _is_plain(path / "tokenizer.json", config):
        return Tokenizer(path, config)
    return transformers_tokenizer(path, config)


def _is_plain(tokenizer_json: Path, config: dict) -> bool:
    """tokenizer.json alone gives what transformers would: a plain class, no rewriting option, its
    own post-processor, the added tokens the config lists, and no clean-up of decoded text
    (transformers skips it for BPE)."""
    spec = _read_json(tokenizer_json)
    added = {str(t.get("id")): t.get("content") for t in spec.get("added_tokens", [])}
    listed = {str(i): (t.get("content") if isinstance(t, dict) else t)
              for i, t in (config.get("added_tokens_decoder") or {}).items()}
    cleans_up = config.get("clean_up_tokenization_spaces") and spec.get("model", {}).get("type") != "BPE"
    return (config.get("tokenizer_class") in PLAIN_CLASSES and not any(k in config for k in REWRITING_KEYS)
            and spec.get("post_processor") is not None and listed.items() <= added.items() and not cleans_up)


def transformers_tokenizer(path: Path, config: dict):
    """The class tokenizer_config.json names, straight from transformers: AutoTokenizer's lookup
    imports torch where it is installed (11 s on the H200 machine); a folder that names none goes
    through AutoTokenizer."""
    import transformers  # lazily: 6 s where it is slow to import, and most folders never need it

    named = config.get("tokenizer_class")
    cls = getattr(transformers, named, None) if isinstance(named, str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(str(path))


class Tokenizer:
    """encode / decode / get_vocab as transformers' tokenizer of the same folder, on `tokenizers`;
    apply_chat_template and anything else through that transformers tokenizer (`hf`), loaded
    on first use."""

    def __init__(self, path: Path, config: dict):
        self.path = path
        self.backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        template = path / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else config.get("chat_template")
        self._config = config

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def hf(self):
        """The transformers tokenizer of this folder."""
        return transformers_tokenizer(self.path, self._config)

    def apply_chat_template(self, messages, **kwargs):
        if isinstance(self.chat_template, str):  # as set here; a config's list of named templates is hf's own
            kwargs.setdefault("chat_template", self.chat_template)
        return self.hf.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("hf", "backend", "path", "chat_template"):
            raise AttributeError(name)
        return getattr(self.hf, name)  # what transformers' tokenizers also offer: eos_token, ...

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab={len(self)})"


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as -> the byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenBytes(tuple):
    """token_bytes' tuple, hashed once: the caches of stop-string and constraint tables key on it,
    and a tuple's hash walks every token again (0.6 ms a lookup at a 128K vocabulary, for each
    constrained record of a job)."""

    def __hash__(self):
        if "_hash" not in self.__dict__:
            self.__dict__["_hash"] = tuple.__hash__(self)
        return self.__dict__["_hash"]


@functools.lru_cache(maxsize=8)
def vocab_bytes(tokenizer, vocab_size: int) -> TokenBytes:
    """token_bytes, computed once per tokenizer (stop strings and output constraints read it)."""
    return TokenBytes(token_bytes(tokenizer, vocab_size))


def token_bytes(tokenizer, vocab_size: int) -> tuple[bytes, ...]:
    """The bytes each token id adds to the decoded text (b"" for special tokens, which decoding
    skips, and ids past the tokenizer): byte-level BPE through its alphabet, SentencePiece-style
    pieces through their byte fallback and "▁" spaces, anything else decoded alone."""
    backend = getattr(tokenizer, "backend", None) or getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):  # a slow tokenizer: each id decoded alone
        return tuple(tokenizer.decode([i], skip_special_tokens=True).encode() for i in range(vocab_size))
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder"))
    added = backend.get_added_tokens_decoder()
    byte_level = _byte_level_chars() if '"ByteLevel"' in decoder else None
    out = []
    for i in range(vocab_size):
        piece = backend.id_to_token(i)
        if piece is None or (i in added and added[i].special):
            out.append(b"")
        elif i in added:
            out.append(added[i].content.encode())
        elif byte_level is not None:
            out.append(bytes(byte_level[c] for c in piece) if all(c in byte_level for c in piece) else piece.encode())
        elif (m := _BYTE_FALLBACK.match(piece)) and '"ByteFallback"' in decoder:
            out.append(bytes([int(m.group(1), 16)]))
        elif "▁" in decoder:
            out.append(piece.replace("▁", " ").encode())
        else:
            out.append(backend.decode([i]).encode())
    return tuple(out)
