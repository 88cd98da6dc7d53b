"""`jaxspec.StructuredOutputsParams`: a request's output constraint, with vLLM's field names
(vllm/sampling_params.py: json, regex, choice, json_object, ...), and its compilation into a
token-level automaton the decode loop steps on the device (jaxspec.decoding.constraints).

outlines-core does the language work: a JSON schema becomes a regular expression, and a regular
expression over a vocabulary a token-level DFA. That DFA is turned into three arrays:
  classes [V] int32  each token's column: tokens that every state treats alike share one
  next [S, C] int32  the state after a column's token from each state, -1 where not allowed
  done [S] bool      the constraint is complete and only an EOS may follow: the row ends here
State 0 is the start. The model's EOS ids are allowed in accepting states and nowhere else; the
special tokens (which add no text) nowhere. Nested JSON is not regular, so `json_object` takes a
bounded depth (json_object_depth). Compiled tables are cached by constraint and vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

import numpy as np

from jaxspec.checks import check_int
from jaxspec.errors import InputError

UNSUPPORTED = {
    "grammar": "a context-free grammar is not a finite automaton; give json, regex or choice",
    "structural_tag": "structural tags are not supported; give json, regex or choice",
}
KINDS = ("json", "regex", "choice", "json_object")
JSON_OBJECT_DEPTH = 2  # objects (or arrays) inside the object, and scalars inside those


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's StructuredOutputsParams): exactly one of
    json (a JSON schema, as a dict or its text), regex (the whole output matches it), choice (the
    output is one of these strings) or json_object=True (any JSON object, nested at most
    json_object_depth deep: jaxspec's setting, as nested JSON is not a regular language).
    whitespace_pattern: the regex between JSON tokens (default outlines-core's, `[ ]?`);
    disable_any_whitespace: none at all. Values are checked on construction (InputError names
    the field); the schema or regex itself is compiled, and refused, with the model's vocabulary."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    json_object_depth: int = JSON_OBJECT_DEPTH

    def __post_init__(self):
        name = "structured_outputs"
        for field, why in UNSUPPORTED.items():
            if getattr(self, field) is not None:
                raise InputError(f"{name}.{field}: {why}")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InputError(f"{name} needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise InputError(f"{name}.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InputError(f"{name}.json must be a JSON schema (an object); got {type(schema).__name__}")
            object.__setattr__(self, "json", json.dumps(schema))  # text: hashable; key order kept (it orders the output)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InputError(f"{name}.regex must be a non-empty string; got {self.regex!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not hasattr(self.choice, "__iter__"):
                raise InputError(f"{name}.choice must be a list of strings; got {self.choice!r}")
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise InputError(f"{name}.choice must be a non-empty list of non-empty strings; got {self.choice!r}")
            object.__setattr__(self, "choice", choice)
        if self.json_object not in (None, True, False):
            raise InputError(f"{name}.json_object must be true or false; got {self.json_object!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise InputError(f"{name}.whitespace_pattern must be a string; got {self.whitespace_pattern!r}")
        check_int(self.json_object_depth, f"{name}.json_object_depth", 1, 4)

    @classmethod
    def of(cls, value, name: str = "structured_outputs") -> "StructuredOutputsParams | None":
        """None, a StructuredOutputsParams, or its fields as a dict (a batch record's, a JSON file's)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InputError(f"{name} must be an object with one of {', '.join(KINDS)}; got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in value:
            if key not in known:
                raise InputError(f"{name}.{key} is not a structured-output setting; known: {', '.join(sorted(known))}")
        return cls(**value)

    def as_dict(self) -> dict:
        """The fields that differ from the defaults (the schema as an object), e.g. for a record."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if getattr(self, f.name) != f.default}
        if "json" in out:
            out["json"] = json.loads(out["json"])
        if "choice" in out:
            out["choice"] = list(out["choice"])
        return out

    def pattern(self) -> str:
        """The regular expression the whole output must match (outlines-core's for a schema)."""
        from outlines_core.json_schema import build_regex_from_schema

        if self.regex is not None:
            return self.regex
        if self.choice is not None:
            return "(" + "|".join(_escape(c) for c in self.choice) + ")"
        schema = self.json if self.json is not None else json.dumps(_any_object(self.json_object_depth))
        space = "" if self.disable_any_whitespace else self.whitespace_pattern
        try:
            return build_regex_from_schema(schema, space)
        except (ValueError, TypeError) as e:
            raise InputError(f"structured_outputs.json could not be compiled: {e}") from None


REGEX_META = set(".+*?()|[]{}^$#&-~\\")  # what Rust's regex::escape escapes (Python's re.escape also escapes
# spaces, which outlines-core's parser then misreads)


def _escape(text: str) -> str:
    """text as a literal in outlines-core's (Rust) regex syntax."""
    return "".join("\\" + c if c in REGEX_META else c for c in text)


def _any_object(depth: int) -> dict:
    """A JSON schema of any object whose containers nest at most `depth` deep."""
    scalars = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]
    value = {"anyOf": scalars}
    for _ in range(depth - 1):
        value = {"anyOf": scalars + [{"type": "object", "additionalProperties": value},
                                     {"type": "array", "items": value}]}
    return {"type": "object", "additionalProperties": value}


@dataclasses.dataclass(frozen=True, eq=False)
class ConstraintTable:
    """One compiled constraint over a vocabulary (the module docstring's arrays)."""

    classes: np.ndarray  # [V] int32
    next: np.ndarray  # [S, C] int32
    done: np.ndarray  # [S] bool
    compile_s: float = 0.0


def compile_constraint(params: StructuredOutputsParams, vocab: tuple[bytes, ...],
                       eos_ids: tuple[int, ...]) -> ConstraintTable:
    """params' automaton over `vocab` (each token's bytes; b"" for special tokens). Raises
    InputError with outlines-core's message where the constraint cannot be compiled."""
    return _compiled(params.pattern(), vocab, tuple(eos_ids))


END = "\\x00"  # the byte that marks the output's end to outlines-core (see _compiled)


@functools.lru_cache(maxsize=32)
def _compiled(pattern: str, vocab: tuple[bytes, ...], eos_ids: tuple[int, ...]) -> ConstraintTable:
    """outlines-core 0.2's index lets no token pass through a state where the pattern may end
    into one where it may not (so `a(bc)?` never wrote "abc" one letter at a time, and `(ab|abc)`
    never "abc"). So the pattern is compiled with an end marker, a NUL byte, as one more token:
    no state but the one after the marker is then an accepting state, and a state accepts where
    the marker may follow. Tokens holding a NUL byte are never allowed."""
    from outlines_core import Index, Vocabulary

    start = time.perf_counter()
    texts: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab):
        if b and i not in eos_ids and b"\x00" not in b:
            texts.setdefault(b, []).append(i)
    end = len(vocab)  # the marker's id
    texts[b"\x00"] = [end]
    try:
        index = Index(f"(?:{pattern}){END}", Vocabulary(end + 1, texts))
    except (ValueError, TypeError) as e:
        message = str(e).replace(f"(?:{pattern}){END}", pattern)
        raise InputError(f"structured_outputs could not be compiled over this model's vocabulary: {message}") from None
    transitions = index.get_transitions()
    first = index.get_initial_state()
    # every transition as (state, token, next state), states renumbered with the start as 0
    count = np.fromiter((len(t) for t in transitions.values()), np.int64, len(transitions))
    src = np.repeat(np.fromiter(transitions, np.int64, len(transitions)), count)
    tok = np.concatenate([np.fromiter(ts.keys(), np.int64, len(ts)) for ts in transitions.values()])
    dst = np.concatenate([np.fromiter(ts.values(), np.int64, len(ts)) for ts in transitions.values()])
    states = np.unique(np.concatenate([src, dst]))
    states = np.concatenate([[first], states[states != first]])
    ids_of = np.zeros(states.max() + 1, np.int64)
    ids_of[states] = np.arange(len(states))
    src, dst = ids_of[src], ids_of[dst]
    accepting = np.zeros(len(states), bool)
    accepting[src[tok == end]] = True
    text = tok < len(vocab)
    has_text = np.zeros(len(states), bool)
    has_text[src[text]] = True
    finals = np.flatnonzero(accepting)
    eos = np.asarray([e for e in eos_ids if e < len(vocab)], np.int64)
    # an EOS keeps an accepting state (the row ends on it anyway)
    src = np.concatenate([src[text], np.repeat(finals, len(eos))])
    tok = np.concatenate([tok[text], np.tile(eos, len(finals))])
    dst = np.concatenate([dst[text], np.repeat(finals, len(eos))])
    classes, columns = _distinct_columns(src, tok, dst, len(states), len(vocab))
    return ConstraintTable(classes, columns, accepting & ~has_text, time.perf_counter() - start)


def _distinct_columns(src, tok, dst, states: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Transitions (src, tok, dst) -> (each token's class [vocab] int32, each class's next states
    [states, classes] int32, -1 where not allowed): tokens whose transitions are the same from
    every state share a class. Grouped by a random 64-bit hash of a token's transitions, then
    checked transition by transition (so exact)."""
    rng = np.random.default_rng(0)
    hashes = np.zeros(vocab, np.uint64)  # tokens without transitions: 0, all forbidden
    with np.errstate(over="ignore"):
        w = rng.integers(1, 2**63, (2, states), dtype=np.uint64)
        np.add.at(hashes, tok, w[0, src] * (dst.astype(np.uint64) + np.uint64(1)) + w[1, src])
    _, first, classes = np.unique(hashes, return_index=True, return_inverse=True)
    classes = classes.astype(np.int32)
    columns = np.full((states, len(first)), -1, np.int32)
    rep = np.zeros(vocab, bool)
    rep[first] = True
    at = rep[tok]
    columns[src[at], classes[tok[at]]] = dst[at]
    per_token = np.bincount(tok, minlength=vocab)
    if (not np.array_equal(columns[src, classes[tok]], dst)
            or not np.array_equal(per_token, (columns >= 0).sum(axis=0)[classes])):
        raise RuntimeError("two tokens with different transitions hashed alike")
    return classes, columns
