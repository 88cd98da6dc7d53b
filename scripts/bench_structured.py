#!/usr/bin/env python3
"""Structured outputs' costs (issue 49), each printed as one JSON line:

- compile: the committed test schema (tests/data/structured_schema.json) compiled over a
  vocabulary: states, distinct token columns, seconds (a fresh compile, nothing cached), and the
  device table's bytes. On the model's own vocabulary and on byte-level BPE vocabularies trained
  with the `tokenizers` library (--bpe sizes; corpus: the HumanEval prompts, then the Python
  files of the installed jax, numpy and transformers, in sorted order, until the size is reached).
- step: ms per round of plain decoding and of a draft model's chain (K=3), with the mask and
  without, at equal rows and length: greedy, EOS off, every row decoding its whole budget, timed
  through the engine's own decode graph as (decode of n2 tokens - decode of n1) / (rounds at n2 -
  at n1), so the prefill cancels. The masked rows run under the test schema's objects repeated
  (`(?:schema)+`: its table, and a row never completes), so both sides run the same rounds.
- acceptance (--model runs only): the embedded pair on 8 HumanEval prompts, K=3, greedy, with the
  test schema and without.

    python scripts/bench_structured.py --bpe 32000                       # this CPU: the embedded pair
    python3 scripts/bench_structured.py --shape llama3-8b --draft-shape llama3.2-1b --bpe 128256 \\
        --rows 1,8 --dtype bfloat16                                      # a GPU: random weights
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import sys
import types
from pathlib import Path

import jax
import numpy as np

import jaxspec
from jaxspec.bench.common import best_seconds, machine
from jaxspec.bench.humaneval import load_prompts
from jaxspec.bench.shapes import random_model
from jaxspec.decoding.constraints import ConstraintTables
from jaxspec.decoding.loop import decode
from jaxspec.decoding.method import DecodeMethod
from jaxspec.decoding.stop_strings import StopPlan
from jaxspec.defaults import CHECKPOINTS
from jaxspec.model.tokenizer import token_bytes
from jaxspec.serving.batching import bucket, cache_capacity, make_batch
from jaxspec.serving.options import RunOptions
from jaxspec.serving.requests import Request
from jaxspec.structured_outputs import StructuredOutputsParams, _compiled, compile_constraint

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "tests" / "data" / "structured_schema.json").read_text())


def emit(**row):
    print(json.dumps(row), flush=True)


def bpe_tokenizer(size: int, folder: Path):
    """A byte-level BPE tokenizer of `size` tokens (cached in folder)."""
    import tokenizers

    path = folder / f"bpe-{size}.json"
    if path.is_file():
        return tokenizers.Tokenizer.from_file(str(path))

    def corpus():
        yield from load_prompts()
        for package in ("jax", "numpy", "transformers"):
            base = Path(__import__(package).__file__).parent
            for f in sorted(base.rglob("*.py")):
                yield f.read_text(errors="ignore")

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=size, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def vocab_of(tok, size: int) -> tuple[bytes, ...]:
    return token_bytes(types.SimpleNamespace(backend=tok), size)


def compile_row(label: str, vocab: tuple[bytes, ...], eos: tuple[int, ...]):
    _compiled.cache_clear()
    table = compile_constraint(StructuredOutputsParams(json=SCHEMA), vocab, eos)
    on_device = jax.device_put(ConstraintTables.stack([table], len(vocab)))
    device_bytes = sum(x.nbytes for x in jax.tree.leaves(on_device))
    emit(kind="compile", vocab=label, vocab_size=len(vocab), states=int(table.next.shape[0]),
         columns=int(table.next.shape[1]), compile_s=round(table.compile_s, 3), device_mb=round(device_bytes / 2**20, 2))
    return table


def step_costs(target, draft, vocab, rows_list, prompt_len, n1, n2, repeats):
    """ms per round with and without the mask, plain and K=3, at each row count (the graphs
    compiled in parallel first)."""
    repeated = StructuredOutputsParams(regex="(?:" + StructuredOutputsParams(json=SCHEMA).pattern() + ")+")
    table = compile_constraint(repeated, vocab, ())
    attention = RunOptions().attention_impl
    rng = np.random.default_rng(0)
    cases = {}
    for rows in rows_list:
        prompts = rng.integers(1, target.config.vocab_size, (rows, prompt_len)).tolist()
        for method in (DecodeMethod("plain"), DecodeMethod("draft", 3)):
            loop, params = method.loop(target, draft)
            for masked in (False, True):
                plan = StopPlan(constraints={repeated: table} if masked else {},
                                vocab_size=target.config.vocab_size if masked else 1)
                batches = {n: make_batch([Request(tuple(p), jaxspec.SamplingParams(
                    temperature=0, max_tokens=n, seed=0, structured_outputs=repeated if masked else None))
                    for p in prompts], rows, bucket(prompt_len), target.config.pad_token_id, plan) for n in (n1, n2)}
                static = dict(loop=loop, capacity=cache_capacity(bucket(prompt_len), bucket(n2), loop.slack),
                              max_out=bucket(n2), greedy_only=True, attention=attention)
                cases[rows, method.name, masked] = (decode.lower(target.weights, params, batches[n1], **static), params,
                                                    batches)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        compiled = dict(zip(cases, pool.map(lambda c: c[0].compile(), cases.values())))
    out = {}
    for (rows, name, masked), (_, params, batches) in cases.items():
        exe = compiled[rows, name, masked]
        timed = []
        for n in (n1, n2):
            run = lambda: jax.block_until_ready(exe(target.weights, params, batches[n]))  # noqa: E731
            res = run()
            steps = int(np.max(np.asarray(res["rounds"]))) if "rounds" in res else int(
                np.max(np.asarray(res["num_generated"]))) - 1
            assert int(np.min(np.asarray(res["num_generated"]))) == n, "a row ended early"
            timed.append((best_seconds(run, repeats), steps, int(np.sum(np.asarray(res["num_generated"])))))
        (s1, r1, t1), (s2, r2, t2) = timed
        out[rows, name, masked] = ms = 1000 * (s2 - s1) / (r2 - r1)
        emit(kind="step", rows=rows, method=name, mask=masked, ms_per_round=round(ms, 4),
             tokens_per_round=round((t2 - t1) / (r2 - r1) / rows, 3))
        if masked:
            emit(kind="step_ratio", rows=rows, method=name,
                 masked_over_plain=round(ms / out[rows, name, False], 4))


def acceptance(target, draft):
    prompts = [p + "\n# Summary:\n" for p in load_prompts(limit=8)]
    for constraint in (None, StructuredOutputsParams(json=SCHEMA)):
        s = jaxspec.SamplingParams(temperature=0, max_tokens=128, seed=0, structured_outputs=constraint)
        outs = jaxspec.generate(prompts, target, draft, sampling=s, num_draft_tokens=3,
                                options=jaxspec.RunOptions(warn_below_acceptance=0))
        m = outs.metrics
        emit(kind="acceptance", mask=constraint is not None, acceptance=round(m.acceptance_rate, 4),
             tokens_per_step=round(m.tokens_per_step, 3), finished_stop=sum(o.finish_reason == "stop" for o in outs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", help="random-weight target of this shape (default: the embedded target)")
    p.add_argument("--draft-shape", default="llama3.2-1b")
    p.add_argument("--dtype", default=None, help="default: float32 for the embedded pair, bfloat16 for --shape")
    p.add_argument("--bpe", default="", help="comma-separated BPE vocabulary sizes to compile over; with --shape, "
                   "the first is also the masked steps' vocabulary (it must be the shape's)")
    p.add_argument("--bpe-folder", default=str(ROOT / "runs" / "bpe"))
    p.add_argument("--rows", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", default="33,97", help="n1,n2")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.bpe.split(",") if s]
    emit(kind="machine", **machine())
    if args.shape:
        dtype = args.dtype or "bfloat16"
        target = random_model(args.shape, dtype)
        draft = random_model(args.draft_shape, dtype, seed=1)
        if not sizes or sizes[0] != target.config.vocab_size:
            sys.exit(f"--bpe must start with the shape's vocabulary size, {target.config.vocab_size}")
    else:
        dtype = args.dtype or "float32"
        target = jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype=dtype)
        draft = jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype=dtype)
    eos = target.config.eos_token_ids
    vocab = None
    if target.tokenizer is not None:
        vocab = token_bytes(target.tokenizer, target.config.vocab_size)
        compile_row(target.name, vocab, eos)
    for size in sizes:
        tok = bpe_tokenizer(size, Path(args.bpe_folder))
        if tok.get_vocab_size() != size:
            sys.exit(f"the corpus gave a BPE vocabulary of {tok.get_vocab_size()} tokens, not {size}")
        bpe = vocab_of(tok, size)
        compile_row(f"bpe-{size}", bpe, (tok.token_to_id("<|endoftext|>"),))
        vocab = vocab or bpe
    no_eos = dataclasses.replace(target.config, eos_token_ids=())
    target = dataclasses.replace(target, config=no_eos)
    draft = dataclasses.replace(draft, config=dataclasses.replace(draft.config, eos_token_ids=()))
    n1, n2 = (int(x) for x in args.new_tokens.split(","))
    step_costs(target, draft, vocab, [int(r) for r in args.rows.split(",")], args.prompt_len, n1, n2, args.repeats)
    if not args.shape:
        acceptance(jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype=dtype), jaxspec.load(
            CHECKPOINTS / "hf" / "code-draft-4m", dtype=dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
