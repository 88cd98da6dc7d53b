"""The `jaxspec` command line: convert, generate, batch, bench."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from jaxspec import compile_cache
from jaxspec.bench.main import add_bench_args, run_bench
from jaxspec.checks import int_list, int_list_or_none
from jaxspec.decoding.method import NAMED_KINDS, DecodeMethod, settings_from_cli
from jaxspec.decoding.method import add_cli_args as add_method_args
from jaxspec.defaults import CHECKPOINTS, DEFAULT_DRAFT, DEFAULT_TARGET, embedded_model
from jaxspec.distributed import add_parallel_args, initialize, is_main_process
from jaxspec.errors import JaxspecError
from jaxspec.jobs.job import run_job
from jaxspec.jobs.records import check_unique, read_input
from jaxspec.jobs.report import format_summary, write_json
from jaxspec.jobs.settings import AUTO_KS, AUTO_NGRAM_KS, JobSettings
from jaxspec.model.checkpoint import convert_hf_checkpoint
from jaxspec.model.loading import load
from jaxspec.model.quantize import SCHEMES
from jaxspec.sampling_params import add_cli_args as add_sampling_args
from jaxspec.sampling_params import from_cli as sampling_from_cli
from jaxspec.serving.options import RunOptions
from jaxspec.serving.generate import generate


def add_convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", help="Hugging Face model folder: config.json, *.safetensors, tokenizer files")
    p.add_argument("out_dir", nargs="?", help="output folder (default: checkpoints/NAME, NAME = HF_DIR's name)")
    p.add_argument("--out", dest="out_flag", help="output folder; same as the positional OUT_DIR")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None,
        help="store the weights in this dtype (default: keep the checkpoint's own dtype)",
    )
    p.add_argument("--quantize", choices=SCHEMES, default=None,
                   help="store the projections in 8 bits with a float32 scale per output channel (default: none)")


def run_convert(args) -> int:
    if args.out_dir and args.out_flag and args.out_dir != args.out_flag:
        raise JaxspecError("give the output folder once: OUT_DIR or --out, not both")
    out = args.out_dir or args.out_flag or CHECKPOINTS / Path(args.hf_dir).resolve().name
    path = convert_hf_checkpoint(args.hf_dir, out, dtype=args.dtype, quantize=args.quantize)
    print(f"converted {args.hf_dir} -> {path}")
    return 0


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype (default: float32 on CPU, bfloat16 on GPU)")
    p.add_argument("--quantize", choices=SCHEMES, default=None,
                   help="the target's projections in 8 bits, a float32 scale per output channel (default: none)")
    p.add_argument("--draft-quantize", choices=SCHEMES, default=None,
                   help="the draft model's projections in 8 bits (default: none)")
    p.add_argument("--compile-cache", metavar="DIR|off",
                   help=f"keep compiled graphs in DIR across runs, or 'off' (default: ${compile_cache.ENV}, else "
                        f"{compile_cache.default_dir()})")


def add_request_args(p: argparse.ArgumentParser, tree: bool = True) -> None:
    """What generate and batch share: each setting value's own flags (the decode method's, the
    sampling parameters', the run options') and the models'."""
    add_method_args(p, tree=tree)
    g = p.add_argument_group("sampling (jaxspec.SamplingParams; a batch record's own settings override these)")
    add_sampling_args(g)
    RunOptions.add_cli_args(p, attention=tree)
    add_model_args(p)


def load_draft(args, path):
    """--draft: "ngram" / "suffix" (lookup settings, checked), or a draft model folder."""
    if path in NAMED_KINDS:
        return settings_from_cli(args, path)
    return load(path, dtype=args.dtype, tensor_parallel=args.draft_tensor_parallel, quantize=args.draft_quantize)


def _print_completions(prompts, outs, as_json: bool) -> None:
    for prompt, out in zip(prompts, outs):
        if as_json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                              "stats": out.stats.as_dict()}))
            continue
        s = out.stats
        acc = "" if s.acceptance_rate is None else (
            f", acceptance {s.acceptance_rate:.2f}, {s.tokens_per_step:.2f} tokens/target step"
        )
        print(f"=== prompt\n{prompt}\n=== completion ({out.finish_reason}, {s.new_tokens} tokens{acc})")
        print(out.text)


def _compare_plain(prompts, target, draft, outs, call: dict) -> None:
    """Times the same call plainly and speculatively (compiled graphs, a second call each) and
    prints the speedup and whether the output is the plain output. call: generate's keywords."""
    plain_call = {k: v for k, v in call.items() if k != "method"}
    plain = [generate(prompts, target, None, **plain_call) for _ in range(2)][-1]
    spec = generate(prompts, target, draft, **call)
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs, plain))
    speedup = plain.metrics.decode_s / spec.metrics.decode_s if spec.metrics.decode_s > 0 else 0.0
    print(f"--- speculative {spec.metrics.tokens_per_s:.1f} tokens/s vs plain {plain.metrics.tokens_per_s:.1f} "
          f"tokens/s: {speedup:.2f}x the speed of plain decoding, measured here; output identical to plain "
          f"decoding for {same} of {len(outs)} completion(s)")


def run_generate(args) -> int:
    prompts = list(args.prompt)
    if args.file:
        prompts += [json.loads(line)["prompt"] for line in Path(args.file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise JaxspecError("give at least one prompt: PROMPT arguments or --file")
    if args.compare_plain and not args.draft:
        raise JaxspecError("--compare-plain needs --draft: it compares speculative decoding with plain decoding")
    sampling, options = sampling_from_cli(args), RunOptions.from_cli(args)  # checked before any model loads
    target = load(args.target or embedded_model(DEFAULT_TARGET), dtype=args.dtype, tensor_parallel=args.tensor_parallel,
                  quantize=args.quantize, expert_parallel=args.expert_parallel)
    draft = load_draft(args, args.draft) if args.draft else None
    method = DecodeMethod.of(draft, args.num_draft_tokens, args.tree)
    outs = generate(prompts, target, draft, sampling=sampling, method=method, options=options)
    _print_completions([p for p in prompts for _ in range(sampling.n)], outs, args.json)  # n samples a prompt
    m = outs.metrics
    print(
        f"--- {m.requests} prompt(s), {m.new_tokens} new tokens, {m.tokens_per_s:.1f} tokens/s "
        f"(decode {m.decode_s:.2f} s, compile {m.compile_s:.2f} s, {m.graphs_compiled} graph(s) compiled, "
        f"{m.graph_cache_hits} reused)",
        file=sys.stderr,
    )
    if args.compare_plain:
        _compare_plain(prompts, target, draft, outs, dict(sampling=sampling, options=options, method=method))
    return 0


BATCH_DESCRIPTION = """\
Runs every record of IN.jsonl and appends one JSON line per record to OUT.jsonl.

Input, one JSON object per line: "id" (string or integer, unique), "prompt" (text) or
"messages" (a chat, rendered with the tokenizer's chat template), and optionally any sampling
setting ("max_tokens" or "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed":
they override the options below) and "prompt_version" (reported separately). Output lines carry "id", "line", "text", "token_ids",
"finish_reason", "method", "stats" (acceptance statistics), or "error" for a record that could
not be served; a line without a readable id gets the id "line:N".

OpenAI batch files (the OpenAI Batch API's and vllm run-batch's) run unchanged: a line
{"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions", "body"} is
answered in the OpenAI batch output format ({"id", "custom_id", "response": {"status_code",
"request_id", "body": a chat.completion or text_completion}, "error"}). The body's max_tokens /
max_completion_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, logprobs /
top_logprobs, presence_penalty, frequency_penalty, repetition_penalty, logit_bias, prompt_logprobs
and n (n choices) are used; one it leaves out takes the options below (an omitted max_tokens is
--max-new-tokens), not OpenAI's defaults. A bad request gets an error line and the job goes on.

Rerunning the same command after a crash resumes: ids (custom_ids) already in OUT.jsonl are
skipped. Writes OUT.summary.json, OUT.png and OUT.metrics.jsonl beside the output and prints the
summary.
"""


def _sample(text: str):
    """--auto-sample: a fraction with a decimal point (0.1) or a record count (16)."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction like 0.1 or a count like 16, got {text!r}") from None


def add_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="IN.jsonl", help="input records, one JSON object per line")
    p.add_argument("output", metavar="OUT.jsonl", help="output records (appended to; a rerun resumes)")
    p.add_argument("--target", help="target model folder (default: the embedded code-target-16m)")
    p.add_argument("--draft", action="append",
                   help='draft model or EAGLE-3 head folder, "ngram" for n-gram lookup, or "suffix" for lookup in the '
                        "record and the job's earlier prompts and outputs (default: the embedded code-draft-4m); with "
                        "--auto, repeat it (a draft model, a head, suffix) for the canary to choose")
    p.add_argument("--no-draft", action="store_true", help="plain decoding: no draft model")
    p.add_argument("--batch-size", type=int, default=8,
                   help="records decoded at once: continuous slots or static batch rows (default 8)")
    p.add_argument("--scheduler", choices=["continuous", "static"], default="continuous",
                   help="continuous (default): refill a slot as soon as its record finishes; static: padded "
                        "batches run until their longest record ends")
    p.add_argument("--refill-at", type=int, help="continuous: slots freed before new records are let in "
                                                "(default: 1 on the CPU, an eighth of the slots on GPUs)")
    add_request_args(p, tree=False)
    p.add_argument("--auto", action="store_true",
                   help="canary: time plain and speculative decoding (each --auto-k, each --draft) on a sample of the job, "
                        "check greedy outputs agree, and run the rest with the fastest")
    p.add_argument("--auto-sample", type=_sample, default=0.05,
                   help="canary sample: a fraction (default 0.05, at least 8 records and 2 batches) or a "
                        "count (16) of the records, rounded up to whole batches")
    p.add_argument("--auto-k", type=int_list, default=list(AUTO_KS),
                   help=f"draft lengths K the canary tries (default {','.join(map(str, AUTO_KS))})")
    p.add_argument("--auto-trees", default="",
                   help="named draft trees the canary tries too, comma-separated (e.g. binary-3,sparse; default none)")
    p.add_argument("--auto-ngram-k", type=int_list_or_none, default=list(AUTO_NGRAM_KS),
                   help="n-gram lookup lengths the canary tries too, comma-separated (default 4,8; '' for none)")
    p.add_argument("--auto-repeats", type=int, default=2, help="timed passes per canary candidate, best kept (default 2)")
    p.add_argument("--auto-min-speedup", type=float, default=1.05,
                   help="speculation is chosen only when at least this much faster than plain (default 1.05)")
    p.add_argument("--metrics-log", help="JSON-lines metrics log, appended to (default: OUT.metrics.jsonl)")
    p.add_argument("--no-metrics-log", action="store_true", help="write no metrics log")
    p.add_argument("--summary", help="summary JSON path (default: OUT.summary.json)")
    p.add_argument("--plot", help="summary plot PNG path (default: OUT.png)")
    p.add_argument("--no-plot", action="store_true", help="draw no plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("several replicas (Ray; pip install 'jaxspec[distributed]')")
    g.add_argument("--workers", type=int, default=1, help="model replicas as Ray actors (default 1: in this process)")
    g.add_argument("--gpus-per-worker", type=float,
                   help="GPUs per replica (default: --tensor-parallel on GPUs, none on the CPU)")
    g.add_argument("--ray-address", help="join this Ray cluster (auto or HOST:PORT); default: a local instance")
    add_parallel_args(p)


@contextlib.contextmanager
def _jaxspec_logging():
    """Shows the jaxspec logger's INFO lines (the canary's decision) and warnings on stderr once,
    above the progress bar rather than through it; restores the logger afterwards."""
    import logging

    from tqdm.contrib.logging import logging_redirect_tqdm

    logger = logging.getLogger("jaxspec")
    saved = logger.level, logger.propagate
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("jaxspec %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False  # libraries may give the root logger a handler: print once
    logger.setLevel(logging.INFO)
    try:
        with logging_redirect_tqdm(loggers=[logger]):
            yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def job_settings(args) -> JobSettings:
    """The batch job's settings from its flags (checked before any model is loaded)."""
    return JobSettings(
        num_draft_tokens=args.num_draft_tokens, sampling=sampling_from_cli(args), options=RunOptions.from_cli(args),
        batch_size=args.batch_size, scheduler=args.scheduler, refill_at=args.refill_at, auto=args.auto,
        auto_sample=args.auto_sample, auto_ks=tuple(args.auto_k),
        auto_trees=tuple(t for t in args.auto_trees.split(",") if t), auto_ngram_ks=tuple(args.auto_ngram_k),
        auto_repeats=args.auto_repeats, auto_min_speedup=args.auto_min_speedup, workers=args.workers,
        gpus_per_worker=args.gpus_per_worker, ray_address=args.ray_address,
        metrics_log=None if args.no_metrics_log else (args.metrics_log or True), summary_path=args.summary,
        plot_path=None if args.no_plot else (args.plot or True), progress=not args.no_progress,
    )


def run_batch(args) -> int:
    if args.no_draft and (args.draft or args.auto):
        raise JaxspecError("--no-draft cannot be combined with --draft or --auto")
    if not Path(args.input).is_file():
        raise JaxspecError(f"input file {args.input} does not exist")
    settings = job_settings(args)
    check_unique(read_input(Path(args.input)), Path(args.input))  # fail before loading models
    t0 = time.perf_counter()
    target = load(args.target or embedded_model(DEFAULT_TARGET), dtype=args.dtype, tensor_parallel=args.tensor_parallel,
                  quantize=args.quantize, expert_parallel=args.expert_parallel)
    paths = args.draft or [embedded_model(DEFAULT_DRAFT)]
    draft = None if args.no_draft else [load_draft(args, path) for path in paths]  # run_job takes a list
    load_s = time.perf_counter() - t0
    with _jaxspec_logging():
        summary = run_job(args.input, args.output, target, draft, settings)
    summary["this_run"]["load_s"] = load_s  # the models' loading, before the job's own clock started
    write_json(Path(summary["summary_path"]), summary)
    print(format_summary(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="convert a Hugging Face checkpoint to the engine's Orbax format")
    add_convert_args(p)
    p.set_defaults(func=run_convert)

    p = sub.add_parser("generate", help="complete prompts and print completions with their statistics")
    p.add_argument("prompt", nargs="*", help="prompt text(s)")
    p.add_argument("--file", help="JSONL file with a \"prompt\" field per line, appended to PROMPTs")
    p.add_argument("--target", help="target model folder (default: the embedded code-target-16m)")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion")
    p.add_argument("--draft", help='draft model or EAGLE-3 head folder, "ngram" for n-gram lookup in the prompt '
                                   'and output, or "suffix" for lookup in all the prompts and finished outputs too: '
                                   "decode speculatively (default: plain decoding)")
    p.add_argument("--compare-plain", action="store_true",
                   help="also decode plainly and print the measured speedup and whether the output is identical")
    add_request_args(p)
    add_parallel_args(p)
    p.set_defaults(func=run_generate)

    p = sub.add_parser(
        "batch", help="run a JSONL file of prompts as an offline batch job (resumable)",
        description=BATCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_batch_args(p)
    p.set_defaults(func=run_batch)

    p = sub.add_parser("bench", help="tokens/s of plain and speculative decoding vs HF transformers")
    add_bench_args(p)
    p.set_defaults(func=run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "coordinator", None) and args.func is run_batch:
            raise JaxspecError("a batch job runs in one process: split the model over this host's devices with "
                               "--tensor-parallel (jaxspec generate and jaxspec bench run across hosts)")
        if hasattr(args, "coordinator"):
            initialize(args)  # joins the other processes first, as jax.distributed requires
        if getattr(args, "compile_cache", None) is not None:
            compile_cache.enable(args.compile_cache)
        if getattr(args, "coordinator", None) and not is_main_process():
            # every process computes the same results; process 0 prints them
            sys.stdout = open(os.devnull, "w")
        return args.func(args)
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
