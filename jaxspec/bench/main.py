"""`jaxspec bench`: tokens/s of plain and speculative decoding on HumanEval prompts, beside HF
transformers (plain and assisted generation) on the same prompts and weights, same machine.

Every configuration is compiled / warmed up first; the reported time is the best of `--repeats`
timed passes over all prompts (jaxspec: device decode time of its calls, prefill included,
compile excluded; HF: wall time of its `generate` calls).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jaxspec import compile_cache
from jaxspec.bench.common import groups, machine
from jaxspec.bench.humaneval import load_prompts
from jaxspec.bench.scale import add_scale_args, run_scale_bench
from jaxspec.bench.schedulers import run_embedded
from jaxspec.checks import int_list, int_list_or_none
from jaxspec.decoding.method import DecodeMethod
from jaxspec.decoding.ngram import Ngram
from jaxspec.defaults import CHECKPOINTS, DEFAULT_DRAFT, DEFAULT_EAGLE, DEFAULT_TARGET, embedded_model
from jaxspec.distributed import add_parallel_args
from jaxspec.errors import CheckpointError, InputError
from jaxspec.model.loading import load
from jaxspec.serving.generate import generate
from jaxspec.serving.options import RunOptions


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model folder (default: embedded code-target-16m)")
    p.add_argument("--draft", help="draft model folder (default: embedded code-draft-4m)")
    p.add_argument("--eagle", help="EAGLE-3 head folder, tried at --eagle-k and --trees beside the draft model "
                                   "(default: embedded code-eagle-16m with the embedded target; '' for none)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample every jaxspec row at this temperature (default 0: greedy; HF rows are greedy only)")
    p.add_argument("--prompts", type=int, default=20, help="first N HumanEval prompts (default 20)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--batch-sizes", type=int_list, help="comma-separated (default 1,8; with --shape 1,8,32,64)")
    p.add_argument("--k", type=int_list_or_none, default=[2, 3, 4],
                   help="draft-model chain lengths K to try (default 2,3,4; '' for none)")
    p.add_argument("--ngram-k", type=int_list_or_none, default=[],
                   help="n-gram lookup lengths K to try, beside HF prompt lookup at batch 1 (default none)")
    p.add_argument("--ngram-branches", type=int_list, default=[1],
                   help="n-gram branch counts to try at each --ngram-k (default 1: a chain)")
    p.add_argument("--trees", default="", help="comma-separated named draft trees to try too (e.g. binary-3,sparse)")
    p.add_argument("--attention", choices=["auto", "xla", "pallas"], default="auto",
                   help="attention path for decode/verify (auto: pallas on GPU, xla on CPU)")
    p.add_argument("--deterministic", action="store_true",
                   help="every jaxspec row in deterministic mode (docs/deterministic.md; chains only)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per row; the best is kept")
    p.add_argument("--hf-repeats", type=int, help="timed passes per HF row (default: --repeats; HF on a CPU is slow)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="jaxspec compute dtype (default: f32 CPU, bf16 GPU)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers rows")
    p.add_argument("--hf-device", default="cpu", help="torch device for HF (default cpu)")
    p.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default="float32", help="HF dtype (default float32)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own)")
    p.add_argument("--json", help="also write all results to this JSON file")

    add_scale_args(p)
    add_parallel_args(p)


def bench_jaxspec(ids, target, draft, k: int, batch: int, max_new: int, repeats: int, tree=None,
                  attention="auto", temperature: float = 0.0) -> dict:
    def one_pass():
        outs, seconds = [], 0.0
        for start, group in zip(range(0, len(ids), batch), groups(ids, batch)):
            res = generate(group, target, draft, max_new_tokens=max_new, num_draft_tokens=k or 1,
                           max_batch_size=batch, warn_below_acceptance=0.0, tree=tree, attention=attention,
                           temperature=temperature, seed=list(range(start, start + len(group))))  # one per prompt
            outs += res
            seconds += res.metrics.decode_s
        return outs, seconds

    one_pass()  # compile every shape
    passes = [one_pass() for _ in range(repeats)]
    outs = passes[0][0]
    seconds = min(s for _, s in passes)
    new = sum(o.stats.new_tokens for o in outs)
    drafted = sum(o.stats.drafted for o in outs)

    method = DecodeMethod.of(draft, k or 1, tree)
    row = {
        "engine": "jaxspec", "batch": batch, "temperature": temperature,
        "method": f"spec K={k}" if method.kind == "draft" and tree is None else method.name,
        "new_tokens": new, "seconds": seconds, "tokens_per_s": new / seconds,
        "tokens_per_step": new / sum(o.stats.target_steps for o in outs),
        "acceptance_rate": sum(o.stats.accepted for o in outs) / drafted if drafted else None,
    }
    return row, [o.token_ids for o in outs]


def hf_folder(path: Path) -> Path:
    """HF can only read the safetensors folder: for a converted checkpoint, its embedded source."""
    if any(path.glob("*.safetensors")):
        return path
    source = CHECKPOINTS / "hf" / path.name
    if any(source.glob("*.safetensors")):
        return source
    raise CheckpointError(f"no HF safetensors for {path} (looked in {source}); pass an HF folder or --no-hf")


def load_hf(path: Path, device: str, dtype: str, threads: int | None):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(hf_folder(path)), dtype=getattr(torch, dtype)).to(device)
    return model.eval()


def bench_hf(ids, model, assistant, batch: int, max_new: int, repeats: int, eos_ids, prompt_lookup: int = 0,
             ngram_max: int = 3) -> dict:
    """HF generate, greedy: plain, assisted (`assistant`) or prompt lookup (`prompt_lookup` tokens,
    matching up to ngram_max tokens, as jaxspec's lookup does)."""
    import torch

    device = model.device

    def call(group):
        width = max(len(g) for g in group)
        pad = model.generation_config.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (width - len(g)) + list(g) for g in group], device=device)
        mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group], device=device)
        kw = {"assistant_model": assistant} if assistant is not None else {}
        if prompt_lookup:
            kw = {"prompt_lookup_num_tokens": prompt_lookup, "max_matching_ngram_size": ngram_max}
        with torch.inference_mode():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new, pad_token_id=pad, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        rows = []
        for r in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(r) if t in eos_ids), len(r))
            rows.append(r[:cut])
        return rows, dt

    call(groups(ids, batch)[0])  # warm-up

    def one_pass():
        rows, seconds = [], 0.0
        for group in groups(ids, batch):
            r, dt = call(group)
            rows += r
            seconds += dt
        return rows, seconds

    passes = [one_pass() for _ in range(repeats)]
    rows = passes[0][0]
    seconds = min(s for _, s in passes)
    new = sum(len(r) for r in rows)
    method = f"prompt lookup K={prompt_lookup}" if prompt_lookup else "assisted" if assistant is not None else "plain"
    return {"engine": "hf", "method": method, "batch": batch, "new_tokens": new, "seconds": seconds,
            "tokens_per_s": new / seconds, "tokens_per_step": None, "acceptance_rate": None}, rows


def run_bench(args) -> int:
    compile_cache.disable()  # the compile seconds it reports are first compiles, never disk reads
    if args.deterministic:  # every path below resolves args.attention
        if args.trees:  # refused before anything is loaded or timed
            raise InputError(f"--trees: deterministic mode verifies chains only; time trees without --deterministic "
                             f"(got {args.trees!r})")
        args.attention = RunOptions(args.attention, True).attention_impl
    if args.shape:
        args.batch_sizes = args.batch_sizes or [1, 8, 32, 64]
        return run_scale_bench(args)
    if args.parts and args.parts != "continuous":
        raise InputError(f"--parts: without --shape only 'continuous' (the scheduler comparison); got {args.parts!r}")
    args.batch_sizes = args.batch_sizes or ([16] if args.parts else [1, 8])

    target_path = Path(args.target or embedded_model(DEFAULT_TARGET))
    draft_path = Path(args.draft or embedded_model(DEFAULT_DRAFT))
    target = load(target_path, dtype=args.dtype, tensor_parallel=args.tensor_parallel,
                  expert_parallel=args.expert_parallel)
    draft = load(draft_path, dtype=args.dtype, tensor_parallel=args.draft_tensor_parallel)
    # The embedded head serves the embedded target only.
    head_path = (embedded_model(DEFAULT_EAGLE) if args.target is None else "") if args.eagle is None else args.eagle
    head = load(head_path, dtype=args.dtype) if head_path and not args.parts else None
    ids = [target.tokenizer.encode(p) for p in load_prompts(limit=args.prompts)]
    info = machine()
    print(f"machine: {info}")
    tokens = "lognormal budgets" if args.parts else f"{args.max_new_tokens} new tokens"
    how = f"temperature {args.temperature}" if args.temperature else "greedy"
    print(f"{len(ids)} HumanEval prompts, {tokens}, {how}, target {target.name} ({target.dtype}), draft {draft.name}"
          + (f", EAGLE-3 head {head.name}" if head else ""), flush=True)
    if args.parts:
        run_embedded(args, target, draft, ids)
        return 0
    hf = not args.no_hf and not args.temperature  # HF rows: greedy only
    if hf:
        hf_target = load_hf(target_path, args.hf_device, args.hf_dtype, args.threads)
        hf_draft = load_hf(draft_path, args.hf_device, args.hf_dtype, args.threads)
    rows = []
    hf_repeats = args.hf_repeats or args.repeats
    for batch in args.batch_sizes:
        run = lambda d, k, tree=None: bench_jaxspec(  # noqa: E731
            ids, target, d, k, batch, args.max_new_tokens, args.repeats, tree, args.attention, args.temperature)
        plain_row, plain_ids = run(None, 0)
        plain_row["same_as_plain"] = len(ids)
        rows.append(plain_row)
        print(_fmt(plain_row), flush=True)
        trees = [t for t in args.trees.split(",") if t]
        variants = [(draft, k, None) for k in args.k] + [(draft, 1, t) for t in trees]
        if head is not None:
            variants += [(head, k, None) for k in args.eagle_k] + [(head, 1, t) for t in trees]
        variants += [(Ngram(branches=b), k, None) for k in args.ngram_k for b in args.ngram_branches]
        for d, k, tree in variants:
            row, out = run(d, k, tree)
            row["same_as_plain"] = sum(a == b for a, b in zip(out, plain_ids)) if not args.temperature else None
            row["speedup_vs_plain"] = row["tokens_per_s"] / plain_row["tokens_per_s"]
            rows.append(row)
            print(_fmt(row), flush=True)
        if hf:
            eos = set(target.config.eos_token_ids)
            row, out = bench_hf(ids, hf_target, None, batch, args.max_new_tokens, hf_repeats, eos)
            row["same_as_plain"] = sum(a == b for a, b in zip(out, plain_ids))
            rows.append(row)
            print(_fmt(row), flush=True)
            if batch == 1:  # HF assisted generation and prompt lookup serve one sequence at a time
                peers = [(hf_draft, 0)] if args.k else []
                for assistant, lookup in peers + [(None, k) for k in args.ngram_k]:
                    row, out = bench_hf(ids, hf_target, assistant, batch, args.max_new_tokens, hf_repeats, eos, lookup)
                    row["same_as_plain"] = sum(a == b for a, b in zip(out, plain_ids))
                    rows.append(row)
                    print(_fmt(row), flush=True)
    _summary(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "rows": rows}, indent=2, default=str))
    return 0


def _fmt(r: dict) -> str:
    tps = f"{r['tokens_per_step']:.2f}" if r.get("tokens_per_step") else "-"
    acc = f"{r['acceptance_rate']:.3f}" if r.get("acceptance_rate") is not None else "-"
    return (f"{r['engine']:8s} {r['method']:18s} batch {r['batch']:3d}  {r['new_tokens']:6d} tokens "
            f"{r['seconds']:8.3f} s {r['tokens_per_s']:9.1f} tok/s  tok/step {tps:>5s}  acc {acc:>5s}  "
            f"same-as-plain {r['same_as_plain']}")


def _summary(rows: list[dict]) -> None:
    print("\n| engine | method | batch | tokens/s | tokens/step | acceptance | vs jaxspec plain | greedy == plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    plain = {r["batch"]: r["tokens_per_s"] for r in rows if r["engine"] == "jaxspec" and r["method"] == "plain"}
    for r in rows:
        tps = f"{r['tokens_per_step']:.2f}" if r.get("tokens_per_step") else "-"
        acc = f"{r['acceptance_rate']:.3f}" if r.get("acceptance_rate") is not None else "-"
        print(f"| {r['engine']} | {r['method']} | {r['batch']} | {r['tokens_per_s']:.1f} | {tps} | {acc} | "
              f"{r['tokens_per_s'] / plain[r['batch']]:.2f}x | {r['same_as_plain']} |")
