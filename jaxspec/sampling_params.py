"""`jaxspec.SamplingParams`: one request's sampling settings, with vLLM's field names, meanings and
defaults (vllm/sampling_params.py), so code and files written for vLLM mean the same here.

Each field declares, beside its default, everything the rest of the engine needs to carry it:
its check, its command-line help, and the dtype of its per-row device array if the decode loop
reads it (`row`). `generate`, batch records, the CLI and the device batch all read these
declarations, so a new setting is a field here plus its use in the loop (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Sequence

import numpy as np

from jaxspec.checks import check_int, check_number
from jaxspec.errors import InputError
from jaxspec.structured_outputs import StructuredOutputsParams

SEED_LIMIT = 2**32


def _temperature(v, name):
    return check_number(v, name, "a finite number >= 0 (0 = greedy)", lambda t: t >= 0)


def _top_p(v, name):
    return check_number(v, name, "in (0, 1] (1 = off)", lambda p: 0 < p <= 1)


def _top_k(v, name):
    k = check_int(v, name, -1, note=" (0 or -1 = off)")
    return 0 if k == -1 else k  # vLLM takes -1 for off too


def _min_p(v, name):
    return check_number(v, name, "in [0, 1] (0 = off)", lambda p: 0 <= p <= 1)


def _seed(v, name):
    return None if v is None else check_int(v, name, 0, SEED_LIMIT - 1, allowed="in [0, 2**32)")


def _max_tokens(v, name):
    return check_int(v, name, 1)


MAX_LOGPROBS = 20  # vLLM's default max_logprobs
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def _optional_count(v, name, most: int):
    return None if v is None else check_int(v, name, 0, most)


def _logprobs_mode(v, name):
    if v not in LOGPROBS_MODES:
        raise InputError(f"{name} must be one of {', '.join(LOGPROBS_MODES)}; got {v!r}")
    return v


def _stop(v, name):
    """None, a string or a list of non-empty strings -> a tuple (vLLM takes a string or a list)."""
    if v is None:
        return ()
    stops = (v,) if isinstance(v, str) else v
    if isinstance(stops, bytes) or not hasattr(stops, "__iter__"):
        raise InputError(f"{name} must be a string or a list of strings; got {v!r}")
    stops = tuple(stops)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise InputError(f"{name} must hold non-empty strings; got {s!r}")
    return stops


def _stop_token_ids(v, name):
    """None or a list of token ids (>= 0; the vocabulary is checked with the prompt) -> a tuple."""
    if v is None:
        return ()
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise InputError(f"{name} must be a list of token ids; got {v!r}")
    return tuple(check_int(t, f"{name} entry", 0) for t in v)


LOGIT_BIAS_LIMIT = 100  # OpenAI's range for a bias: [-100, 100]


def _logit_bias(v, name):
    """None or {token id: bias} (ids as ints or, as JSON object keys are, decimal strings; biases
    in [-100, 100]) -> ((id, bias), ...) sorted by id (hashable, like every field)."""
    if v is None:
        return ()
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in v):
        items = list(v)
    else:
        raise InputError(f"{name} must be an object of token ids to biases, e.g. {{\"50256\": -100}}; got {v!r}")
    out = {}
    for key, bias in items:
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        token = check_int(token, f"{name} key", 0, note=" (a token id)")
        out[token] = check_number(bias, f"{name}[{key!r}]", f"a number in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}]",
                                  lambda b: abs(b) <= LOGIT_BIAS_LIMIT)
    return tuple(sorted(out.items()))


def _json_object(text: str) -> dict:
    """--logit-bias '{"50256": -100}' (argparse type; checked with the other values)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"50256\": -100}}', got {text!r}") from None


def _id_list(text: str) -> list[int]:
    """--stop-token-ids 2,7 (argparse type; checked with the other values)."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def setting(default, check, help: str, row=None, cli=None):
    """A SamplingParams field: `check(value, name)` -> the value to keep (or InputError naming
    `name`); `row`: the numpy dtype of its per-row device array (jaxspec.decoding.sampling), None
    when the loop does not read it as one, or (dtype, a function from the value to the row's); `cli`: its command-line flag's argparse keywords
    (a type: {"type": float}; None: no flag)."""
    return dataclasses.field(default=default, metadata=dict(check=check, help=help, row=row, cli=cli))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one request (vLLM's names and defaults: `SamplingParams()` samples at
    temperature 1.0 and stops after 16 tokens; `generate`'s own keywords default to greedy and
    128 tokens). Every value is checked on construction; InputError names the field."""

    n: int = setting(1, lambda v, name: check_int(v, name, 1), "samples per prompt (>= 1), each from its own "
                     "random stream", cli={"type": int})
    temperature: float = setting(1.0, _temperature, "0 = greedy; > 0 samples", np.float32, {"type": float})
    top_p: float = setting(1.0, _top_p, "keep the smallest set of most likely tokens whose mass reaches "
                           "top_p, in (0, 1] (1 = off)", np.float32, {"type": float})
    top_k: int = setting(0, _top_k, "keep the k most likely tokens (0 or -1 = off)", np.int32, {"type": int})
    min_p: float = setting(0.0, _min_p, "keep the tokens with probability >= min_p x the most likely "
                           "token's, in [0, 1] (0 = off)", np.float32, {"type": float})
    seed: int | None = setting(None, _seed, "random seed; each prompt gets its own stream (default: "
                               "vLLM's none, a fresh random seed; generate and the CLI: 0)", cli={"type": int})
    max_tokens: int = setting(16, _max_tokens, "tokens to generate per prompt (>= 1)", cli={"type": int})
    presence_penalty: float = setting(
        0.0, lambda v, name: check_number(v, name, "in [-2, 2] (0 = off)", lambda x: -2 <= x <= 2),
        "subtracted from the logit of every token the output holds (OpenAI's rule)", np.float32, {"type": float})
    frequency_penalty: float = setting(
        0.0, lambda v, name: check_number(v, name, "in [-2, 2] (0 = off)", lambda x: -2 <= x <= 2),
        "subtracted from a token's logit once per time the output holds it (OpenAI's rule)", np.float32,
        {"type": float})
    repetition_penalty: float = setting(
        1.0, lambda v, name: check_number(v, name, "a number > 0 (1 = off)", lambda x: x > 0),
        "divides the positive logits, and multiplies the negative ones, of tokens in the prompt or the output "
        "(HF's rule; 1 = off)", np.float32, {"type": float})
    logprobs: int | None = setting(
        None, lambda v, name: _optional_count(v, name, MAX_LOGPROBS),
        f"log-probabilities per generated token: the chosen token's and the top N alternatives' (0-{MAX_LOGPROBS}; "
        "default none)", cli={"type": int})
    prompt_logprobs: int | None = setting(
        None, lambda v, name: _optional_count(v, name, MAX_LOGPROBS),
        f"log-probabilities of the prompt's tokens: each one's and the top N alternatives' (0-{MAX_LOGPROBS}; "
        "default none)", cli={"type": int})
    logprobs_mode: str = setting(
        "raw_logprobs", _logprobs_mode, "raw_logprobs: the target's own, before temperature and filters (vLLM's "
        "default); processed_logprobs: after them", row=(np.bool_, lambda mode: mode == "processed_logprobs"),
        cli={"choices": LOGPROBS_MODES})
    stop: tuple[str, ...] = setting(
        (), _stop, "a string that ends a request when the output contains it; the text ends before it "
        "(finish_reason 'stop', stop_reason the string); repeat for several", cli={"action": "append"})
    stop_token_ids: tuple[int, ...] = setting(
        (), _stop_token_ids, "token ids that end a request when generated (besides the model's EOS ids), "
        "comma-separated; finish_reason 'stop', stop_reason the id", cli={"type": _id_list})
    logit_bias: tuple[tuple[int, float], ...] = setting(
        (), _logit_bias, "added to these tokens' logits before penalties, temperature and the filters: a JSON object "
        "of token ids to biases in [-100, 100] (OpenAI's rule)", cli={"type": _json_object})

    structured_outputs: StructuredOutputsParams | None = setting(
        None, lambda v, name: StructuredOutputsParams.of(v, name), "the output's constraint: "
        "StructuredOutputsParams(json=..., regex=..., choice=[...], json_object=True), or its fields as an object "
        "(command line: --json-schema FILE, --regex, --choice)")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name), f.name))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self) -> "SamplingParams":
        """A seed of None (vLLM's default) drawn now: the request is then reproducible from here on."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=int.from_bytes(os.urandom(4), "little"))

    def updated(self, values: dict, where: str = "") -> "SamplingParams":
        """These settings with `values` (field name -> value, or an alias such as max_new_tokens)
        put over them; an unknown name is an InputError naming it, prefixed by `where`."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        given = {}
        for key, value in values.items():
            name = ALIASES.get(key, key)
            if name not in fields:
                known = ", ".join(sorted(fields.keys() | ALIASES.keys()))
                raise InputError(f"{where}{key} is not a sampling setting; known: {known}")
            given[name] = fields[name].metadata["check"](value, where + key)  # the error names it as given
        return dataclasses.replace(self, **given)


# Older jaxspec spellings accepted as inputs (generate's keyword, batch records, the CLI).
ALIASES = {"max_new_tokens": "max_tokens"}

# generate's, the CLI's and batch jobs' defaults: greedy, 128 tokens, seed 0 (reproducible).
GREEDY = SamplingParams(temperature=0.0, max_tokens=128, seed=0)

# The fields the decode loop reads per row, and the value that leaves each one off (a padding row's).
ROW_FIELDS = {f.name: f.metadata["row"] if isinstance(f.metadata["row"], tuple) else (f.metadata["row"], None)
              for f in dataclasses.fields(SamplingParams) if f.metadata["row"]}
_NEUTRAL = SamplingParams(temperature=0.0)


def row_values(params: Sequence[SamplingParams], rows: int) -> dict[str, np.ndarray]:
    """Per-row device arrays [rows] of each loop-read field, for `params` in rows 0.. and neutral
    values (greedy, filters off) in the padding rows past them."""
    out = {}
    for name, (dtype, convert) in ROW_FIELDS.items():
        value = convert or (lambda v: v)
        a = np.full(rows, value(getattr(_NEUTRAL, name)), dtype)
        a[: len(params)] = [value(getattr(p, name)) for p in params]
        out[name] = a
    return out


def add_cli_args(parser) -> None:
    """The command-line flags of every field (--temperature, --top-p, ..., --max-new-tokens, which
    --max-tokens also names); their defaults are GREEDY's, read back by from_cli."""
    for f in dataclasses.fields(SamplingParams):
        if f.metadata["cli"] is None:
            continue
        flags = [f"--{f.name.replace('_', '-')}"]
        if f.name == "max_tokens":
            flags = ["--max-new-tokens", "--max-tokens"]
        default = getattr(GREEDY, f.name)
        parser.add_argument(*flags, dest=f"sampling_{f.name}", default=None, metavar=f.name.upper(),
                            help=f"{f.metadata['help']}" + (f" (default {default})" if default not in ((), None) else ""),
                            **f.metadata["cli"])
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", dest="sampling_json_schema", metavar="FILE",
                            help="constrain every output to JSON matching the schema in FILE (structured_outputs.json)")
    constraint.add_argument("--regex", dest="sampling_regex", help="constrain every output to match REGEX whole "
                            "(structured_outputs.regex)")
    constraint.add_argument("--choice", dest="sampling_choice", action="append",
                            help="constrain every output to one of these strings; repeat for each (structured_outputs.choice)")


def from_cli(args, base: SamplingParams = GREEDY) -> SamplingParams:
    """add_cli_args' flags over `base`; a bad value is an InputError naming the field."""
    given = {f.name: getattr(args, f"sampling_{f.name}") for f in dataclasses.fields(SamplingParams)
             if getattr(args, f"sampling_{f.name}", None) is not None}
    schema_file = getattr(args, "sampling_json_schema", None)
    if schema_file is not None:
        try:
            with open(schema_file) as f:
                given["structured_outputs"] = {"json": f.read()}
        except OSError as e:
            raise InputError(f"--json-schema: cannot read {schema_file}: {e.strerror}") from None
    for flag in ("regex", "choice"):
        if getattr(args, f"sampling_{flag}", None) is not None:
            given["structured_outputs"] = {flag: getattr(args, f"sampling_{flag}")}
    return base.updated(given)
