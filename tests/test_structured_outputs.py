"""Structured outputs (issue 49): the compiled automaton against the strings it must accept,
outputs that parse and validate, greedy output under every drafter equal to plain constrained
decoding, and sampling under a constraint exact against an analytic reference."""

import dataclasses
import json
from pathlib import Path

import jax
import jsonschema
import numpy as np
import pytest
from test_speculative_distribution import chi2_pvalue
from tiny_models import save_tiny

import jaxspec
import jaxspec.decoding.draft_model as draft_model
from jaxspec import SamplingParams
from jaxspec import StructuredOutputsParams as SO
from jaxspec.bench.humaneval import load_prompts
from jaxspec.decoding.method import DecodeMethod
from jaxspec.defaults import CHECKPOINTS
from jaxspec.model.tokenizer import vocab_bytes
from jaxspec.serving.requests import Request
from jaxspec.serving.runner import run
from jaxspec.structured_outputs import compile_constraint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SCHEMA = json.loads((Path(__file__).parent / "data" / "structured_schema.json").read_text())
REGEX = r"[0-9]{3}-[a-z]{2,6}( [A-Z][a-z]{1,8})?"
CHOICE = ["yes", "no", "not sure (a.k.a. [maybe])"]  # regex characters are literals in a choice


@pytest.fixture(scope="module")
def pair():
    target = jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype="float32")
    draft = jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32")
    return target, draft


def test_settings_are_checked():
    assert SO.of({"choice": ["a", "b"]}) == SO(choice=("a", "b"))
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == SO(regex="a+")
    assert SO(json=SCHEMA).as_dict() == {"json": SCHEMA}
    for bad, message in [
        ({}, "needs exactly one of json, regex, choice, json_object; got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"grammar": "root ::= 'a'"}, "structured_outputs.grammar: a context-free grammar is not a finite automaton"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": "yes"}, "choice must be a list of strings"),
        ({"regexp": "a"}, "structured_outputs.regexp is not a structured-output setting"),
        ({"json_object": True, "json_object_depth": 9}, "json_object_depth"),
    ]:
        with pytest.raises(jaxspec.InputError, match=message):
            SamplingParams(structured_outputs=bad)


def walk(table, ids):
    """The states a table passes through reading ids from its start (-1 once forbidden)."""
    state, states = 0, []
    for t in ids:
        state = int(table.next[state, table.classes[t]]) if state >= 0 else -1
        states.append(state)
    return states


def test_the_automaton_accepts_what_the_constraint_allows(pair):
    """Over the embedded tokenizer: the choices' own tokenizations end in a complete state; from
    the start, the allowed tokens are exactly those whose bytes begin some choice (each a prefix
    or the whole); JSON that validates is accepted, JSON missing a field is not; EOS only where
    the output may end."""
    target, _ = pair
    tok, eos = target.tokenizer, target.config.eos_token_ids
    vocab = vocab_bytes(tok, target.config.vocab_size)
    choice = compile_constraint(SO(choice=CHOICE), vocab, eos)
    for c in CHOICE:
        states = walk(choice, tok.encode(c, add_special_tokens=False))
        assert min(states) >= 0 and (choice.done[states[-1]] or c == "no")  # "no" may go on to "not sure"
    allowed = {i for i in range(len(vocab)) if choice.next[0, choice.classes[i]] >= 0}
    expected = {i for i, b in enumerate(vocab) if b and i not in eos
                and any(c.encode().startswith(b) for c in CHOICE)}
    assert allowed == expected and allowed
    no = walk(choice, tok.encode("no", add_special_tokens=False))[-1]
    assert all(choice.next[no, choice.classes[e]] == no for e in eos)  # "no" may end: EOS allowed
    assert all(choice.next[0, choice.classes[e]] < 0 for e in eos)
    schema = compile_constraint(SO(json=SCHEMA), vocab, eos)
    good = '{"name": "add", "arguments": 2, "kind": "pure", "tags": ["math"]}'
    assert schema.done[walk(schema, tok.encode(good, add_special_tokens=False))[-1]]
    missing = '{"name": "add", "kind": "pure"'
    assert walk(schema, tok.encode(missing, add_special_tokens=False))[-1] < 0
    # an output may go on past a point where it could end ("ab" then "c Xyz"), token by token
    regex = compile_constraint(SO(regex=REGEX), vocab, eos)
    for text in ("123-ab", "123-abc Xyz"):
        states = walk(regex, tok.encode(text, add_special_tokens=False))
        assert min(states) >= 0 and all(regex.next[states[-1], regex.classes[e]] == states[-1] for e in eos)
    with pytest.raises(jaxspec.InputError, match="structured_outputs could not be compiled"):
        compile_constraint(SO(regex="[unclosed"), vocab, eos)


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        import re

        return re.fullmatch(REGEX, text) is not None
    return text in CHOICE


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_outputs_that_stop_are_valid(pair, kind):
    """Issue 49's bar: 8 HumanEval prompts, greedy and sampled at 0.8, max_tokens 256, under a
    draft model's chain: every output that finishes "stop" parses and validates, 7 in 8 do."""
    target, draft = pair
    constraint = {"json": SO(json=SCHEMA), "regex": SO(regex=REGEX), "choice": SO(choice=CHOICE)}[kind]
    prompts = [p + "\n# Summary:\n" for p in load_prompts(limit=8)]
    for temperature in (0.0, 0.8):
        sampling = SamplingParams(temperature=temperature, max_tokens=256, seed=3, structured_outputs=constraint)
        outs = jaxspec.generate(prompts, target, draft, sampling=sampling, num_draft_tokens=3)
        stopped = [o for o in outs if o.finish_reason == "stop"]
        assert len(stopped) >= 7, [(o.text, o.finish_reason) for o in outs]
        assert all(valid(kind, o.text) for o in stopped), [o.text for o in stopped]


DRAFTERS = {
    "model K=3": lambda t, d: (d, dict(num_draft_tokens=3)),
    "model tree": lambda t, d: (d, dict(tree="binary-3")),
    "ngram": lambda t, d: ("ngram", dict(num_draft_tokens=4)),
    "suffix": lambda t, d: ("suffix", dict(num_draft_tokens=4)),
    "eagle": lambda t, d: (jaxspec.load(CHECKPOINTS / "hf" / "code-eagle-16m", dtype="float32"),
                           dict(num_draft_tokens=3)),
    "eagle tree": lambda t, d: (jaxspec.load(CHECKPOINTS / "hf" / "code-eagle-16m", dtype="float32"),
                                dict(tree="binary-3")),
}


@pytest.fixture(scope="module")
def constrained(pair):
    """Prompts beside per-prompt settings: a schema, a regex, a choice and one unconstrained row
    (they share each batch), greedy; with logprobs of both modes."""
    target, _ = pair
    prompts = [p + "\n# Summary:\n" for p in load_prompts(limit=4)]
    so = [SO(json=SCHEMA), SO(regex=REGEX), SO(choice=CHOICE), None]
    modes = ["raw_logprobs", "processed_logprobs", "processed_logprobs", "raw_logprobs"]
    sampling = [SamplingParams(temperature=0, max_tokens=80, seed=0, structured_outputs=s, logprobs=2,
                               logprobs_mode=m) for s, m in zip(so, modes)]
    return prompts, sampling, jaxspec.generate(prompts, target, sampling=sampling)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_constrained_output_equals_plain_under_every_drafter(pair, constrained, drafter):
    target, draft = pair
    prompts, sampling, plain = constrained
    how, kw = DRAFTERS[drafter](target, draft)
    spec = jaxspec.generate(prompts, target, how, sampling=sampling, **kw)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    for a, b in zip(spec, plain):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys() and np.allclose(list(x.values()), list(y.values()), atol=1e-4)
    assert valid("json", plain[0].text) and valid("regex", plain[1].text) and valid("choice", plain[2].text)
    # processed logprobs are the constrained distribution's: every alternative the choice row lists
    # begins a choice, or has probability 0; raw ones are the model's own, over forbidden tokens too
    decode = target.tokenizer.decode
    assert all(any(c.startswith(decode([t])) for c in CHOICE) or v == -np.inf
               for t, v in list(plain[2].logprobs[0].items())[1:])
    assert any(not decode([t]).startswith("{") for t in list(plain[0].logprobs[0])[1:])


VOCAB = 16
LETTERS = "abcdefghijklmnop"
PROMPT = (3, 7, 1, 12)
N = 40_000
# 3-letter words over the tiny vocabulary: the output is one of them, so each token's allowed set
# is the next letters of the words its prefix begins
WORDS = sorted(a + b + c for a in "abc" for b in "bcde" for c in "aceg" if (ord(a) + ord(b) + ord(c)) % 3)


def char_tokenizer(folder: Path):
    """A tokenizer whose 16 tokens are the letters a..p, one each."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({c: i for i, c in enumerate(LETTERS)}, unk_token="a"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    base = dict(vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=0, initializer_range=0.5)
    root = tmp_path_factory.mktemp("pair")
    for name, seed, layers in (("t", 3, 2), ("d", 4, 1)):
        save_tiny(root / name, "llama", {**base, "num_hidden_layers": layers}, seed=seed)
        char_tokenizer(root / name)
    return tuple(jaxspec.load(root / name, dtype="float32") for name in ("t", "d"))


def exact_joint(target, temperature: float) -> np.ndarray:
    """P(token 2 = a, token 3 = b) under plain constrained sampling, written out: at each prefix the
    target's softmax(logits / T) restricted to the letters that continue some word, renormalized."""
    from jaxspec.model.cache import KVCache
    from jaxspec.model.forward import forward

    def probs(prefix):
        cache = KVCache.create(target.config, 1, len(PROMPT) + 3, target.dtype)
        logits, _ = forward(target.weights, target.config, jax.numpy.asarray([PROMPT + prefix], jax.numpy.int32), cache)
        p = np.exp(np.asarray(logits[0, -1], np.float64) / temperature)
        text = "".join(LETTERS[t] for t in prefix)
        ok = np.zeros(VOCAB, bool)
        ok[[LETTERS.index(w[len(text)]) for w in WORDS if w.startswith(text)]] = True
        p = np.where(ok, p, 0.0)
        return p / p.sum()

    joint = np.zeros((VOCAB, VOCAB))
    p1 = probs(())
    for a in np.flatnonzero(p1):
        p2 = probs((a,))
        for b in np.flatnonzero(p2):
            joint[b] += p1[a] * p2[b] * probs((a, b))
    return joint


def sampled_joint(target, draft, temperature: float, tree=None, graphs=None) -> np.ndarray:
    s = SamplingParams(temperature=temperature, max_tokens=3, structured_outputs=SO(choice=WORDS))
    reqs = [Request(PROMPT, dataclasses.replace(s, seed=seed)) for seed in range(N)]
    outs = run(target, reqs, 8192, DecodeMethod.of(draft, 2, tree), draft, graphs=graphs)
    counts = np.zeros((VOCAB, VOCAB))
    for o in outs:
        assert len(o.token_ids) == 3 and o.finish_reason == "stop" and o.text in WORDS
        counts[o.token_ids[1], o.token_ids[2]] += 1
    return counts


@pytest.mark.parametrize("how", ["model chain", "eagle tree"])
def test_constrained_sampling_is_exact(tiny_pair, tmp_path, how):
    """Tokens 2 and 3 come from one draft -> verify round (K = 2) whose draft and target
    distributions are both masked along the drafted path: their joint is plain constrained
    sampling's. The EAGLE-3 head's vocabulary holds 12 of the 16 letters, so some allowed letters
    are ones it cannot propose."""
    from jaxspec.model.eagle import random_eagle_folder

    target, draft = tiny_pair
    tree = None
    if how == "eagle tree":
        draft = jaxspec.load(random_eagle_folder(tmp_path / "head", target.config, draft_vocab_size=12, seed=5),
                             dtype="float32")
        tree = (-1, 0, 0, 1, 2)
    assert chi2_pvalue(sampled_joint(target, draft, 0.9, tree), exact_joint(target, 0.9)) > 1e-4


def test_the_test_sees_a_draft_distribution_left_unmasked(tiny_pair):
    """A draft that samples under the mask but reports its unmasked distribution as q is accepted
    too often: the exact test above must reject it."""
    target, draft = tiny_pair
    real = draft_model.constrained_pick

    def reports_unmasked(logits, r, keys, state):
        token, _, state2 = real(logits, r, keys, state)
        return token, draft_model._pick(logits, r.sampling, keys, r.greedy_only)[1], state2

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(draft_model, "constrained_pick", reports_unmasked)
        jax.clear_caches()
        counts = sampled_joint(target, draft, 0.9, graphs=jaxspec.GraphCache())  # traced afresh
    jax.clear_caches()
    assert chi2_pvalue(counts, exact_joint(target, 0.9)) < 1e-6


def test_a_constraint_that_cannot_compile_is_refused_before_any_work(pair):
    target, _ = pair
    with pytest.raises(jaxspec.InputError, match="structured_outputs could not be compiled"):
        jaxspec.generate(["def f():"], target, sampling=SamplingParams(structured_outputs={"regex": "(a"}))
    with pytest.raises(jaxspec.InputError, match="structured_outputs.json could not be compiled: Unsupported type"):
        jaxspec.generate(["def f():"], target, sampling=SamplingParams(structured_outputs={"json": {"type": "foo"}}))


def test_constraints_in_batch_files_and_on_the_command_line(pair, tmp_path, capsys):
    """An OpenAI batch file (response_format json_schema and json_object; an invalid schema gets
    an error line and the rest are answered) beside jaxspec's own records (structured_outputs);
    and `jaxspec generate --json-schema FILE` / `--choice`."""
    from jaxspec import cli
    from jaxspec.batch import read_output

    prompt = load_prompts(limit=1)[0] + "\n# Summary:\n"

    def body(fmt):
        return {"prompt": prompt, "max_tokens": 96, "response_format": fmt}

    lines = [
        {"custom_id": "schema", "method": "POST", "url": "/v1/completions",
         "body": body({"type": "json_schema", "json_schema": {"name": "summary", "schema": SCHEMA}})},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
         "body": body({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})},
        {"custom_id": "object", "method": "POST", "url": "/v1/completions", "body": body({"type": "json_object"})},
        {"id": "own", "prompt": prompt, "max_tokens": 64, "structured_outputs": {"choice": CHOICE}},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert cli.main(["batch", str(src), str(out), "--batch-size", "4", "--no-plot", "--no-progress"]) == 0
    got = {x.get("custom_id") or x["id"]: x for x in read_output(out)}
    assert got["bad"]["error"]["code"] == "invalid_request" and "Unsupported type: foo" in got["bad"]["error"]["message"]
    schema = got["schema"]["response"]["body"]["choices"][0]
    assert schema["finish_reason"] == "stop" and valid("json", schema["text"])
    obj = got["object"]["response"]["body"]["choices"][0]
    assert obj["finish_reason"] != "stop" or isinstance(json.loads(obj["text"]), dict)
    assert got["own"]["text"] in CHOICE and got["own"]["finish_reason"] == "stop"

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    for flags, kind in ((["--json-schema", str(schema_file)], "json"), (["--choice", CHOICE[0], "--choice", CHOICE[1]],
                                                                         "choice")):
        assert cli.main(["generate", prompt, "--json", "--max-new-tokens", "96", *flags]) == 0
        printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert printed["finish_reason"] == "stop" and valid(kind, printed["text"])


def test_deterministic_mode_keeps_its_bits_under_a_constraint(tmp_path):
    """bfloat16, deterministic (a tiny Llama whose small weights leave near-ties for bf16 rounding
    to decide, over the letters a..p): constrained rows beside an unconstrained one give the same
    tokens and logprobs, bit for bit, alone or in a batch, plain or speculative."""
    folder = save_tiny(tmp_path / "tiny", "llama", dict(initializer_range=0.02, eos_token_id=None), seed=3)
    char_tokenizer(folder)
    target = jaxspec.load(folder, dtype="bfloat16")
    prompts = [[3, 7, 1, 12, 5], [9, 2, 2, 14], [4, 4, 8, 1, 11, 6]]
    constraints = [SO(regex="([a-d][e-p])+"), SO(choice=["abc", "abd", "abcdefgh", "pop"]), None]
    sampling = [SamplingParams(temperature=0, max_tokens=20, seed=0, logprobs=2, structured_outputs=c)
                for c in constraints]
    det = dict(deterministic=True, warn_below_acceptance=0.0, max_batch_size=4)
    plain = jaxspec.generate(prompts, target, sampling=sampling, **det)
    alone = jaxspec.generate(prompts[:1], target, sampling=sampling[:1], **det)
    spec = jaxspec.generate(prompts, target, target, sampling=sampling, num_draft_tokens=3, **det)
    ngram = jaxspec.generate(prompts, target, "ngram", sampling=sampling, num_draft_tokens=3, **det)
    for other in (spec, ngram):
        assert [(c.token_ids, c.logprobs) for c in other] == [(c.token_ids, c.logprobs) for c in plain]
    assert (alone[0].token_ids, alone[0].logprobs) == (plain[0].token_ids, plain[0].logprobs)
    import re

    assert re.fullmatch("([a-d][e-p])+", plain[0].text) and plain[1].text in ("abc", "abd", "abcdefgh", "pop")
    assert spec.metrics.accepted > 0
