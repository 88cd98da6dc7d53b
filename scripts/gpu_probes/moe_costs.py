#!/usr/bin/env python3
"""Mixture-of-experts costs at real widths (issue 51), random weights, one JSON line each:

- layer: one layer's bytes: attention (q/k/v/o), router, one expert (gate, up, down);
- step: the plain decode step through the engine's loop at each batch (ms, by the difference of
  two budgets, so the prefill cancels), the unique experts its tokens chose per layer (forward's
  routing, in a separate, untimed pass), and the fraction of the
  floor of the bytes it must read (embedding rows aside: every layer's attention and router, the
  union of chosen experts, the LM head) at the device's copy bandwidth (the faster of torch's
  and JAX's device copies, as `jaxspec bench`; before 2026-12-07, JAX's alone);
- verify: one forward pass over K + 1 tokens per row (a chain's verify pass) against one token,
  with the unique experts of those tokens: what a verify round costs relative to a plain step;
- expert_op: one layer's experts for T tokens, the gather path (the chosen experts' weights), the
  grouped path (jax.lax.ragged_dot over tokens sorted by expert) and the grouped expert kernel
  (pallas_kernels/experts.py; with --tiles, each of those block_n/num_warps/num_stages too; up to
  16 tokens also with the grouped layout that few_tokens_layout replaced there, `_grouped`); beside
  them, to see where a layer's time goes, the kernel path's pair layout alone (group_pairs and the
  rows' scatter; by comparison, the default up to COMPARE_MAX_PAIRS, and by sorting), the router alone (norm, product, softmax, top-k) by XLA and by its kernels
  (pallas_kernels/router.py, the product over 16, 1 and 64 programs), and the whole MLP block as the
  engine runs it for those tokens (moe_mlp: router, its chosen path, combine, residual), us
  per call inside one jitted loop of --op-steps calls (so no call pays a dispatch; the H100 rows
  of 2026-12-06 in docs/moe.md were single calls, dispatch included), and each kernel's largest error against the float32 reference (relative to its
  largest output).

The step and verify rows use the engine's own choice of expert path; JAXSPEC_EXPERT_PATH=gather
(or ragged_dot, kernel) forces one, for a baseline in the same session; JAXSPEC_ROUTER=kernel
runs the router by its kernels.

    python3 scripts/gpu_probes/moe_costs.py --shape qwen3-30b-a3b-8l
    python3 scripts/gpu_probes/moe_costs.py --shape mixtral-8x7b-8l
    python3 scripts/gpu_probes/moe_costs.py --shape tiny-moe --dtype float32 --batches 1,2 --ks 1  # a check
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec.model.forward as fwd
from jaxspec.bench.common import best_seconds, machine
from jaxspec.bench.experts import ROUTINGS, filled_cache, one_expert_bytes, unique_experts, with_routing
from jaxspec.bench.scale import run_hf_peer
from jaxspec.bench.shapes import random_model
from jaxspec.decoding.loop import decode
from jaxspec.decoding.method import DecodeMethod
from jaxspec.model.quantize import SCHEMES
from jaxspec.sampling_params import GREEDY
from jaxspec.serving.batching import bucket, cache_capacity, make_batch
from jaxspec.serving.options import RunOptions
from jaxspec.serving.requests import Request
import pallas_kernels.experts as experts_module
from pallas_kernels.experts import experts_mlp, experts_mlp_reference, grouped_layout
from pallas_kernels.matmul import BLOCK_M
from pallas_kernels.router import router_topk


def emit(**row):
    print(json.dumps(row), flush=True)


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    x = jnp.ones((256 * 2**20,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    s = best_seconds(lambda: jax.block_until_ready(f(x)), 5)
    return 2 * x.nbytes / s


def first_layer(model):
    """Layer 0's weights, from the unrolled tuple or the stacked layers (weights.Weights)."""
    layers = model.weights.layers
    return layers[0] if isinstance(layers, tuple) else jax.tree.map(lambda a: a[0], layers)


def layer_bytes(model) -> dict:
    w = first_layer(model)
    size = lambda a: sum(x.nbytes for x in jax.tree.leaves(a))  # noqa: E731 (8-bit: values and scales)
    head = model.weights.lm_head if model.weights.lm_head is not None else model.weights.embed
    return {"attention": size((w.wqkv, w.wo)), "router": size(w.router), "expert": one_expert_bytes(model),
            "head": size(head)}


def repeated(fn, steps: int):
    """fn(h, experts, gate_up, down) `steps` times inside one jitted loop, each pass's h scaled by
    its index so nothing is hoisted: per-call time without a dispatch per call."""
    @jax.jit
    def many(h, experts, gate_up, down):
        def body(i, total):
            out = fn(h * (1 + i.astype(h.dtype) / 1024), experts, gate_up, down)
            return total + jnp.sum(out.astype(jnp.float32))
        return jax.lax.fori_loop(0, steps, body, jnp.zeros((), jnp.float32))
    return many


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--ks", default="1,3,5")
    p.add_argument("--tokens", default="1,4,8,32,64", help="token counts of the expert-op comparison")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", default="17,49")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiles", default="0/4/3", help="the expert kernel's block_n/num_warps/num_stages settings "
                   "to time, comma-separated; block_n 0 (named 'auto'): the engine's choice (pallas_kernels/experts.py "
                   "BLOCK_N)")
    p.add_argument("--quantize", choices=SCHEMES, help="8-bit experts and projections (step and verify rows only)")
    p.add_argument("--op-steps", type=int, default=16, help="expert-op calls per timed loop (dispatch paid once)")
    p.add_argument("--routing", choices=ROUTINGS, default="random",
                   help="random routers, or zeroed ones so every token chooses the same experts (the locality bound)")
    p.add_argument("--skip", default="", help="parts to leave out: step, verify, expert_op (comma-separated)")
    p.add_argument("--compare-max-pairs", type=int, help="pallas_kernels.experts.COMPARE_MAX_PAIRS for this run: "
                   "the most pairs grouped by comparison rather than sorting (default: the module's)")
    args = p.parse_args()
    if args.compare_max_pairs is not None:  # read when a pass is traced, so before any is
        experts_module.COMPARE_MAX_PAIRS = args.compare_max_pairs
    # torch's device copy, in its own process before JAX holds the GPU (none on the CPU): faster
    # than JAX's, so the floor is the one `jaxspec bench` uses (docs/moe.md, "The floor")
    with contextlib.redirect_stdout(sys.stderr):  # (its complaint, on the CPU, is no JSON row)
        torch_bw = run_hf_peer(None, copy_only=True).get("copy_bandwidth")
    model = with_routing(random_model(args.shape, args.dtype, quantize=args.quantize), args.routing)
    c = model.config
    jax_bw = copy_bandwidth()
    bw = max(jax_bw, torch_bw or 0)
    sizes = layer_bytes(model)
    skip = set(args.skip.split(",")) | ({"expert_op"} if args.quantize else set())  # (its XLA paths take floats)
    emit(kind="machine", shape=args.shape, dtype=args.dtype, quantize=args.quantize, routing=args.routing, copy_gb_s=round(bw / 1e9, 1),
         jax_copy_gb_s=round(jax_bw / 1e9, 1), torch_copy_gb_s=torch_bw and round(torch_bw / 1e9, 1),
         expert_path=fwd.FORCED_EXPERT_PATH or "engine's choice", router=fwd.ROUTER_PATH,
         compare_max_pairs=experts_module.COMPARE_MAX_PAIRS, **machine())
    emit(kind="layer", **{k: v for k, v in sizes.items()}, experts=c.num_experts, experts_per_token=c.experts_per_token)
    rng = np.random.default_rng(0)
    loop, _ = DecodeMethod("plain").loop(model, None)
    n1, n2 = (int(x) for x in args.new_tokens.split(","))
    attention = RunOptions().attention_impl

    def floor_s(experts: float) -> float:
        per_layer = sizes["attention"] + sizes["router"] + experts * sizes["expert"]
        return (c.num_layers * per_layer + sizes["head"]) / bw  # bytes read at the copy's traffic rate

    for b in (int(x) for x in args.batches.split(",") if x and "step" not in skip):
        prompts = rng.integers(1, c.vocab_size, (b, args.prompt_len)).tolist()
        batches = {n: make_batch([Request(tuple(q), dataclasses.replace(GREEDY, max_tokens=n)) for q in prompts], b,
                                 bucket(args.prompt_len), c.pad_token_id) for n in (n1, n2)}
        exe = decode.lower(model.weights, None, batches[n1], loop=loop, greedy_only=True, attention=attention,
                           capacity=cache_capacity(bucket(args.prompt_len), bucket(n2), 0), max_out=bucket(n2)).compile()
        times = [best_seconds(lambda n=n: jax.block_until_ready(exe(model.weights, None, batches[n])), args.repeats)
                 for n in (n1, n2)]
        ms = 1000 * (times[1] - times[0]) / (n2 - n1)
        experts = unique_experts(model, rng.integers(1, c.vocab_size, (b, 1)), args.prompt_len)
        emit(kind="step", batch=b, ms=round(ms, 4), unique_experts_per_layer=round(experts, 1),
             floor_ms=round(1000 * floor_s(experts), 4), of_floor=round(1000 * floor_s(experts) / ms, 3))

    # a verify pass over K + 1 tokens per row, against one token, at batch 1
    fwd_jit = jax.jit(fwd.forward, static_argnums=1, static_argnames=("attention",))
    cache = filled_cache(model, 1, args.prompt_len, args.prompt_len + 8)  # (the prefix its experts are counted after)
    base = None
    for k in ([0] + [int(x) for x in args.ks.split(",")] if "verify" not in skip else []):
        tokens = jnp.asarray(rng.integers(1, c.vocab_size, (1, k + 1)), jnp.int32)
        run = lambda t=tokens: jax.block_until_ready(fwd_jit(model.weights, c, t, cache, attention=attention))  # noqa: E731
        run()
        ms = 1000 * best_seconds(run, args.repeats)
        base = base or ms
        experts = unique_experts(model, np.asarray(tokens), args.prompt_len)
        emit(kind="verify", k=k, ms=round(ms, 4), over_one_token=round(ms / base, 3),
             unique_experts_per_layer=round(experts, 1), floor_ms=round(1000 * floor_s(experts), 4))

    # one layer's experts, gather path against ragged_dot, at T tokens (T * k pairs)
    layer = first_layer(model)
    e, k, d, f = c.num_experts, c.experts_per_token, c.hidden_size, c.moe_intermediate_size

    @jax.jit
    def gathered(h, experts, wg, wd):
        gu = jnp.einsum("td,tkdcf->tkcf", h, wg[experts], preferred_element_type=jnp.float32).astype(h.dtype)
        return jnp.einsum("tkf,tkfd->tkd", jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :], wd[experts])

    @jax.jit
    def grouped(h, experts, wg, wd):
        order = jnp.argsort(experts.reshape(-1), stable=True)
        sizes = jnp.bincount(experts.reshape(-1), length=e)
        xs = h[order // k]
        gu = jax.lax.ragged_dot(xs, wg.reshape(e, d, 2 * f), sizes, preferred_element_type=jnp.float32).astype(h.dtype)
        return jax.lax.ragged_dot(jax.nn.silu(gu[:, :f]) * gu[:, f:], wd, sizes)

    def layout(h, experts, wg, wd, method=None):  # the kernel path's work besides its two matmuls: pairs into blocks
        x, block_expert, _ = grouped_layout(h, experts.reshape(-1), e, method=method)
        return x[:1] + block_expert[0]

    def router(h, experts, wg, wd):  # norm, router product, softmax, top-k: what precedes any path
        hn = fwd.rms_norm(h[None], layer.mlp_norm, c.rms_norm_eps)
        return fwd._route_xla(c, hn, layer.router, False)[0]

    def router_kernel(h, experts, wg, wd, **split):  # the same by the router's kernels (pallas_kernels/router.py)
        hn = fwd.rms_norm(h[None], layer.mlp_norm, c.rms_norm_eps)[0]
        return router_topk(hn, layer.router, k=k, normalize=c.norm_topk_prob, interpret=jax.default_backend() == "cpu",
                           **split)[0]

    def whole_layer(h, experts, wg, wd):  # the engine's MLP block as a step runs it (its path, combine, residual)
        norm = fwd.Norm(layer.mlp_norm, c.rms_norm_eps)
        return fwd.moe_mlp(c, layer, h[None], None, False, norm, residual=h[None])[0]

    tiles = [tuple(int(v) for v in t.split("/")) for t in args.tiles.split(",") if t]
    def kernels(grouped=False):  # the grouped layout even for a few tokens: the one the engine's replaced
        return {f"kernel_{n or 'auto'}_{w}_{st}" + ("_grouped" if grouped else ""): jax.jit(functools.partial(
            experts_mlp, block_n=n or None, num_warps=w, num_stages=st, grouped=grouped,
            interpret=jax.default_backend() == "cpu")) for n, w, st in tiles}
    for t in (int(x) for x in args.tokens.split(",") if x and "expert_op" not in skip):
        if t * k * sizes["expert"] > 0.25 * (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 2**62):
            emit(kind="expert_op", tokens=t, skipped="the gather path's per-pair weight copies would not fit")
            continue
        h = jnp.asarray(rng.standard_normal((t, d)), model.dtype)
        experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
        unique = len(np.unique(np.asarray(experts)))
        weights = jnp.full((t, k), 1.0 / k, jnp.float32)
        row = {}
        ref = np.asarray(experts_mlp_reference(h, experts, weights, layer.experts_gate_up, layer.experts_down))
        paths = [("gather", gathered), ("ragged_dot", grouped)]
        paths += [(name, lambda h, x, g, d, fn=fn: fn(h, x, weights, g, d))
                  for name, fn in (kernels() | (kernels(grouped=True) if t <= BLOCK_M else {})).items()]
        paths += [("layout", layout), ("layout_sort", functools.partial(layout, method="sort")), ("router", router),
                  ("router_kernel", router_kernel)]  # the product over PRODUCT_PROGRAMS programs a row; and over
        steps, ep = d // 128, max(16, 1 << (e - 1).bit_length())  # (d's 128-row steps; E padded as the kernel does)
        # 1, 16 and 128 programs a row, as far as those steps allow: 16 experts a program but for 1
        paths += [(f"router_kernel_{n}_program{'s' * (n > 1)}", functools.partial(
            router_kernel, columns=ep if n == 1 else 16, splits=1 if n == 1 else max(1, min(steps, n * 16 // ep))))
            for n in (1, 16, 128)]
        paths += [("moe_layer", whole_layer)]
        for name, fn in paths:
            call = lambda fn=fn: jax.block_until_ready(fn(h, experts, layer.experts_gate_up, layer.experts_down))  # noqa: E731
            looped = repeated(fn, args.op_steps)
            run = lambda looped=looped: jax.block_until_ready(  # noqa: E731
                looped(h, experts, layer.experts_gate_up, layer.experts_down))
            try:
                out = call()
                run()
            except Exception as e:  # a tile setting the GPU cannot run (shared memory): reported, not fatal
                row[name + "_error"] = str(e).splitlines()[0][:200]
                continue
            row[name + "_us"] = round(1e6 * best_seconds(run, args.repeats) / args.op_steps, 1)
            if name.startswith("kernel"):  # its output against the float32 reference, as a check on the device
                err = np.max(np.abs(np.asarray(out, np.float32) - ref)) / np.max(np.abs(ref))
                row[name + "_rel_err"] = float(f"{err:.2e}")
        floor_us = 1e6 * unique * sizes["expert"] / bw
        emit(kind="expert_op", tokens=t, unique_experts=unique, floor_us=round(floor_us, 1), **row,
             **{name.removesuffix("_us") + "_of_floor": round(floor_us / v, 3) for name, v in row.items()
                if name.endswith("_us") and not name.startswith(("layout", "router"))})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
