"""Stop strings on the device: the token automaton against a byte-by-byte search, and rows that
end where plain decoding with the same stops ends them, under every drafter."""

import numpy as np
import pytest

import jaxspec
from jaxspec.decoding.stop_strings import byte_automaton, token_table
from jaxspec.defaults import CHECKPOINTS
from jaxspec.model.tokenizer import token_bytes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def first_stop(data: bytes, stops: tuple[bytes, ...]) -> tuple[int, int] | None:
    """(end index, stop) of the first stop completed reading `data` byte by byte; ties: the lowest stop."""
    for end in range(1, len(data) + 1):
        hits = [i for i, s in enumerate(stops) if data[:end].endswith(s)]
        if hits:
            return end, min(hits)
    return None


def test_the_byte_automaton_finds_what_a_search_finds():
    rng = np.random.default_rng(0)
    stops = (b"abab", b"bac", b"c", b"aab")
    delta, done = byte_automaton(stops)
    for _ in range(300):
        data = bytes(rng.choice(list(b"abc"), size=12))
        state, got = 0, None
        for k, b in enumerate(data, 1):
            state = delta[state, b]
            if done[state] >= 0:
                got = (k, int(done[state]))
                break
        assert got == first_stop(data, stops), data


def test_token_tables_follow_the_bytes_across_token_boundaries():
    rng = np.random.default_rng(1)
    vocab = (b"a", b"b", b"ab", b"ba", b"abb", b"", b"\n\n", b"\n")
    stops = ("bb", "\n\n\n", "aba")
    table = token_table(stops, vocab)
    for _ in range(300):
        ids = rng.integers(0, len(vocab), size=8)
        state, got = 0, None
        for k, t in enumerate(ids):
            state = int(table[state, t])
            if state < 0:
                got = (k, -1 - state)
                break
        data = b"".join(vocab[t] for t in ids)
        want = first_stop(data, tuple(s.encode() for s in stops))
        if want is None:
            assert got is None
        else:  # the token holding the stop's last byte, and that stop
            ends = np.cumsum([len(vocab[t]) for t in ids])
            assert got == (int(np.searchsorted(ends, want[0])), want[1])


@pytest.fixture(scope="module")
def pair():
    target = jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype="float32")
    draft = jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32")
    return target, draft


def test_token_bytes_rebuild_the_decoded_text(pair):
    tok = pair[0].tokenizer
    vocab = token_bytes(tok, pair[0].config.vocab_size)
    ids = tok.encode("def f(x):\n    return {'é': x}  # ünïcode\n\n", add_special_tokens=False)
    assert b"".join(vocab[i] for i in ids) == tok.decode(ids).encode()


PROMPTS = ["def fibonacci(n):", "def is_prime(n):\n    ", "class Stack:\n"]


@pytest.mark.parametrize("drafter", ["model K=4", "ngram K=8", "model tree"])
def test_stop_strings_end_rows_as_plain_decoding_does(pair, drafter):
    """Stops cut from each prompt's own plain output (one inside a token, one spanning two): the
    text ends before the stop, finish_reason "stop", stop_reason the string, equal under speculation."""
    target, draft = pair
    free = jaxspec.generate(PROMPTS, target, max_new_tokens=40)
    stops = [free[0].text[20:24], [free[1].text[9:13], "never seen"], "zzqqzz"]
    sampling = [jaxspec.SamplingParams(temperature=0, max_tokens=40, seed=0, stop=s) for s in stops]
    how = {"model K=4": dict(num_draft_tokens=4), "ngram K=8": dict(num_draft_tokens=8),
           "model tree": dict(tree="binary-3")}[drafter]
    spec = jaxspec.generate(PROMPTS, target, "ngram" if drafter.startswith("ngram") else draft, sampling=sampling,
                            **how)
    plain = jaxspec.generate(PROMPTS, target, sampling=sampling)
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in spec] == [
        (o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in plain]
    for out, full, stop in zip(plain, free, stops):
        first = stop if isinstance(stop, str) else stop[0]
        if first in full.text:
            assert out.finish_reason == "stop" and out.stop_reason == first
            assert out.text == full.text[: full.text.index(first)]
            assert first in target.tokenizer.decode(out.token_ids) and first not in target.tokenizer.decode(
                out.token_ids[:-1])  # the row ended on the token that completed it
        else:
            assert (out.token_ids, out.finish_reason, out.stop_reason) == (full.token_ids, full.finish_reason, None)


def test_bad_stop_strings_are_named(pair):
    with pytest.raises(jaxspec.InputError, match=r"stop must hold non-empty strings; got ''"):
        jaxspec.SamplingParams(stop=[""])
    with pytest.raises(jaxspec.InputError, match=r"stop must be a string or a list of strings; got 3"):
        jaxspec.SamplingParams(stop=3)
    assert jaxspec.SamplingParams(stop="\n\n").stop == ("\n\n",)
