"""HF transformers (torch) at a named shape, random bf16 weights, on one GPU: the peer row of
`jaxspec bench --shape` and the device's copy bandwidth as torch measures it.

Runs as its own process (`python -m jaxspec.bench.hf_peer ...`) before the JAX measurements, so
the two frameworks never hold GPU memory at once; prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import time

from jaxspec.bench.shapes import SHAPES


def copy_bandwidth(torch, device: str, gib: float = 4.0, repeats: int = 10) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of `gib` GiB."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n * 2 / best


def build(torch, shape: str, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM


    cfg = dict(SHAPES[shape])
    config = AutoConfig.for_model(**cfg)
    config.eos_token_id = None
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def time_generate(torch, model, batch: int, prompt_len: int, new_tokens: int, assistant=None) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).to(model.device)
    kw = {"assistant_model": assistant} if assistant is not None else {}

    def call(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out.shape[1] - prompt_len

    call(4)  # warm-up
    seconds, made = call(new_tokens)
    return {"part": "hf", "engine": "hf", "method": "assisted" if assistant is not None else "plain", "batch": batch,
            "prompt_len": prompt_len, "new_tokens": made * batch, "seconds": seconds,
            "tokens_per_s": made * batch / seconds, "ms_per_token_step": 1000 * seconds / made}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape")
    p.add_argument("--copy-only", action="store_true", help="only measure the copy bandwidth")
    p.add_argument("--draft-shape")
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args(argv)

    import torch
    import transformers

    device = "cuda"
    result = {"torch": torch.__version__, "transformers": transformers.__version__,
              "copy_bandwidth": copy_bandwidth(torch, device), "rows": []}
    if args.copy_only:
        print(json.dumps(result))
        return 0
    model = build(torch, args.shape, device)
    for b in (int(x) for x in args.batch_sizes.split(",")):
        result["rows"].append(time_generate(torch, model, b, args.prompt_len, args.new_tokens))
        print(json.dumps(result["rows"][-1]), flush=True)
    if args.draft_shape:
        draft = build(torch, args.draft_shape, device)
        result["rows"].append(time_generate(torch, model, 1, args.prompt_len, args.new_tokens, assistant=draft))
        print(json.dumps(result["rows"][-1]), flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
