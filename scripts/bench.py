#!/usr/bin/env python3
"""Plain (non-speculative) greedy decoding throughput of a target model on HumanEval prompts:
jaxspec against Hugging Face transformers (PyTorch, CPU, float32, eager attention), on the same
prompts, the same token ids and the same weights, on this machine.

    python scripts/bench.py                                   # 20 prompts, 128 new tokens, batch 1 and 8
    python scripts/bench.py --prompts 3 --max-new-tokens 32 --batch-sizes 1,2   # quick check

Both engines compute in float32. Prompts are tokenized once with the model's tokenizer (as
jaxspec.generate does for text) and both engines get those token ids. At batch size B the first N
prompts are cut into consecutive groups of B (the last may be smaller); each group is one
jaxspec.generate call (max_batch_size=B) or one left-padded HF model.generate call.

Timing. jaxspec: every compiled shape is warmed up first (one untimed call per distinct
(batch bucket, prompt-length bucket)); the timed pass then sums CallMetrics.decode_s (prefill +
decode loop + device_get; compilation excluded). HF: one untimed warm-up generate per batch size,
then the summed wall time of the model.generate calls (tokenization excluded). With --repeats R
the timed pass runs R times and the fastest is reported. tokens/s = generated tokens / those
seconds, where generated tokens count each row's tokens up to and including its EOS (never
padding after EOS), so rows that stop early only count what they produced. Rows of a batch that
finish early still cost compute until the whole batch is done, in both engines.

Other processes on the machine skew both engines, torch most (its default of one thread per core
stalls when a core is taken away: a 10x+ slowdown on a busy 2-core machine). The script warns
when the load average is high at start and reports, per engine and batch size, the share of CPU
time other processes used while it ran (warning above 15%).

Greedy agreement: for each batch size the script counts the prompts whose jaxspec token ids equal
HF's exactly (batch 1 is the reference check; batched HF uses left padding, which can move
float32 rounding and so flip near-ties), and whether jaxspec's batched outputs equal its batch-1
outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a source checkout without installing
    sys.path.insert(0, str(REPO))

DEFAULT_TARGET = "checkpoints/hf/code-target-16m"


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes must be comma-separated integers; got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be integers >= 1; got {text!r}")
    return list(dict.fromkeys(sizes))  # dedupe, keep order


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1; got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--target", default=DEFAULT_TARGET,
        help="model folder (HF: config.json + safetensors + tokenizer) run by both engines; "
        "relative paths are tried from the current directory, then from the repository root "
        f"(default: {DEFAULT_TARGET})",
    )
    p.add_argument(
        "--prompts", type=positive_int, default=20, metavar="N",
        help="benchmark the first N HumanEval prompts (default: 20; the file has 164)",
    )
    p.add_argument(
        "--data", default=None, metavar="PATH",
        help="HumanEval JSONL(.gz) file (default: data/HumanEval.jsonl.gz in the repository)",
    )
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=128, metavar="N",
        help="new-token budget per prompt; rows stop earlier at EOS (default: 128)",
    )
    p.add_argument(
        "--batch-sizes", type=parse_batch_sizes, default=parse_batch_sizes("1,8"), metavar="B1,B2,...",
        help="comma-separated batch sizes to measure; 1 runs prompts one at a time (default: 1,8)",
    )
    p.add_argument(
        "--no-hf", action="store_true",
        help="skip the HF transformers run: jaxspec numbers only, no speedup or agreement",
    )
    p.add_argument(
        "--threads", type=positive_int, default=None, metavar="N",
        help="torch intra-op threads for HF (default: torch's own default; the value used is "
        "printed). Does not affect jaxspec: XLA's CPU thread pool uses its own default",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=1, metavar="R",
        help="timed passes over all prompts per engine and batch size, after the warm-up; the "
        "fastest pass is reported and every pass's seconds go to --json (default: 1)",
    )
    p.add_argument(
        "--json", default=None, metavar="OUT",
        help="also write machine info, settings, per-engine results, speedups and agreement to "
        "this JSON file",
    )
    return p


def resolve_target(target: str) -> Path:
    path = Path(target)
    if not path.is_dir() and not path.is_absolute() and (REPO / path).is_dir():
        path = REPO / path
    return path


def groups_of(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def cpu_name() -> str:
    name = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name or platform.machine()


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict:
    import jax

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or None,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "load_average_start": load_average(),
    }
    return info


def log(msg: str) -> None:
    print(msg, flush=True)


class OthersCPU:
    """CPU time that other processes used while a block ran, as a share of all CPUs' time:
    /proc/stat busy time minus this process's own CPU time (None where /proc/stat is missing)."""

    def __enter__(self):
        self.start = (self._busy(), os.times(), time.perf_counter())
        return self

    def __exit__(self, *exc):
        busy0, times0, t0 = self.start
        busy1, times1, t1 = self._busy(), os.times(), time.perf_counter()
        self.share = None
        if busy0 is not None and busy1 is not None and t1 > t0:
            own = (times1.user - times0.user) + (times1.system - times0.system)
            cpus = os.cpu_count() or 1
            self.share = max(0.0, (busy1 - busy0) - own) / ((t1 - t0) * cpus)
        return False

    @staticmethod
    def _busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal ...: everything but idle and iowait.
        busy = sum(fields[:8]) - fields[3] - fields[4]
        return busy / os.sysconf("SC_CLK_TCK")


def warn_if_busy(when: str) -> None:
    """Other processes on the CPUs skew both engines; torch's thread pool (one thread per core by
    default) is hit hardest, as its threads wait on each other when a core is taken away."""
    load = load_average()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if load and load[0] > 0.5 * cpus:
        log(f"warning: machine busy {when} (1-min load average {load[0]} on {cpus} CPUs): timings "
            "are unreliable; torch with one thread per core suffers most (try a quiet machine)")


# --------------------------------------------------------------------------------------------
# jaxspec


def bench_jaxspec(model, ids: list[list[int]], batch: int, max_new_tokens: int, repeats: int) -> dict:
    import jaxspec
    from jaxspec.runner import bucket

    groups = groups_of(ids, batch)

    def call(group):
        return jaxspec.generate(group, model, max_new_tokens=max_new_tokens, temperature=0.0, max_batch_size=batch)

    # Warm-up: one call per distinct compiled shape (the runner pads batch size and prompt length
    # to power-of-two buckets), so the timed pass runs only cached executables.
    warm_start = time.perf_counter()
    warm_compile = 0.0
    warm_calls = 0
    seen = set()
    for group in groups:
        key = (bucket(len(group), 1), bucket(max(len(x) for x in group)))
        if key in seen:
            continue
        seen.add(key)
        warm_compile += call(group).metrics.compile_s
        warm_calls += 1
    warm_s = time.perf_counter() - warm_start

    def timed_pass():
        tokens: list[list[int]] = []
        finish: list[str] = []
        new_tokens = graphs = 0
        decode_s = wall_s = compile_s = 0.0
        for group in groups:
            t0 = time.perf_counter()
            out = call(group)
            wall_s += time.perf_counter() - t0
            m = out.metrics
            new_tokens += m.new_tokens
            decode_s += m.decode_s
            compile_s += m.compile_s
            graphs += m.graphs_compiled
            tokens += [list(c.token_ids) for c in out]
            finish += [c.finish_reason for c in out]
            counted = sum(len(c.token_ids) for c in out)
            if counted != m.new_tokens:
                log(f"  warning: jaxspec metrics.new_tokens={m.new_tokens} but completions hold {counted} tokens")
        if graphs:
            log(f"  warning: jaxspec compiled {graphs} graph(s) ({compile_s:.2f} s) during a timed pass; "
                "compile time is excluded from decode seconds but first-run costs may remain")
        return tokens, finish, new_tokens, decode_s, wall_s, compile_s

    passes = [timed_pass() for _ in range(repeats)]
    tokens, finish, new_tokens = passes[0][:3]
    if any(p[0] != tokens for p in passes[1:]):
        log(f"  warning: jaxspec batch {batch} gave different tokens on repeated passes")
    best = min(passes, key=lambda p: p[3])
    decode_s, wall_s, compile_s = best[3], best[4], sum(p[5] for p in passes)
    return {
        "engine": "jaxspec",
        "batch": batch,
        "prompts": len(ids),
        "calls": len(groups),
        "new_tokens": new_tokens,
        "seconds": decode_s,  # best pass
        "tokens_per_s": new_tokens / decode_s if decode_s > 0 else 0.0,
        "pass_seconds": [p[3] for p in passes],
        "wall_s": wall_s,  # that pass's whole generate() calls: host batching, detokenizing included
        "wall_tokens_per_s": new_tokens / wall_s if wall_s > 0 else 0.0,
        "timed_compile_s": compile_s,
        "warmup_calls": warm_calls,
        "warmup_s": warm_s,
        "warmup_compile_s": warm_compile,
        "eos_rows": finish.count("eos"),
        "_tokens": tokens,
    }


# --------------------------------------------------------------------------------------------
# HF transformers


def load_hf(path: Path, threads: int | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if threads is not None:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    gc = model.generation_config
    eos = gc.eos_token_id if gc.eos_token_id is not None else model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else set()
    pad = gc.pad_token_id if gc.pad_token_id is not None else (min(eos_ids) if eos_ids else 0)
    if tok.pad_token_id is None:
        tok.pad_token_id = pad
    return model, tok, eos_ids, pad


def hf_cut(row: list[int], eos_ids: set[int]) -> list[int]:
    """Generated ids up to and including the first EOS (HF pads finished rows after it)."""
    for i, t in enumerate(row):
        if t in eos_ids:
            return row[: i + 1]
    return row


def bench_hf(hf, ids: list[list[int]], batch: int, max_new_tokens: int, repeats: int) -> dict:
    import torch

    model, tok, eos_ids, pad = hf
    groups = groups_of(ids, batch)

    def encode(group):
        enc = tok.pad({"input_ids": group}, padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]

    def call(group, n):
        input_ids, mask = encode(group)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(
                input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                pad_token_id=pad,
            )
            dt = time.perf_counter() - t0
        gen = out[:, input_ids.shape[1] :].tolist()
        return [hf_cut(r, eos_ids) for r in gen], dt

    warm_start = time.perf_counter()
    call(groups[0], min(max_new_tokens, 16))
    warm_s = time.perf_counter() - warm_start

    def timed_pass():
        tokens: list[list[int]] = []
        seconds = 0.0
        for group in groups:
            rows, dt = call(group, max_new_tokens)
            seconds += dt
            tokens += rows
        return tokens, seconds

    passes = [timed_pass() for _ in range(repeats)]
    tokens = passes[0][0]
    if any(p[0] != tokens for p in passes[1:]):
        log(f"  warning: HF batch {batch} gave different tokens on repeated passes")
    seconds = min(p[1] for p in passes)
    new_tokens = sum(len(r) for r in tokens)
    return {
        "engine": "hf",
        "batch": batch,
        "prompts": len(ids),
        "calls": len(groups),
        "new_tokens": new_tokens,
        "seconds": seconds,  # best pass
        "tokens_per_s": new_tokens / seconds if seconds > 0 else 0.0,
        "pass_seconds": [p[1] for p in passes],
        "warmup_s": warm_s,
        "eos_rows": sum(1 for r in tokens if r and r[-1] in eos_ids),
        "_tokens": tokens,
    }


# --------------------------------------------------------------------------------------------
# Comparison and report


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = [i for i, (x, y) in enumerate(zip(a, b)) if x == y]
    diffs = {i: first_difference(x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y}
    return {"identical": len(same), "prompts": len(a), "first_difference": diffs}


def print_table(rows: list[dict], speedups: dict, matches: dict) -> None:
    head = ["engine", "batch", "prompts", "new tokens", "seconds", "tokens/s", "speedup", "= HF"]
    body = []
    for r in rows:
        sp = speedups.get(r["batch"]) if r["engine"] == "jaxspec" else None
        m = matches.get(r["batch"]) if r["engine"] == "jaxspec" else None
        body.append([
            r["engine"], str(r["batch"]), str(r["prompts"]), str(r["new_tokens"]),
            f"{r['seconds']:.3f}", f"{r['tokens_per_s']:.1f}",
            f"{sp:.2f}x" if sp is not None else "",
            f"{m['identical']}/{m['prompts']}" if m is not None else "",
        ])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    log(fmt(head))
    log("  ".join("-" * w for w in widths))
    for b in body:
        log(fmt(b))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxspec.humaneval import load_prompts

    target = resolve_target(args.target)
    if not target.is_dir():
        log(f"error: model folder {args.target} does not exist")
        return 2
    prompts = load_prompts(args.data, args.prompts)
    if len(prompts) < args.prompts:
        log(f"note: only {len(prompts)} prompts in the file; using all of them")

    import jaxspec

    warn_if_busy("at start")
    info = machine_info()
    log(f"machine: {info['cpu']} | cpu_count={info['cpu_count']} usable={info['cpus_usable']} | "
        f"{info['platform']} | load avg {info['load_average_start']}")
    log(f"jax {info['jax']} backend={info['jax_backend']} devices={info['jax_devices']}"
        + (f" XLA_FLAGS={info['xla_flags']}" if info["xla_flags"] else ""))

    model = jaxspec.load(target, dtype="float32")
    if model.tokenizer is None:
        log(f"error: {target} has no tokenizer; the benchmark needs one to encode HumanEval prompts")
        return 2
    ids = [list(model.tokenizer.encode(p, add_special_tokens=True)) for p in prompts]
    lens = [len(x) for x in ids]
    log(f"target {target} ({model.config.num_layers} layers, hidden {model.config.hidden_size}, "
        f"vocab {model.config.vocab_size}), float32 | {len(ids)} HumanEval prompts, "
        f"{min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}) | "
        f"max_new_tokens={args.max_new_tokens} | batch sizes {args.batch_sizes}")

    hf = None
    if not args.no_hf:
        import torch
        import transformers

        hf = load_hf(target, args.threads)
        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["torch_threads_source"] = "--threads" if args.threads is not None else "torch default"
        info["torch_interop_threads"] = torch.get_num_interop_threads()
        log(f"torch {info['torch']} transformers {info['transformers']} | torch threads "
            f"{info['torch_threads']} ({info['torch_threads_source']}), interop "
            f"{info['torch_interop_threads']} | HF eos ids {sorted(hf[2])}, pad id {hf[3]}")

    rows: list[dict] = []
    by_key: dict = {}
    for b in args.batch_sizes:
        log(f"jaxspec batch {b}: warming up and timing ...")
        with OthersCPU() as others:
            r = bench_jaxspec(model, ids, b, args.max_new_tokens, args.repeats)
        r["others_cpu_share"] = others.share
        log(f"  {r['new_tokens']} tokens in {r['seconds']:.3f} s = {r['tokens_per_s']:.1f} tokens/s "
            f"(wall {r['wall_s']:.3f} s; warm-up {r['warmup_calls']} call(s), {r['warmup_s']:.1f} s, "
            f"compile {r['warmup_compile_s']:.1f} s; {r['eos_rows']} rows ended at EOS)")
        rows.append(r)
        by_key[("jaxspec", b)] = r
        if hf is not None:
            log(f"HF batch {b}: warming up and timing ...")
            with OthersCPU() as others:
                r = bench_hf(hf, ids, b, args.max_new_tokens, args.repeats)
            r["others_cpu_share"] = others.share
            log(f"  {r['new_tokens']} tokens in {r['seconds']:.3f} s = {r['tokens_per_s']:.1f} tokens/s "
                f"({r['eos_rows']} rows ended at EOS)")
            rows.append(r)
            by_key[("hf", b)] = r

    speedups: dict = {}
    matches: dict = {}
    self_consistency: dict = {}
    for b in args.batch_sizes:
        j = by_key[("jaxspec", b)]
        if ("hf", b) in by_key:
            h = by_key[("hf", b)]
            if h["tokens_per_s"] > 0:
                speedups[b] = j["tokens_per_s"] / h["tokens_per_s"]
            matches[b] = agreement(j["_tokens"], h["_tokens"])
        if b != 1 and ("jaxspec", 1) in by_key:
            self_consistency[b] = agreement(j["_tokens"], by_key[("jaxspec", 1)]["_tokens"])

    info["load_average_end"] = load_average()
    log("")
    log(f"== plain greedy decoding, {len(ids)} HumanEval prompts, max_new_tokens={args.max_new_tokens}, "
        f"target {target.name}, float32 ==")
    print_table(rows, speedups, matches)
    log("seconds: jaxspec = sum of CallMetrics.decode_s (compile excluded); HF = sum of model.generate "
        f"wall times{'; fastest of %d passes' % args.repeats if args.repeats > 1 else ''}. "
        "speedup = jaxspec tokens/s / HF tokens/s; '= HF': prompts with identical greedy token ids.")
    for b, m in matches.items():
        if m["first_difference"]:
            where = ", ".join(f"#{i}@{p}" for i, p in m["first_difference"].items())
            log(f"batch {b}: jaxspec != HF on prompt#@first-differing-token: {where}")
    for b, m in self_consistency.items():
        log(f"jaxspec batch {b} vs batch 1: {m['identical']}/{m['prompts']} prompts identical")
    if 1 in matches:
        m = matches[1]
        log(f"greedy check (batch 1): jaxspec == HF on {m['identical']}/{m['prompts']} prompts")
    log(f"machine: {info['cpu']}, {info['cpu_count']} CPUs | jax {info['jax']} ({info['jax_backend']})"
        + (f" | torch {info['torch']} ({info['torch_threads']} threads)" if "torch" in info else "")
        + f" | load avg start {info['load_average_start']} end {info['load_average_end']}")
    busy = [r for r in rows if (r.get("others_cpu_share") or 0) > 0.15]
    if busy:
        log("warning: other processes used CPU during: " + ", ".join(
            f"{r['engine']} batch {r['batch']} ({r['others_cpu_share']:.0%} of the CPUs)" for r in busy)
            + "; those timings are unreliable")

    if args.json:
        out = {
            "machine": info,
            "settings": {
                "target": str(target),
                "prompts": len(ids),
                "max_new_tokens": args.max_new_tokens,
                "batch_sizes": args.batch_sizes,
                "repeats": args.repeats,
                "dtype": "float32",
                "hf": not args.no_hf,
                "prompt_tokens": lens,
            },
            "results": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
            "speedup": {str(b): s for b, s in speedups.items()},
            "agreement_with_hf": {
                str(b): {**m, "first_difference": {str(i): p for i, p in m["first_difference"].items()}}
                for b, m in matches.items()
            },
            "jaxspec_vs_batch1": {
                str(b): {**m, "first_difference": {str(i): p for i, p in m["first_difference"].items()}}
                for b, m in self_consistency.items()
            },
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
