"""Benchmark workloads: chat-like budget mixes and the repository's HumanEval prompts as batch jobs
(as they are, behind one shared few-shot preamble, or as near-duplicates)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import numpy as np

from jaxspec.bench.humaneval import load_prompts
from jaxspec.errors import InputError


def lognormal_budgets(n: int, median: float = 200, sigma: float = 0.8, cap: int = 1024, seed: int = 0) -> list[int]:
    """Chat-like answer lengths: n draws of a fixed-seed lognormal (this median and sigma), in [1, cap]."""
    draws = np.random.default_rng(seed).lognormal(np.log(median), sigma, n)
    return [int(x) for x in np.clip(np.ceil(draws), 1, cap)]


def write_humaneval_jsonl(path: str | Path, limit: int | None = None, lognormal: dict | bool | None = None) -> Path:
    """Writes the repository's HumanEval prompts as a batch input ({"id": "HumanEval/i", "prompt"}).
    lognormal: True (or lognormal_budgets' keywords) gives each record its own "max_new_tokens",
    drawn from that fixed-seed mix: a job whose records end at very different lengths."""
    path = Path(path)
    if path.exists():
        raise InputError(f"{path} already exists; not overwriting it")
    path.parent.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(limit=limit)
    records = [{"id": f"HumanEval/{i}", "prompt": p} for i, p in enumerate(prompts)]
    if lognormal:
        for r, budget in zip(records, lognormal_budgets(len(records), **(lognormal if isinstance(lognormal, dict) else {}))):
            r["max_new_tokens"] = budget
    lines = [json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_fewshot_jsonl(path: str | Path, tokenizer, records: int = 48, preamble_tokens: int = 900) -> Path:
    """A few-shot job: one preamble of about `preamble_tokens` tokens (by `tokenizer`; the last
    HumanEval stubs, as worked examples) before each of `records` distinct questions (the first
    HumanEval stubs): {"id": "fewshot/i", "prompt"}. Every record shares the preamble."""
    path = Path(path)
    if path.exists():
        raise InputError(f"{path} already exists; not overwriting it")
    stubs = load_prompts()
    if records > len(stubs) // 2:
        raise InputError(f"records must be at most {len(stubs) // 2}; got {records}")
    preamble = "# Worked examples.\n"
    for stub in reversed(stubs[records:]):
        if len(tokenizer.encode(preamble + stub)) > preamble_tokens:
            break
        preamble += stub
    lines = [json.dumps({"id": f"fewshot/{i}", "prompt": preamble + "\n# Question.\n" + q}) for i, q in enumerate(stubs[:records])]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def renamed(stub: str, variant: int) -> str:
    """A HumanEval stub as another author might write it: its last function and that function's
    arguments renamed (everywhere in the stub, docstring and examples included), after a comment
    line naming the variant."""
    fn = [node for node in ast.parse(stub).body if isinstance(node, ast.FunctionDef)][-1]
    names = {fn.name: f"{fn.name}_v{variant}"}
    names.update({a.arg: f"{a.arg}_{variant}" for a in fn.args.args})
    text = re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b", lambda m: names[m.group(1)], stub)
    return f"# Variant {variant} of {fn.name}.\n{text}"


def write_near_duplicate_jsonl(path: str | Path, stubs: int = 64, variants: int = 2, seed: int = 0) -> Path:
    """A job of near-duplicate records: each of the first `stubs` HumanEval stubs as `variants`
    renamed versions (renamed()), in a fixed-seed random order; no two records identical.
    {"id": "neardup/i/v", "prompt"}."""
    path = Path(path)
    if path.exists():
        raise InputError(f"{path} already exists; not overwriting it")
    prompts = load_prompts(limit=stubs)
    records = [{"id": f"neardup/{i}/{v}", "prompt": renamed(p, v)} for i, p in enumerate(prompts) for v in range(variants)]
    if len({r["prompt"] for r in records}) != len(records):
        raise AssertionError("two near-duplicate records came out identical")
    order = np.random.default_rng(seed).permutation(len(records))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(records[i]) + "\n" for i in order), encoding="utf-8")
    return path
