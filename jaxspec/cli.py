"""The `jaxspec` command line: convert, generate."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxspec.defaults import CHECKPOINTS, DEFAULT_TARGET, embedded_model
from jaxspec.errors import JaxspecError


def add_convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", help="Hugging Face model folder: config.json, *.safetensors, tokenizer files")
    p.add_argument("out_dir", nargs="?", help="output folder (default: checkpoints/NAME, NAME = HF_DIR's name)")
    p.add_argument("--out", dest="out_flag", help="output folder; same as the positional OUT_DIR")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None,
        help="store the weights in this dtype (default: keep the checkpoint's own dtype)",
    )


def run_convert(args) -> int:
    from jaxspec.checkpoint import convert_hf_checkpoint

    if args.out_dir and args.out_flag and args.out_dir != args.out_flag:
        raise JaxspecError("give the output folder once: OUT_DIR or --out, not both")
    out = args.out_dir or args.out_flag or CHECKPOINTS / Path(args.hf_dir).resolve().name
    path = convert_hf_checkpoint(args.hf_dir, out, dtype=args.dtype)
    print(f"converted {args.hf_dir} -> {path}")
    return 0


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (>= 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=0, help="random seed; each prompt gets its own stream")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype (default: float32 on CPU, bfloat16 on GPU)")


def run_generate(args) -> int:
    import jaxspec

    prompts = list(args.prompt)
    if args.file:
        prompts += [json.loads(line)["prompt"] for line in Path(args.file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise JaxspecError("give at least one prompt: PROMPT arguments or --file")
    target = jaxspec.load(args.target or embedded_model(DEFAULT_TARGET), dtype=args.dtype)
    outs = jaxspec.generate(
        prompts, target, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
    )
    for prompt, out in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "stats": out.stats.as_dict()}))
        else:
            print(f"=== prompt\n{prompt}\n=== completion ({out.finish_reason}, {out.stats.new_tokens} tokens)")
            print(out.text)
    m = outs.metrics
    print(
        f"--- {m.requests} prompt(s), {m.new_tokens} new tokens, {m.tokens_per_s:.1f} tokens/s "
        f"(decode {m.decode_s:.2f} s, compile {m.compile_s:.2f} s, {m.graphs_compiled} graph(s))",
        file=sys.stderr,
    )
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
    add_sampling_args(p)
    p.set_defaults(func=run_generate)

    from jaxspec.bench import add_bench_args, run_bench

    p = sub.add_parser("bench", help="tokens/s of plain and speculative decoding vs HF transformers")
    add_bench_args(p)
    p.set_defaults(func=run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
