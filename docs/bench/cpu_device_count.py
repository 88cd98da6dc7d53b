"""Decoding speed of the embedded pair on the CPU with 1 or 4 virtual CPU devices (the test suite
makes 4 for the tensor-parallel tests). Usage: python docs/bench/cpu_device_count.py N
Prints best-of-3 tokens/s, plain and K=3, 6 HumanEval prompts, 64 new tokens, batch 1."""
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))

import jaxspec  # noqa: E402
from jaxspec.bench.humaneval import load_prompts  # noqa: E402
from jaxspec.defaults import CHECKPOINTS  # noqa: E402

target = jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype="float32")
draft = jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32")
prompts = load_prompts(limit=6)


def tokens_per_s(**kw) -> float:
    runs = [jaxspec.generate(prompts, target, max_new_tokens=64, max_batch_size=1, warn_below_acceptance=0, **kw)
            for _ in range(3)]
    return max(o.metrics.new_tokens / o.metrics.decode_s for o in runs)


print(f"{jax.device_count()} CPU devices: plain {tokens_per_s():.1f}, "
      f"K=3 {tokens_per_s(draft=draft, num_draft_tokens=3):.1f} tokens/s")
