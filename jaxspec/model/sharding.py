"""Tensor parallelism: one model over a 1-D device mesh (axis "tp"), Megatron style.

One table maps logical axes to the mesh axis; every weight names its logical axes once (the
checkpoint's in model.param_specs, the engine layout's in model.LAYER_AXES / TOP_AXES). q/k/v
and gate/up are split by kv heads and ffn columns, o and down by rows, so a layer needs two
all-reduces (after o and after down); embedding and head are split by vocabulary. The forward
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
# Logical axis -> mesh axis. Absent axes are replicated.
RULES = {"vocab": TP, "heads": TP, "kv_heads": TP, "ffn": TP}
CACHE_AXES = (None, None, "kv_heads", None)  # [b, s, n, k] per layer


def spec(axes: tuple, stacked: bool = False) -> P:
    """PartitionSpec of an array with these logical axes; stacked: a leading layer axis."""
    return P(*(((None,) if stacked else ()) + tuple(RULES.get(a) for a in axes)))


def split_axes(axes: tuple, config: ModelConfig, tp: int) -> tuple:
    """Logical axes as they split tp ways: the vocabulary stays whole where tp does not divide it
    (every Llama, Qwen and Mistral vocabulary splits 8 ways), and so do kv heads where tp does not
    divide them (past their count they are repeated first: kv_repeats)."""
    whole = {"vocab": config.vocab_size % tp != 0, "kv_heads": config.num_kv_heads % tp != 0}
    return tuple(None if whole.get(a) else a for a in axes)


def kv_repeats(config: ModelConfig, tp: int) -> int:
    """How many devices share each kv head: 1 while tp <= kv heads; past that each kv head is
    repeated tp / kv heads times, each copy with its share of the head's queries (as vLLM and
    SGLang do), which is the same model with more, smaller kv groups (see serving_config)."""
    return max(1, tp // config.num_kv_heads)


def serving_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config the engine runs at tensor parallel tp: kv heads repeated (kv_repeats)."""
    return dataclasses.replace(config, num_kv_heads=config.num_kv_heads * kv_repeats(config, tp))


def check_tensor_parallel(config: ModelConfig, tp, name: str = "model") -> int:
    """tp as an int, or InputError naming the sizes that cannot be split tp ways."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise InputError(f"tensor_parallel must be an integer >= 1; got {tp!r}")
    devices = jax.device_count()
    if tp > devices:
        raise InputError(
            f"tensor_parallel {tp} needs {tp} devices; {devices} are visible ({jax.devices()[0].platform}). "
            "On the CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N."
        )
    n, g, f = config.num_kv_heads, config.queries_per_kv, config.ffn_size
    if not check_split(config, tp):
        allowed = [d for d in range(1, devices + 1) if check_split(config, d)]
        raise InputError(
            f"tensor_parallel {tp} cannot split {name}: num_heads {config.num_heads}, num_kv_heads {n}, "
            f"{'moe_' if config.is_moe else ''}intermediate_size {f}. Each device needs whole kv heads (or, past "
            f"{n} devices, an equal share of each kv head's {g} queries) and an equal ffn slice. Allowed on these {devices} devices: {allowed}"
        )
    return tp


def check_split(config: ModelConfig, tp: int) -> bool:
    n, g = config.num_kv_heads, config.queries_per_kv
    heads = (n % tp == 0) if tp <= n else (tp % n == 0 and g % (tp // n) == 0)
    return heads and config.ffn_size % tp == 0


def make_mesh(tp: int) -> Mesh:
    """The first tp devices (all processes' devices under jax.distributed) as a 1-D "tp" mesh."""
    return Mesh(np.array(jax.devices()[:tp]), (TP,))


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
