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

    @property
    def nbytes(self) -> int:
        return self.classes.nbytes + self.next.nbytes + self.done.nbytes


def compile_constraint(params: StructuredOutputsParams, vocab: tuple[bytes, ...], eos_ids: tuple[int, ...]) -> ConstraintTable:
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
    tokens = {s: np.fromiter(t.keys(), np.int64, len(t)) for s, t in transitions.items()}
    targets = {s: np.fromiter(t.values(), np.int64, len(t)) for s, t in transitions.items()}
    first = index.get_initial_state()
    states = np.unique(np.concatenate([np.fromiter(transitions, np.int64), *targets.values()]))
    states = np.concatenate([[first], states[states != first]])  # numbered so, the start is 0
    ids_of = np.zeros(states.max() + 1, np.int32)
    ids_of[states] = np.arange(len(states))
    dense = np.full((len(states), len(vocab)), -1, np.int32)
    accepting = np.zeros(len(states), bool)
    for s in transitions:
        keep = tokens[s] < len(vocab)
        dense[ids_of[s], tokens[s][keep]] = ids_of[targets[s][keep]]
        accepting[ids_of[s]] = end in transitions[s]
    eos_cols = [e for e in eos_ids if e < len(vocab)]
    dense[:, eos_cols] = -1
    final_rows = np.flatnonzero(accepting)
    if eos_cols:
        dense[np.ix_(final_rows, eos_cols)] = final_rows[:, None]
    eos_mask = np.zeros(len(vocab), bool)
    eos_mask[eos_cols] = True
    has_text = (dense[:, ~eos_mask] >= 0).any(axis=1)
    done = accepting & ~has_text
    classes, columns = _distinct_columns(dense)
    return ConstraintTable(classes, columns, done, time.perf_counter() - start)


def _distinct_columns(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dense [S, V] -> (each column's class [V] int32, the distinct columns [S, C]): columns grouped
    by two random 64-bit hashes, then checked equal to their group's first (so exact)."""
    rng = np.random.default_rng(0)
    weights = rng.integers(1, 2**62, (dense.shape[0], 2), dtype=np.int64)
    hashes = (dense.T.astype(np.int64) + 1) @ weights  # wraps mod 2**64: still a hash
    _, first, classes = np.unique(hashes, axis=0, return_index=True, return_inverse=True)
    classes = classes.reshape(-1).astype(np.int32)
    columns = np.ascontiguousarray(dense[:, first])
    if not np.array_equal(columns[:, classes], dense):
        raise RuntimeError("two distinct columns of a constraint's table hashed alike")
    return classes, columns
