"""Tensor parallelism: one model over a 1-D device mesh (axis "tp"), Megatron style.

One table maps logical axes to the mesh axis; every weight names its logical axes once (the
checkpoint's in model.param_specs, the engine layout's in model.LAYER_AXES / TOP_AXES). q/k/v
and gate/up are split by kv heads and ffn columns, o and down by rows, so a layer needs two
all-reduces (after o and after down); embedding and head are split by vocabulary. A mixture of
experts splits each expert's ffn columns the same way, or under expert parallelism (vLLM's
enable_expert_parallel) hands each device E/N whole experts: its down products are then summed by
the same all-reduce, each device's over the (token, expert) pairs routed to its experts. The forward
pass runs per shard under shard_map (model.forward), so the communication is exactly those
collectives, not what XLA's propagation would pick (which, with only the arrays sharded, gave
no gain at batch 1 on two H200s).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec.errors import InputError
from jaxspec.model.config import ModelConfig

TP = "tp"
# Logical axis -> mesh axis. Absent axes are replicated. A mixture of experts' weights name two axes
# of their own, "experts" (which expert) and "expert_ffn" (an expert's ffn columns), of which one
# stays whole (EXPERT_WHOLE).
RULES = {"vocab": TP, "heads": TP, "kv_heads": TP, "ffn": TP, "experts": TP, "expert_ffn": TP}
# The experts' axis that stays whole, by expert_parallel: off, every device holds a slice of each
# expert's columns (tensor parallel inside the experts); on, E/N whole experts (expert parallel).
EXPERT_WHOLE = {False: "experts", True: "expert_ffn"}
CACHE_AXES = (None, None, "kv_heads", None)  # [b, s, n, k] per layer


def spec(axes: tuple, stacked: bool = False) -> P:
    """PartitionSpec of an array with these logical axes; stacked: a leading layer axis."""
    return P(*(((None,) if stacked else ()) + tuple(RULES.get(a) for a in axes)))


def split_axes(axes: tuple, config: ModelConfig, tp: int, expert_parallel: bool = False) -> tuple:
    """Logical axes as they split tp ways: the vocabulary stays whole where tp does not divide it
    (every Llama, Qwen and Mistral vocabulary splits 8 ways), and so do kv heads where tp does not
    divide them (past their count they are repeated first: kv_repeats); the experts split by
    expert or by their columns (EXPERT_WHOLE)."""
    whole = {"vocab": config.vocab_size % tp != 0, "kv_heads": config.num_kv_heads % tp != 0,
             EXPERT_WHOLE[expert_parallel]: True}
    return tuple(None if whole.get(a) else a for a in axes)


def kv_repeats(config: ModelConfig, tp: int) -> int:
    """How many devices share each kv head: 1 while tp <= kv heads; past that each kv head is
    repeated tp / kv heads times, each copy with its share of the head's queries (as vLLM and
    SGLang do), which is the same model with more, smaller kv groups (see serving_config)."""
    return max(1, tp // config.num_kv_heads)


def serving_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config the engine runs at tensor parallel tp: kv heads repeated (kv_repeats)."""
    return dataclasses.replace(config, num_kv_heads=config.num_kv_heads * kv_repeats(config, tp))


def check_expert_parallel(config: ModelConfig, expert_parallel, name: str = "model") -> bool:
    """expert_parallel as a bool, or InputError: it must be a bool, and only a mixture of experts
    has experts to split."""
    if not isinstance(expert_parallel, bool):
        raise InputError(f"expert_parallel must be True or False; got {expert_parallel!r}")
    if expert_parallel and not config.is_moe:
        raise InputError(f"expert_parallel: {name} is a dense model ({config.model_type}, num_experts 0); only a "
                         "mixture of experts (qwen3_moe, mixtral) splits by expert")
    if expert_parallel and jax.process_count() > 1:
        raise InputError(f"expert_parallel splits over one host's devices for now; {jax.process_count()} processes "
                         "run under jax.distributed (use tensor parallelism inside the experts)")
    return expert_parallel


def check_tensor_parallel(config: ModelConfig, tp, name: str = "model", expert_parallel: bool = False) -> int:
    """tp as an int, or InputError naming the sizes that cannot be split tp ways (expert_parallel:
    the experts split by expert, so their count must divide, not their width)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InputError(f"tensor_parallel must be an integer >= 1; got {tp!r}")
    devices = jax.device_count()
    if tp > devices:
        raise InputError(
            f"tensor_parallel {tp} needs {tp} devices; {devices} are visible ({jax.devices()[0].platform}). "
            "On the CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N."
        )
    n, g = config.num_kv_heads, config.queries_per_kv
    if not check_split(config, tp, expert_parallel):
        allowed = [d for d in range(1, devices + 1) if check_split(config, d, expert_parallel)]
        sizes = ", ".join(f"{k} {v}" + " (expert_parallel)" * (k == "num_experts")
                          for k, v in split_sizes(config, expert_parallel).items())
        raise InputError(
            f"tensor_parallel {tp} cannot split {name}: num_heads {config.num_heads}, num_kv_heads {n}, "
            f"{sizes}. Each device needs whole kv heads (or, past {n} devices, an equal share of each kv head's "
            f"{g} queries) and an equal share of each of the rest. Allowed on these {devices} devices: {allowed}"
        )
    return tp


def split_sizes(config: ModelConfig, expert_parallel: bool) -> dict[str, int]:
    """What the MLPs split tp ways, by config.json's names: the experts themselves under expert
    parallelism, else an expert's ffn columns; a dense MLP's columns where some layer has one."""
    out = {}
    if config.is_moe:
        out = {"num_experts": config.num_experts} if expert_parallel else {
            "moe_intermediate_size": config.moe_intermediate_size}
    if len(config.sparse_layers) < config.num_layers:
        out["intermediate_size"] = config.intermediate_size
    return out


def check_split(config: ModelConfig, tp: int, expert_parallel: bool = False) -> bool:
    n, g = config.num_kv_heads, config.queries_per_kv
    heads = (n % tp == 0) if tp <= n else (tp % n == 0 and g % (tp // n) == 0)
    return heads and all(size % tp == 0 for size in split_sizes(config, expert_parallel).values())


def make_mesh(tp: int) -> Mesh:
    """The first tp devices (all processes' devices under jax.distributed) as a 1-D "tp" mesh."""
    return Mesh(np.array(jax.devices()[:tp]), (TP,))


def expert_device(mesh: Mesh, expert: int, num_experts: int):
    """The device that holds `expert` under expert parallelism: the mesh's i-th device holds
    experts [i E/N, (i + 1) E/N)."""
    return mesh.devices.flat[expert // (num_experts // mesh.size)]


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config one shard runs: its share of the heads (queries per kv head unchanged)."""
    return dataclasses.replace(config, num_heads=config.num_heads // tp, num_kv_heads=config.num_kv_heads // tp)


def named(mesh: Mesh | None, partition: P):
    return None if mesh is None else NamedSharding(mesh, partition)


def put(array, sharding):
    """A host or device array onto `sharding` (None: the default device). Host arrays go shard by
    shard, so no device (and, across hosts, no process) ever holds more than its own shards."""
    if sharding is None:
        return jax.device_put(array)
    if isinstance(array, np.ndarray):
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
    return jax.device_put(array, sharding)


def replicate(tree, mesh: Mesh | None):
    """Every array of `tree` whole on each device of the mesh (e.g. a small draft model, or a batch)."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda a: put(np.asarray(a) if not isinstance(a, jax.Array) else a, NamedSharding(mesh, P())), tree)
