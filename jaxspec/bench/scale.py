"""`jaxspec bench --shape NAME`: speed at real model shapes against the device's own limits.

Weights are random (jaxspec.bench.shapes), made on the device; EOS is off, so every row decodes its
whole budget. Everything is measured in one run, so every ratio compares numbers of one machine
on one day:
  * ceilings: copy bandwidth (read + write bytes per second of a device-to-device copy; torch's
    when the HF peer runs, JAX's always: the larger one sets the floor) and the bf16 matmul rate;
  * plain decoding through `jaxspec.generate`: ms per step = (decode time - prefill time) /
    steps, against the floor = (weight bytes + KV bytes read per step) / copy bandwidth;
  * forward costs: one forward pass of t tokens (verify sizes, named trees) over a prefix,
    timed inside one jitted loop, against t = 1;
  * speculative rounds through `jaxspec.generate`: ms per round, against the sum of its parts
    (draft passes + one verify pass, from the forward costs): the engine's own overhead;
  * a projection of the speculative speedup at the embedded code pair's acceptance, measured in
    the same run (random weights accept nothing, so this is labelled a projection);
  * an EAGLE-3 head at the target's width (part `eagle`, jaxspec.bench.eagle_costs): its step
    against its floor, and its rounds, projected at given tokens per round;
  * prefill tokens/s and FLOP/s at one prompt length, against the matmul rate;
  * HF transformers at the same shapes (its own process, before JAX takes the GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import best_seconds, committed, machine
from jaxspec.bench.humaneval import load_prompts
from jaxspec.bench.schedulers import lengths_cases, lognormal_requests, scheduler_rows
from jaxspec.bench.eagle_costs import head_ms, head_step_bytes
from jaxspec.bench.experts import ROUTINGS, active_weight_bytes, filled_cache, unique_experts, with_routing
from jaxspec.bench.shapes import random_head, random_model, step_weight_bytes
from jaxspec.model.quantize import SCHEMES
from jaxspec.checks import int_list
from jaxspec.decoding.ngram import Ngram
from jaxspec.decoding.state import prefill
from jaxspec.decoding.tree_verify import TreePlan
from jaxspec.decoding.trees import NAMED_TREES, ancestor_mask, chain
from jaxspec.defaults import DEFAULT_DRAFT, DEFAULT_EAGLE, DEFAULT_TARGET, embedded_model
from jaxspec.errors import InputError
from jaxspec.model.forward import DeterministicParts, deterministic_parts, forward
from jaxspec.model.loading import load, replicated_on
from jaxspec.serving.batching import bucket, cache_capacity, make_batch
from jaxspec.serving.generate import build_requests, generate
from jaxspec.sampling_params import GREEDY
from jaxspec.serving.options import RunOptions

PARTS = ("hf", "plain", "forward", "spec", "prefill", "acceptance", "continuous", "eagle")


def add_scale_args(p) -> None:
    g = p.add_argument_group("real shapes (--shape): random weights made on the device")
    g.add_argument("--shape", help="named target shape (jaxspec.shapes.SHAPES, e.g. llama3-8b): switches to this mode")
    g.add_argument("--draft-shape", help="named draft shape (e.g. llama3.2-1b) for speculative rows")
    g.add_argument("--prompt-lens", type=int_list, default=[128, 8192],
                   help="plain decoding prompt lengths: the first at every batch size, the others at batch 1")
    g.add_argument("--new-tokens", type=int, default=256, help="tokens decoded per row (default 256)")
    g.add_argument("--verify-sizes", type=int_list, default=[1, 2, 3, 4, 5, 6, 8, 12, 16],
                   help="forward-pass sizes t to time (default 1,2,3,4,5,6,8,12,16)")
    g.add_argument("--spec-k", type=int_list, default=[1, 2, 3, 4, 5], help="draft chain lengths (default 1..5)")
    g.add_argument("--prefill-len", type=int, default=2048, help="prompt length of the prefill row")
    g.add_argument("--hf-new-tokens", type=int, default=64, help="tokens per HF row (default 64)")
    g.add_argument("--hf-batch-sizes", type=int_list, default=[1, 32], help="HF plain rows (default 1,32)")
    g.add_argument("--acceptance-prompts", type=int, default=20,
                   help="HumanEval prompts for the embedded pair's acceptance (default 20)")
    g.add_argument("--acceptance-new-tokens", type=int, default=128,
                   help="tokens per prompt for the embedded pair's acceptance (default 128)")
    g.add_argument("--parts", help=f"--shape: comma-separated subset of {','.join(PARTS)} (default all); without "
                                   "--shape, 'continuous' runs only the scheduler comparison on the embedded pair")
    g.add_argument("--seed", type=int, default=0, help="random weights and prompts")
    g.add_argument("--routing", choices=ROUTINGS, default="random",
                   help="a mixture-of-experts target's routers: random, or zeroed so every token chooses the same "
                        "experts (the locality bound of a verify pass)")
    g.add_argument("--quantize", choices=SCHEMES, help="the target's projections in 8 bits (default: none)")
    g.add_argument("--draft-quantize", choices=SCHEMES, help="the draft's projections in 8 bits (default: none)")
    g.add_argument("--eagle-k", type=int_list, default=[3, 5, 7], help="eagle part: chain lengths (default 3,5,7)")
    g.add_argument("--eagle-draft-vocab", type=int, default=32000,
                   help="eagle part: the head's draft vocabulary (default 32000, as Llama 3.1 8B's published heads)")
    g.add_argument("--eagle-tokens-per-round", type=tokens_per_round, default={},
                   help="eagle part: K=tokens or tree=tokens pairs (e.g. 3=2.9,sparse=3.3) to project the speedup "
                        "at (default: the acceptance part's, measured with the embedded head)")
    g.add_argument("--job-records-per-slot", type=int, default=8,
                   help="continuous part, --shape: records of the lognormal-budget job per batch slot (default 8)")
    g.add_argument("--refill-at", type=int_list, help="continuous part: refill policies to time (default: the engine's)")
    g.add_argument("--lengths", type=lengths_cases, default="seen,hidden",
                   help="continuous part: cases of the job (jaxspec.bench.schedulers), comma-separated (default seen,hidden)")


def tokens_per_round(text: str) -> dict[str, float]:
    """"3=2.9,sparse=3.3" -> {"3": 2.9, "tree sparse": 3.3}: chain lengths and named trees."""
    try:
        pairs = [item.split("=") for item in text.split(",") if item]
        return {(k if k.isdigit() else f"tree {k}"): float(v) for k, v in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K=tokens or tree=tokens pairs like 3=2.9,sparse=3.3; "
                                         f"got {text!r}") from None


def jax_copy_bandwidth(gib: float = 4.0, repeats: int = 10) -> float:
    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    s = best_seconds(lambda: f(x).block_until_ready(), repeats)
    return 2 * x.nbytes / s


def matmul_rate(n: int = 8192, repeats: int = 10) -> float:
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    return 2 * n**3 / best_seconds(lambda: f(a).block_until_ready(), repeats)


@functools.partial(jax.jit, static_argnames=("config", "steps", "attention"), donate_argnames=("cache",))
def _forward_loop(weights, cache, tokens, positions, chunk_mask, *, config, steps, attention):
    """`steps` forward passes of the same shape; tokens change per pass so nothing is hoisted."""
    causal = deterministic_parts(attention) is not None  # chunks causal at the cache's lengths (forward_ms checks)

    def body(i, carry):
        cache, acc = carry
        logits, cache = forward(weights, config, (tokens + i) % config.vocab_size, cache,
                                None if causal else positions, None if causal else chunk_mask, attention=attention)
        return cache, acc + logits[:, 0, 0]
    return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros(tokens.shape[:1], jnp.float32)))


def forward_ms(model, batch: int, prefix: int, chunk_mask: np.ndarray, attention: str, steps: int, repeats: int) -> float:
    """ms of one forward pass of t = len(chunk_mask) tokens per row over a `prefix`-token cache."""
    return 1000 * best_seconds(forward_loop(model, batch, prefix, chunk_mask, attention, steps), repeats) / steps


def forward_tokens(vocab: int, batch: int, t: int) -> np.ndarray:
    """The tokens forward_loop's passes start from: distinct ones, so that a mixture of experts'
    t tokens choose experts as a verify pass's do (t copies of one token would choose one token's)."""
    return np.random.default_rng(2).integers(1, vocab, (batch, t))


def forward_loop(model, batch: int, prefix: int, chunk_mask: np.ndarray, attention: str | DeterministicParts,
                 steps: int):
    """A call that runs `steps` forward passes of t = len(chunk_mask) tokens per row over a
    `prefix`-token cache in one jitted loop and waits for them. attention: forward's (a
    DeterministicParts too)."""
    t = chunk_mask.shape[0]
    if deterministic_parts(attention) is not None and not np.array_equal(chunk_mask, np.tril(np.ones((t, t), bool))):
        raise InputError("deterministic mode verifies chains only: time trees without --deterministic")
    cap = cache_capacity(prefix, t, 0)
    tokens = jnp.asarray(forward_tokens(model.config.vocab_size, batch, t), jnp.int32)
    positions = prefix + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
    mask = jnp.asarray(chunk_mask)
    # the prefix's K/V in the cache, as in the passes whose experts count for a floor (filled_cache)
    cache = filled_cache(model, batch, prefix, cap, mesh=model.weights.mesh)
    # the cache placed as the loop hands it back (committed to its devices; lengths, over a mesh,
    # whole on each device), or the second call would compile the loop again for another input
    # sharding, once more per row (and, at --repeats 1, in the timed call)
    lengths = jnp.full((batch,), prefix, jnp.int32, device=cache.lengths.sharding)
    state = {"cache": committed(cache.replace(lengths=lengths))}

    def args():
        return (model.weights, state["cache"], tokens, positions, mask)

    def run():  # the loop donates the cache and hands it back for the next call
        state["cache"], acc = _forward_loop(*args(), config=model.config, steps=steps, attention=attention)
        acc.block_until_ready()

    # the compiled loop's program text, for naming its kernels (scripts/gpu_probes/moe_profile.py)
    run.compiled_text = lambda: _forward_loop.lower(*args(), config=model.config, steps=steps,
                                                    attention=attention).compile().as_text()
    return run


def _prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, (batch, length)).tolist()


# A prefill is one forward pass: timing it at least this many times costs little, and the step
# times subtract it from whole decodes, where one slow sample of it (repeats 1, a tiny shape on
# the 2-core CI machine) made a step's time negative.
PREFILL_REPEATS = 5


def _prefill_s(model, prompts, max_new: int, slack: int, repeats: int, attention: str = "xla") -> float:
    """Seconds of the prefill that generate() runs for these prompts (same shapes; attention: the
    call's, since deterministic mode prefills with its own kernels): the best of at least
    PREFILL_REPEATS calls."""
    reqs = build_requests(prompts, model, dataclasses.replace(GREEDY, max_tokens=max_new))
    prompt_len = bucket(max(len(p) for p in prompts))
    batch = make_batch(reqs, bucket(len(prompts), 1), prompt_len, model.config.pad_token_id)
    cap = cache_capacity(prompt_len, bucket(max_new), slack)
    f = jax.jit(functools.partial(prefill, config=model.config, capacity=cap, attention=attention))
    return best_seconds(lambda: jax.block_until_ready(f(model.weights, batch=batch)), max(repeats, PREFILL_REPEATS))


def _kv_bytes(model, batch: int, length: float) -> float:
    """Cache bytes one step reads on each device (split by kv heads over the model's devices)."""
    c = model.config
    return batch * length * c.num_layers * 2 * c.num_kv_heads * c.head_dim * model.dtype.itemsize / model.tensor_parallel


def _generate(prompts, target, draft, new_tokens, repeats, attention, **kw):
    call = lambda: generate(prompts, target, draft, max_new_tokens=new_tokens,  # noqa: E731
                                    max_batch_size=len(prompts), warn_below_acceptance=0.0,
                                    attention=attention, **kw)
    first = call()  # compiles
    outs = min((call() for _ in range(repeats)), key=lambda o: o.metrics.decode_s)
    return first.metrics.compile_s, outs


def plain_row(model, batch: int, prompt_len: int, new_tokens: int, repeats: int, attention: str, bw: float, seed: int):
    prompts = _prompts(model.config.vocab_size, batch, prompt_len, seed)
    compile_s, outs = _generate(prompts, model, None, new_tokens, repeats, attention)
    pre = _prefill_s(model, prompts, new_tokens, 0, repeats, attention)
    steps = new_tokens - 1  # the prefill made the first token
    step_ms = 1000 * (outs.metrics.decode_s - pre) / steps
    experts = {}
    if model.config.is_moe:  # a step reads the experts its tokens choose (a random next token's, as a sample)
        tokens = np.random.default_rng(seed).integers(1, model.config.vocab_size, (batch, 1))
        experts = {"experts_per_layer": unique_experts(model, tokens, prompt_len)}
        weight_bytes = active_weight_bytes(model, experts["experts_per_layer"])
    else:
        weight_bytes = step_weight_bytes(model)
    floor_bytes = weight_bytes + _kv_bytes(model, batch, prompt_len + new_tokens / 2)
    floor_ms = 1000 * floor_bytes / bw
    return {"part": "plain", "model": model.name, "batch": batch, "prompt_len": prompt_len,
            "new_tokens": new_tokens, "compile_s": compile_s, "prefill_ms": 1000 * pre, "ms_per_step": step_ms,
            "tokens_per_s": batch * 1000 / step_ms, "floor_ms": floor_ms, "of_floor": floor_ms / step_ms,
            "bytes_per_step": floor_bytes, **experts}


def spec_row(target, draft, prompt_len, new_tokens, repeats, attention, seed, costs, k=None, tree=None):
    """A speculative round's ms through generate() against its parts; draft: a model or Ngram
    (n-gram lookup: no draft passes, the search counts as overhead)."""
    ngram = isinstance(draft, Ngram)
    tree_parents = NAMED_TREES[tree] if tree else chain(k)
    prompts = _prompts(target.config.vocab_size, 1, prompt_len, seed)
    kw = {"tree": tree} if tree else {"num_draft_tokens": k}
    compile_s, outs = _generate(prompts, target, draft, new_tokens, repeats, attention, **kw)
    slack = len(tree_parents) + 1
    pre = _prefill_s(target, prompts, new_tokens, slack, repeats, attention)
    if not ngram:
        pre += _prefill_s(draft, prompts, new_tokens, slack, repeats)
    rounds = sum(o.stats.target_steps - 1 for o in outs)
    round_ms = 1000 * (outs.metrics.decode_s - pre) / rounds
    depth = max(len(o.stats.accepted_per_position) for o in outs)
    if ngram:
        draft_ms, verify_ms = 0.0, costs[("target", f"t={k + 1}")]
    elif tree:
        draft_ms = depth * costs[("draft", f"tree {tree}")]
        verify_ms = costs[("target", f"tree {tree}")]
    else:
        draft_ms = costs[("draft", "t=2")] + (k - 1) * costs[("draft", "t=1")]
        verify_ms = costs[("target", f"t={k + 1}")]
    method = f"ngram K={k}" if ngram else f"tree {tree}" if tree else f"K={k}"
    experts = {} if outs.metrics.experts_per_layer is None else {"experts_per_layer": outs.metrics.experts_per_layer}
    return {"part": "spec", "method": method, "compile_s": compile_s, **experts,
            "rounds": rounds, "ms_per_round": round_ms, "draft_ms": draft_ms, "verify_ms": verify_ms,
            "overhead": round_ms / (draft_ms + verify_ms) - 1}


def eagle_rows(target, args, prompt_len: int, new_tokens: int, repeats: int, attention: str, bw: float, costs: dict,
               plain: dict | None, acc: dict, emit) -> None:
    """The eagle part (jaxspec.bench.eagle_costs): a random head at the target's sizes, its step
    against its floor, and rounds of each K and named tree through generate against their parts,
    projected at the embedded head's measured tokens per round (`acc`, the acceptance part) or
    at --eagle-tokens-per-round."""
    if target.tensor_parallel > 1:
        raise SystemExit("--parts eagle: EAGLE-3 heads draft for a whole target (no --tensor-parallel) for now")
    c, P = target.config, prompt_len
    head = random_head(c, min(args.eagle_draft_vocab, c.vocab_size), dtype=target.dtype, seed=args.seed + 2)
    embed = target.weights.embed
    step = head_ms(head, embed, P, 1, False, 16, repeats)
    kv = 2 * P * c.num_kv_heads * c.head_dim * target.dtype.itemsize
    floor = 1000 * (head_step_bytes(head) + kv) / bw
    emit({"part": "head_step", "model": f"{head.name} for {target.name}", "ms": step, "floor_ms": floor,
          "of_floor": floor / step, "draft_vocab": head.config.draft_vocab_size})
    prompts = _prompts(c.vocab_size, 1, P, args.seed)
    runs = [(f"eagle K={k}", chain(k), {"num_draft_tokens": k}) for k in args.eagle_k]
    runs += [(f"eagle tree {t}", NAMED_TREES[t], {"tree": t}) for t in args.trees.split(",") if t]
    for label, parents, kw in runs:
        plan = TreePlan.of(parents)
        t, D = plan.size, plan.max_depth
        is_chain = parents == chain(D)
        # First pass: fc and the layer over up to D + 1 accepted pairs; then D - 1 passes over
        # one new token (a chain) or the tree's t - 1 nodes (dense-masked: the mask's content
        # costs nothing), and the target's verify pass of the t nodes.
        first = head_ms(head, embed, P, D + 1, True, 16, repeats)
        later = step if is_chain else head_ms(head, embed, P, t - 1, False, 16, repeats)
        key = ("target", f"t={t}") if is_chain else ("target", label.removeprefix("eagle "))
        verify = costs.get(key) or forward_ms(target, 1, P, ancestor_mask(parents), attention, steps=16, repeats=repeats)
        compile_s, outs = _generate(prompts, target, head, new_tokens, repeats, attention, **kw)
        pre = _prefill_s(target, prompts, new_tokens, t + 1, repeats, attention)
        pre += head_ms(head, embed, 0, bucket(P), True, 1, repeats) / 1000  # the head's prompt pass
        rounds = sum(o.stats.target_steps - 1 for o in outs)
        round_ms = 1000 * (outs.metrics.decode_s - pre) / rounds
        draft_ms = first + (D - 1) * later
        emit({"part": "spec", "method": label, "compile_s": compile_s, "rounds": rounds,
              "ms_per_round": round_ms, "draft_ms": draft_ms, "verify_ms": verify,
              "overhead": round_ms / (draft_ms + verify) - 1})
        given = args.eagle_tokens_per_round.get(label.removeprefix("eagle ").removeprefix("K="))
        tpr = acc[label]["tokens_per_round"] if label in acc else given
        if plain and tpr:
            emit({"part": "projection", "method": label, "tokens_per_round": tpr,
                  "projected_speedup": tpr * plain["ms_per_step"] / round_ms})


def prefill_row(model, prompt_len: int, repeats: int, rate: float, seed: int):
    c = model.config
    prompts = _prompts(c.vocab_size, 1, prompt_len, seed)
    s = _prefill_s(model, prompts, 1, 0, repeats)
    layer_params = sum(a.size for a in jax.tree.leaves(model.weights.layers))
    attn = 2 * 2 * c.num_layers * c.num_heads * c.head_dim * prompt_len * prompt_len / 2  # causal QK and PV
    flops = 2 * prompt_len * layer_params + attn + 2 * c.hidden_size * c.vocab_size
    return {"part": "prefill", "model": model.name, "prompt_len": prompt_len, "ms": 1000 * s,
            "tokens_per_s": prompt_len / s, "tflops": flops / s / 1e12, "of_matmul_rate": flops / s / rate}


def embedded_acceptance(ks, trees, prompts: int, new_tokens: int = 128, ngram_ks=(), eagle_ks=(),
                        eagle_trees=()) -> dict:
    """Tokens committed per target pass by the embedded code pair (float32), per K / tree, by
    n-gram lookup with the embedded target, and by the embedded EAGLE-3 head per K / tree."""
    target = load(embedded_model(DEFAULT_TARGET), dtype="float32")
    draft = load(embedded_model(DEFAULT_DRAFT), dtype="float32")
    texts = load_prompts(limit=prompts)
    out = {}
    runs = [(f"K={k}", draft, {"num_draft_tokens": k}) for k in ks] + [(f"tree {t}", draft, {"tree": t}) for t in trees]
    runs += [(f"ngram K={k}", "ngram", {"num_draft_tokens": k}) for k in ngram_ks]
    if eagle_ks or eagle_trees:
        head = load(embedded_model(DEFAULT_EAGLE), dtype="float32")
        runs += [(f"eagle K={k}", head, {"num_draft_tokens": k}) for k in eagle_ks]
        runs += [(f"eagle tree {t}", head, {"tree": t}) for t in eagle_trees]
    for label, d, kw in runs:
        outs = generate(texts, target, d, max_new_tokens=new_tokens, max_batch_size=1,
                                warn_below_acceptance=0.0, **kw)
        rounds = sum(o.stats.target_steps - 1 for o in outs)
        per_pos = np.sum([o.stats.accepted_per_position for o in outs], axis=0) / rounds
        out[label] = {"tokens_per_round": 1 + float(per_pos.sum()), "per_position": per_pos.round(3).tolist()}
    return out


def run_hf_peer(args, copy_only: bool = False) -> dict:
    """The HF rows and torch's copy bandwidth (copy_only: the bandwidth alone), from its own process."""
    cmd = [sys.executable, "-m", "jaxspec.bench.hf_peer"]
    if copy_only:
        cmd.append("--copy-only")
    else:
        cmd += ["--shape", args.shape, "--batch-sizes", ",".join(map(str, args.hf_batch_sizes)),
                "--prompt-len", str(args.prompt_lens[0]), "--new-tokens", str(args.hf_new_tokens)]
        if args.draft_shape:
            cmd += ["--draft-shape", args.draft_shape]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"HF/torch peer failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", flush=True)
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_scale_bench(args) -> int:
    parts = set((args.parts or ",".join(PARTS)).split(","))
    if parts - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(parts - set(PARTS))}; allowed: {', '.join(PARTS)}")
    if args.no_hf:
        parts.discard("hf")
    trees = [t for t in args.trees.split(",") if t]
    attention = RunOptions(args.attention).attention_impl
    result = {"args": vars(args), "rows": []}

    def save():  # process 0 writes (every process measures the same graphs under jax.distributed)
        if args.json and jax.process_index() == 0:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str))

    def emit(row):
        result["rows"].append(row)
        print(json.dumps(row, default=str), flush=True)
        save()

    # First, in its own process, before JAX holds the GPU. Without the HF rows torch still
    # measures the copy bandwidth (JAX's elementwise copy reached only 3.0 of 4.2 TB/s on an H200).
    result["hf"] = run_hf_peer(args, copy_only="hf" not in parts)
    for row in result["hf"].get("rows", []):
        emit(row)
    result["machine"] = machine()
    print(f"machine: {result['machine']}", flush=True)
    cpu = jax.default_backend() == "cpu"  # probes sized for a GPU would take minutes there
    bw = jax_copy_bandwidth(0.25 if cpu else 4.0)
    bw_torch = result.get("hf", {}).get("copy_bandwidth")
    rate = matmul_rate(1024 if cpu else 8192)
    result["ceilings"] = {"copy_bandwidth_jax": bw, "copy_bandwidth_torch": bw_torch, "bf16_matmul_flops": rate}
    bw = max(bw, bw_torch or 0)
    result["ceilings"]["floor_bandwidth"] = bw
    print(f"ceilings: {result['ceilings']}", flush=True)
    save()

    dtype = args.dtype or "bfloat16"
    t0 = time.perf_counter()
    target = with_routing(random_model(args.shape, dtype, args.seed, args.tensor_parallel, args.quantize,
                                       args.expert_parallel), args.routing)
    jax.block_until_ready(target.weights)
    draft = None
    if args.draft_shape:
        draft = replicated_on(random_model(args.draft_shape, dtype, args.seed + 1, args.draft_tensor_parallel,
                                           args.draft_quantize), target.mesh)
    result["models"] = {m.name: {"bytes_per_device": step_weight_bytes(m), "tensor_parallel": m.tensor_parallel}
                        for m in (target, draft) if m}
    print(f"random weights made in {time.perf_counter() - t0:.1f} s: {result['models']}", flush=True)
    P, N, R = args.prompt_lens[0], args.new_tokens, args.repeats

    if "plain" in parts:
        configs = [(b, P) for b in args.batch_sizes] + [(1, p) for p in args.prompt_lens[1:]]
        for b, p in configs:
            emit(plain_row(target, b, p, N, R, attention, bw, args.seed))
    costs = {}
    if "forward" in parts or "spec" in parts:
        causal = lambda t: (f"t={t}", np.tril(np.ones((t, t), bool)))  # noqa: E731
        trees_masks = [(f"tree {name}", ancestor_mask(NAMED_TREES[name])) for name in trees]
        # The target verifies K + 1 tokens or a tree; the draft runs 2 tokens, then 1, or a tree
        # level over [prev, tree nodes].
        target_sizes = sorted(set(args.verify_sizes) | {1} | {k + 1 for k in args.spec_k + args.ngram_k})
        plan = [("target", target, [causal(t) for t in target_sizes] + trees_masks)]
        if draft is not None:
            plan.append(("draft", draft, [causal(1), causal(2)] + [(n, np.tril(np.ones((len(m) + 1,) * 2, bool)))
                                                                   for n, m in trees_masks]))
        for role, m, sizes in plan:
            for label, mask in sizes:
                costs[(role, label)] = ms = forward_ms(m, 1, P, mask, attention, steps=16, repeats=R)
                row = {"part": "forward", "model": m.name, "role": role, "size": label, "tokens": len(mask),
                       "prefix": P, "ms": ms, "vs_one_token": ms / costs[(role, "t=1")]}
                if m.config.is_moe:  # the floor of the bytes the pass reads: the experts its tokens choose
                    experts = unique_experts(m, forward_tokens(m.config.vocab_size, 1, len(mask)), P, passes=4)
                    floor = 1000 * (active_weight_bytes(m, experts) + _kv_bytes(m, 1, P)) / bw
                    row |= {"experts_per_layer": experts, "floor_ms": floor, "of_floor": floor / ms}
                emit(row)
        if draft is not None:
            one = costs[("draft", "t=1")]
            floor = 1000 * (step_weight_bytes(draft) + _kv_bytes(draft, 1, P)) / bw
            emit({"part": "draft_step", "model": draft.name, "ms": one, "floor_ms": floor, "of_floor": floor / one})
    acc = {}
    if "acceptance" in parts:  # before the long spec rows, so a cut-short run keeps it
        eagle = "eagle" in parts
        acc = result["embedded_acceptance"] = embedded_acceptance(
            args.spec_k if draft is not None else [], trees if draft is not None else [], args.acceptance_prompts,
            args.acceptance_new_tokens, args.ngram_k, args.eagle_k if eagle else [], trees if eagle else [])
        print(f"embedded pair acceptance: {acc}", flush=True)
    plain = next((r for r in result["rows"] if r.get("part") == "plain" and r["batch"] == 1 and r["prompt_len"] == P), None)
    if "spec" in parts:
        runs = [(draft, {"k": k}) for k in args.spec_k] + [(draft, {"tree": t}) for t in trees] if draft else []
        runs += [(Ngram(), {"k": k}) for k in args.ngram_k]
        for d, kw in runs:
            row = spec_row(target, d, P, N, R, attention, args.seed, costs, **kw)
            emit(row)
            if plain and row["method"] in acc:
                tpr = acc[row["method"]]["tokens_per_round"]
                emit({"part": "projection", "method": row["method"], "tokens_per_round": tpr,
                      "projected_speedup": tpr * plain["ms_per_step"] / row["ms_per_round"]})
    if "eagle" in parts:
        eagle_rows(target, args, P, N, R, attention, bw, costs, plain, acc, emit)
    if "prefill" in parts:
        emit(prefill_row(target, args.prefill_len, R, rate, args.seed))
    if "continuous" in parts:
        for b in args.batch_sizes:
            requests = lognormal_requests(_prompts(target.config.vocab_size, args.job_records_per_slot * b, P, args.seed),
                                          args.seed)
            scheduler_rows(target, requests, b, attention, refills=args.refill_at or [None],
                           lengths=args.lengths, emit=emit)
    save()
    _print_summary(result)
    return 0


def _print_summary(result: dict) -> None:
    rows = result["rows"]
    print("\n| part | what | ms | tokens/s | of floor / vs 1 token / overhead |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        part = r.get("part")
        if part == "plain":
            print(f"| plain | {r['model']} B={r['batch']} prompt {r['prompt_len']} | {r['ms_per_step']:.2f} | "
                  f"{r['tokens_per_s']:.1f} | {r['of_floor']:.2f} of {r['floor_ms']:.2f} ms |")
        elif part == "forward":
            rel = f"{r['vs_one_token']:.2f}x" if r["vs_one_token"] else "-"
            if "experts_per_layer" in r:
                rel += f"; {r['of_floor']:.2f} of {r['floor_ms']:.2f} ms, {r['experts_per_layer']:.1f} experts/layer"
            print(f"| forward | {r['model']} {r['size']} | {r['ms']:.2f} | - | {rel} |")
        elif part in ("draft_step", "head_step"):
            print(f"| {part.replace('_', ' ')} | {r['model']} | {r['ms']:.2f} | - | {r['of_floor']:.2f} of "
                  f"{r['floor_ms']:.2f} ms |")
        elif part == "spec":
            print(f"| spec round | {r['method']} (draft {r['draft_ms']:.2f} + verify {r['verify_ms']:.2f}) | "
                  f"{r['ms_per_round']:.2f} | - | {100 * r['overhead']:+.1f}% |")
        elif part == "prefill":
            print(f"| prefill | {r['model']} {r['prompt_len']} tokens | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | "
                  f"{r['tflops']:.0f} TFLOP/s = {r['of_matmul_rate']:.2f} of matmul |")
        elif part == "continuous":
            vs = f"{r['vs_static']:.2f}x static, {r['same_as_static']} same" if "vs_static" in r else "-"
            refill = f" refill at {r['refill_at']}" if r.get("refill_at") else ""
            print(f"| {r['scheduler']} scheduler{refill}, lengths {r['lengths']} | {r['model']} B={r['batch']}, "
                  f"{r['records']} lognormal records | {1000 * r['seconds']:.0f} | {r['tokens_per_s']:.0f} | "
                  f"{r['records_per_s']:.2f} records/s, {vs} |")
        elif part == "projection":
            print(f"| projection | {r['method']} at {r['tokens_per_round']:.2f} tokens/round | - | - | "
                  f"{r['projected_speedup']:.2f}x |")
        elif r.get("engine") == "hf":
            print(f"| HF {r['method']} | B={r['batch']} | {r['ms_per_token_step']:.2f} | {r['tokens_per_s']:.1f} | - |")
