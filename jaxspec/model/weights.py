"""The weights pytree (Weights, LayerWeights), the table of parameters (ParamSpec: declared once
for conversion, validation and random init), and building the engine layout from checkpoint
fields: q/k/v and gate/up fused, kv heads repeated for tensor parallelism, split over a mesh."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from jaxspec.model import layout
from jaxspec.model.config import ModelConfig
from jaxspec.model.families.registry import FAMILIES
from jaxspec.model.quantize import (
    CONTRACTED,
    LEAD,
    SCALE,
    Quantized,
    as_quantized,
    check_scheme,
    checkpoint_contracted,
    quantize,
    quantize_layer,
)
from jaxspec.model.sharding import (
    expert_device,
    kv_repeats,
    named,
    put,
    serving_config,
    spec,
    split_axes,
)


@struct.dataclass
class LayerWeights:
    """One decoder layer's weights, q/k/v and gate/up fused (one matmul each instead of three and
    two: fewer, larger weight reads per decode step). Optional fields are None when absent.

    The fused q/k/v axis is laid out per kv head (its g query heads, then its key, then its
    value), so splitting axis n over devices splits q, k and v consistently."""

    attn_norm: jnp.ndarray  # [d]
    wqkv: jnp.ndarray  # [d, n, g + 2, k]
    wo: jnp.ndarray  # [h, k, d]
    mlp_norm: jnp.ndarray  # [d]
    w_gate_up: jnp.ndarray | tuple | None = None  # [d, 2, f] (gate, up) fused; ([d, f], [d, f]) on the CPU:
    # see fuse_mlp; None in a mixture-of-experts layer
    w_down: jnp.ndarray | None = None  # [f, d]
    bqkv: jnp.ndarray | None = None  # [n, g + 2, k]
    bo: jnp.ndarray | None = None  # [d]
    q_norm: jnp.ndarray | None = None  # [k]
    k_norm: jnp.ndarray | None = None  # [k]
    b_gate_up: jnp.ndarray | tuple | None = None  # [2, f], or ([f], [f]) as w_gate_up
    b_down: jnp.ndarray | None = None  # [d]
    router: jnp.ndarray | None = None  # [d, E] a mixture-of-experts layer's router
    experts_gate_up: jnp.ndarray | None = None  # [E, d, 2, f'] each expert's gate and up, fused
    experts_down: jnp.ndarray | None = None  # [E, f', d]


@struct.dataclass
class Weights:
    """On accelerators the layers are a tuple of separate arrays, run unrolled: XLA on GPUs copies
    a stacked array's layer slice before each matmul (cuBLAS wants its own buffer), which made an
    8B decode step read its weights about three times (11.5 ms against 4.3 ms per step on an
    H200). On the CPU they stay one LayerWeights stacked over a leading layer axis, run by a
    lax.scan: there the unrolled graph made a speculative round about 1.5x slower (see
    scan_layers)."""

    embed: jnp.ndarray  # [v, d]
    layers: tuple[LayerWeights, ...] | LayerWeights  # per layer, or stacked [L, ...] (scan_layers)
    final_norm: jnp.ndarray  # [d]
    lm_head: jnp.ndarray | None = None  # [d, v]; None when tied to embed
    # The "tp" mesh the arrays are split over (jaxspec.model.sharding); None: whole on each device.
    mesh: Mesh | None = struct.field(pytree_node=False, default=None)
    # A mixture of experts split over mesh by expert (E/N whole experts a device), not by each
    # expert's ffn columns (sharding.EXPERT_WHOLE).
    expert_parallel: bool = struct.field(pytree_node=False, default=False)


# Logical axes of the engine-layout arrays (jaxspec.model.sharding maps them to the mesh); the split
# gate/up of the CPU layout (fuse_mlp) drops the fused pair's axis.
LAYER_AXES = {
    "attn_norm": (None,), "wqkv": (None, "kv_heads", None, None), "wo": ("heads", None, None),
    "mlp_norm": (None,), "w_gate_up": (None, None, "ffn"), "w_down": ("ffn", None),
    "bqkv": ("kv_heads", None, None), "bo": (None,), "q_norm": (None,), "k_norm": (None,),
    "b_gate_up": (None, "ffn"), "b_down": (None,),
    "router": (None, None), "experts_gate_up": ("experts", None, None, "expert_ffn"),
    "experts_down": ("experts", "expert_ffn", None),
}
SPLIT_MLP_AXES = {"w_gate_up": (None, "ffn"), "b_gate_up": ("ffn",)}
TOP_AXES = {"embed": ("vocab", None), "final_norm": (None,), "lm_head": (None, "vocab")}


def weight_specs(weights: Weights, config: ModelConfig) -> Weights:
    """A PartitionSpec for every array of `weights` (a Weights of specs, for shard_map), split over
    weights.mesh."""
    stacked = not isinstance(weights.layers, tuple)
    tp = 1 if weights.mesh is None else weights.mesh.size
    split = lambda axes: split_axes(axes, config, tp, weights.expert_parallel)  # noqa: E731

    def spec_of(value, axes, stacked: bool):
        if isinstance(value, Quantized):  # values channels first; the scales keep the output axes
            lead, contracted, out_axes = value.lead, value.contract, axes[value.lead + value.contract :]
            return value.replace(values=spec(split(axes[:lead] + out_axes + axes[lead : lead + contracted]), stacked),
                                 scale=spec(split(axes[:lead] + out_axes), stacked))
        return spec(split(axes), stacked)

    def layer_specs(layer: LayerWeights) -> LayerWeights:
        out = {}
        for f in dataclasses.fields(LayerWeights):
            value = getattr(layer, f.name)
            if isinstance(value, tuple):
                out[f.name] = tuple(spec_of(v, SPLIT_MLP_AXES[f.name], stacked) for v in value)
            elif value is not None:
                out[f.name] = spec_of(value, LAYER_AXES[f.name], stacked)
        return LayerWeights(**out)

    top = {name: spec_of(getattr(weights, name), axes, False) for name, axes in TOP_AXES.items()
           if getattr(weights, name) is not None}
    layers = layer_specs(weights.layers) if stacked else tuple(map(layer_specs, weights.layers))
    return Weights(layers=layers, mesh=weights.mesh, expert_parallel=weights.expert_parallel, **top)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One weight, declared once for conversion, validation and random init."""

    field: str  # "embed" or "layers.wq": where it lives in Weights
    hf_name: str  # HF tensor name; "{i}" stands for the layer index
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]  # engine shape (per layer for layers.*)
    transpose: bool  # HF stores [out, in]; we keep [in, out]
    axes: tuple = ()  # logical axes of `shape` (jaxspec.model.sharding); () replicated
    expert: int | None = None  # the expert it is one tensor of: under expert parallelism it lives whole on
    # that expert's device (sharding.expert_device)
    layers: tuple[int, ...] | None = None  # the layers that hold it, its stack's rows in order; None: all

    @property
    def per_layer(self) -> bool:
        return self.field.startswith("layers.")

    def held_by(self, num_layers: int) -> tuple[int, ...]:
        """The layers whose weights it holds (a per-layer field is stacked over these)."""
        return tuple(range(num_layers)) if self.layers is None else self.layers


def param_specs(c: ModelConfig) -> list[ParamSpec]:
    d, f, v, h, n, k = (
        c.hidden_size, c.intermediate_size, c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim,
    )
    p = "model.layers.{i}."
    specs = [
        ParamSpec("embed", "model.embed_tokens.weight", (v, d), (v, d), False, ("vocab", None)),
        ParamSpec("final_norm", "model.norm.weight", (d,), (d,), False),
        ParamSpec("layers.attn_norm", p + "input_layernorm.weight", (d,), (d,), False),
        ParamSpec("layers.wq", p + "self_attn.q_proj.weight", (h * k, d), (d, h, k), True, (None, "heads", None)),
        ParamSpec("layers.wk", p + "self_attn.k_proj.weight", (n * k, d), (d, n, k), True, (None, "kv_heads", None)),
        ParamSpec("layers.wv", p + "self_attn.v_proj.weight", (n * k, d), (d, n, k), True, (None, "kv_heads", None)),
        ParamSpec("layers.wo", p + "self_attn.o_proj.weight", (d, h * k), (h, k, d), True, ("heads", None, None)),
        ParamSpec("layers.mlp_norm", p + "post_attention_layernorm.weight", (d,), (d,), False),
    ]
    # the layers with a dense MLP: all of a dense model's (None), a mixture of experts' dense_layers;
    # a field of some layers only is stacked over those
    dense = None if not c.is_moe else c.dense_layers
    specs += expert_specs(c, p) if c.is_moe else []
    specs += [
        ParamSpec("layers.w_gate", p + "mlp.gate_proj.weight", (f, d), (d, f), True, (None, "ffn"), layers=dense),
        ParamSpec("layers.w_up", p + "mlp.up_proj.weight", (f, d), (d, f), True, (None, "ffn"), layers=dense),
        ParamSpec("layers.w_down", p + "mlp.down_proj.weight", (d, f), (f, d), True, ("ffn", None), layers=dense),
    ] if dense != () else []
    if not c.tie_word_embeddings:
        specs.append(ParamSpec("lm_head", "lm_head.weight", (v, d), (d, v), True, (None, "vocab")))
    if c.qkv_bias:
        specs += [
            ParamSpec("layers.bq", p + "self_attn.q_proj.bias", (h * k,), (h, k), False, ("heads", None)),
            ParamSpec("layers.bk", p + "self_attn.k_proj.bias", (n * k,), (n, k), False, ("kv_heads", None)),
            ParamSpec("layers.bv", p + "self_attn.v_proj.bias", (n * k,), (n, k), False, ("kv_heads", None)),
        ]
    if c.o_bias:
        specs.append(ParamSpec("layers.bo", p + "self_attn.o_proj.bias", (d,), (d,), False))
    if c.qk_norm:
        specs += [
            ParamSpec("layers.q_norm", p + "self_attn.q_norm.weight", (k,), (k,), False),
            ParamSpec("layers.k_norm", p + "self_attn.k_norm.weight", (k,), (k,), False),
        ]
    if c.mlp_bias and dense != ():
        specs += [
            ParamSpec("layers.b_gate", p + "mlp.gate_proj.bias", (f,), (f,), False, ("ffn",), layers=dense),
            ParamSpec("layers.b_up", p + "mlp.up_proj.bias", (f,), (f,), False, ("ffn",), layers=dense),
            ParamSpec("layers.b_down", p + "mlp.down_proj.bias", (d,), (d,), False, layers=dense),
        ]
    return specs


def expert_specs(c: ModelConfig, p: str) -> list[ParamSpec]:
    """A mixture-of-experts layer's router and each expert's gate, up and down, as the hub stores
    them, under its family's names (Family.expert_names): one tensor per expert, fields e_gate{j},
    e_up{j}, e_down{j}, stacked by fuse_layer."""
    d, f, e = c.hidden_size, c.moe_intermediate_size, c.num_experts
    block, router, gate, up, down = FAMILIES[c.model_type].expert_names
    held = c.sparse_layers if c.dense_layers else None
    specs = [ParamSpec("layers.router", p + f"{block}.{router}.weight", (e, d), (d, e), True, layers=held)]
    for j in range(e):
        x = p + f"{block}.experts.{j}."
        specs += [
            ParamSpec(f"layers.e_gate{j}", x + f"{gate}.weight", (f, d), (d, f), True, (None, "expert_ffn"), j, held),
            ParamSpec(f"layers.e_up{j}", x + f"{up}.weight", (f, d), (d, f), True, (None, "expert_ffn"), j, held),
            ParamSpec(f"layers.e_down{j}", x + f"{down}.weight", (d, f), (f, d), True, ("expert_ffn", None), j, held),
        ]
    return specs


def arrange_layers(config: ModelConfig, layers: tuple[LayerWeights, ...]) -> tuple[LayerWeights, ...] | LayerWeights:
    """Per-layer weights as a model of `config` runs them: kept apart, or stacked (layout.stack_layers)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers) if layout.stack_layers(config) else layers


def fuse_layer(c: ModelConfig, f: dict, mlp: bool) -> dict:
    """One layer's fields as param_specs names them ("wq", "bk", ...) -> LayerWeights fields;
    mlp: fuse gate and up too (see fuse_mlp). Host or (sharded) device arrays in, device arrays
    out: split by kv heads, q/k/v stay split the same way. Fields may come a group at a time
    (FUSED_GROUPS)."""
    n, g, k = c.num_kv_heads, c.queries_per_kv, c.head_dim
    out = {name: f[name] for name in ("attn_norm", "wo", "mlp_norm", "w_down", "bo", "q_norm", "k_norm", "b_down",
                                      "router") if name in f}
    experts = sorted(int(name[len("e_gate"):]) for name in f if name.startswith("e_gate"))  # all, or one device's
    if experts:
        out["experts_gate_up"] = jnp.stack([jnp.stack([f[f"e_gate{j}"], f[f"e_up{j}"]], axis=1) for j in experts])
        out["experts_down"] = jnp.stack([f[f"e_down{j}"] for j in experts])
    if "wq" in f:
        out["wqkv"] = jnp.concatenate(
            [f["wq"].reshape(-1, n, g, k), f["wk"][:, :, None], f["wv"][:, :, None]], axis=2)
    if "w_gate" in f:
        out["w_gate_up"] = jnp.stack([f["w_gate"], f["w_up"]], axis=1) if mlp else (f["w_gate"], f["w_up"])
    if "bq" in f:
        out["bqkv"] = jnp.concatenate([f["bq"].reshape(n, g, k), f["bk"][:, None], f["bv"][:, None]], axis=1)
    if "b_gate" in f:
        out["b_gate_up"] = jnp.stack([f["b_gate"], f["b_up"]]) if mlp else (f["b_gate"], f["b_up"])
    return out


def field_shardings(config: ModelConfig, mesh: Mesh | None, quantized=(), expert_parallel: bool = False) -> dict:
    """field -> where a checkpoint-layout array goes (None: the default device); for the 8-bit
    `quantized` fields also their scales (name + SCALE), split as the output axes they keep.
    expert_parallel: each expert's fields whole on its device (the checkpoint stores one tensor
    per expert), so each device reads its own experts only."""
    tp = 1 if mesh is None else mesh.size
    out = {}
    for p in param_specs(config):
        axes = p.axes or (None,) * len(p.shape)
        owner = expert_sharding(p, config, mesh, expert_parallel)  # (an expert's scales go with it)
        out[p.field] = owner or named(mesh, spec(split_axes(axes, config, tp, expert_parallel), p.per_layer))
        contract = checkpoint_contracted(p.field) if p.field in quantized else None
        if contract:
            out[p.field + SCALE] = owner or named(
                mesh, spec(split_axes(axes[contract:], config, tp, expert_parallel), p.per_layer))
    return out


def expert_sharding(p: ParamSpec, config: ModelConfig, mesh: Mesh | None, expert_parallel: bool):
    """Where one expert's tensor goes under expert parallelism: whole, on its expert's device;
    None for every other tensor (and without expert parallelism)."""
    if not expert_parallel or mesh is None or p.expert is None:
        return None
    return jax.sharding.SingleDeviceSharding(expert_device(mesh, p.expert, config.num_experts))


def join_experts(fuse, fields: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """fuse (a fuse_layer graph) run on each device's experts: `fields` are expert tensors each
    whole on its expert's device (expert_sharding); their fused arrays ([E/N, ...] each, on that
    device) become arrays split by expert over `mesh` as the engine layout splits them. No
    device sends another any expert."""
    parts: dict = {}
    for name, a in fields.items():
        parts.setdefault(next(iter(a.devices())), {})[name] = a
    outs = [fuse(part) for part in parts.values()]

    by_expert = named(mesh, spec(("experts",)))  # the expert axis leads every expert array (8-bit: values and scales)

    def join(*local):
        return jax.make_array_from_single_device_arrays((config.num_experts, *local[0].shape[1:]), by_expert,
                                                        list(local))
    return {name: jax.tree.map(join, *[out[name] for out in outs]) for name in outs[0]}


def place(weights: Weights, config: ModelConfig, mesh: Mesh | None) -> Weights:
    """Weights with every array on its shards of `mesh` (a no-op where already there), and the
    mesh recorded when it splits them (more than one device). config: the one they run with
    (serving_config: kv heads already repeated)."""
    if mesh is None:
        return weights
    weights = weights.replace(mesh=mesh if mesh.size > 1 else None)
    specs = weight_specs(weights, config)
    return jax.tree.map(lambda a, p: put(a, named(mesh, p)), weights, specs)


def repeat_kv_heads(a, r: int):
    """Fused q/k/v [..., n, g + 2, k] -> [..., n * r, g / r + 2, k]: each kv head r times, each
    copy with the next g / r of its queries (the order of wo's heads is unchanged)."""
    if r == 1:
        return a
    *lead, n, j, k = a.shape
    g = j - 2
    q = a[..., :g, :].reshape(*lead, n, r, g // r, k)
    kv = jnp.broadcast_to(a[..., None, g:, :], (*lead, n, r, 2, k))
    return jnp.concatenate([q, kv], axis=-2).reshape(*lead, n * r, g // r + 2, k)


def _repeat_kv(w, r: int):
    """repeat_kv_heads of a fused q/k/v weight or bias; an 8-bit one's scales alike and its
    channels-first values [n, j, k, d] with the model axis moved out of the way."""
    if not isinstance(w, Quantized):
        return repeat_kv_heads(w, r)
    values = jnp.moveaxis(repeat_kv_heads(jnp.moveaxis(w.values, -1, 0), r), 0, -1)
    return w.replace(values=values, scale=repeat_kv_heads(w.scale, r))


FUSED_GROUPS = (("wq", "wk", "wv", "bq", "bk", "bv"), ("w_gate", "w_up", "b_gate", "b_up"))


def weights_from_fields(config: ModelConfig, fields: dict, dtype, mesh: Mesh | None = None,
                        quantize: str | None = None, expert_parallel: bool = False) -> Weights:
    """{"embed": ..., "layers.wq": [L, ...], ...} (checkpoint layout, layers stacked: each field over
    the layers that hold it, ParamSpec.held_by; host arrays,
    or device arrays already on their shards) -> Weights in `dtype`, split over `mesh` (None: on
    the default device; the weights then run with serving_config(config, mesh.size)). Each device
    only ever receives its own shards.

    Consumes `fields`: each stacked field is dropped once its layers are cut from it, a fused
    group at a time, so a device holds at most its weights plus one group (gate and up of a 70B
    split two ways: 38 GB beside its 70 GB). quantize: the checkpoint stores its projections in
    8 bits, with their scales (jaxspec.model.quantize); they stay so. expert_parallel: a mixture
    of experts split by expert (each expert's fields on its device: field_shardings)."""
    shardings = field_shardings(config, mesh, [name for name in fields if name + SCALE in fields], expert_parallel)
    mlp = layout.fuse_mlp()
    take = lambda name: put(fields.pop(name), shardings[name])  # noqa: E731
    top = {}
    for name in [n for n in fields if not n.startswith("layers.") and not n.endswith(SCALE)]:
        top[name] = (as_quantized(take(name), take(name + SCALE), quantize, CONTRACTED[name]) if name + SCALE in fields
                     else take(name).astype(dtype))
    names = [name.split(".", 1)[1] for name in fields if not name.endswith(SCALE)]
    experts = tuple(n for n in names if n.startswith("e_"))  # an MoE layer's experts stack together
    fused = list(FUSED_GROUPS) + ([experts] if experts else [])
    groups = fused + [(n,) for n in names if not any(n in g for g in fused)]
    held = {p.field: p.held_by(config.num_layers) for p in param_specs(config) if p.per_layer}
    layers = [{} for _ in range(config.num_layers)]
    for group in groups:
        stacked = {n: take("layers." + n) for n in group if "layers." + n in fields}
        scales = {n: take("layers." + n + SCALE) for n in group if "layers." + n + SCALE in fields}
        by_device = expert_parallel and mesh is not None and group is experts  # each device its own experts
        for row, i in enumerate(held["layers." + next(iter(stacked))] if stacked else ()):  # (a group's fields alike)
            layer = layers[i]
            fuse = functools.partial(_layer_of, i=jnp.int32(row), config=config, dtype=jnp.dtype(dtype), mlp=mlp,
                                     quantize=quantize)
            if by_device:  # each device's experts with their scales (named apart by SCALE)
                both = stacked | {n + SCALE: a for n, a in scales.items()}
                layer |= join_experts(lambda part: fuse(*_values_and_scales(part)), both, config, mesh)
            else:
                layer |= fuse(stacked, scales)
        del stacked, scales  # frees the stacked arrays: the layers hold their own slices
    return assemble(config, top, layers, mesh, expert_parallel)


def _values_and_scales(fields: dict) -> tuple[dict, dict]:
    return ({n: a for n, a in fields.items() if not n.endswith(SCALE)},
            {n.removesuffix(SCALE): a for n, a in fields.items() if n.endswith(SCALE)})


@functools.partial(jax.jit, static_argnames=("config", "dtype", "mlp", "quantize"))
def _layer_of(stacked: dict, scales: dict, i, *, config: ModelConfig, dtype, mlp: bool, quantize: str | None) -> dict:
    """Layer i of stacked checkpoint fields, in `dtype` and fused: one graph for every layer of a
    group (one eager op per field and layer took 1.2 s for the 16M model on the CPU). Fields with
    `scales` stay 8-bit; their scales are fused alike, with the contracted axes as size-1 ones."""
    values = {n: a[i] if n in scales else a[i].astype(dtype) for n, a in stacked.items()}
    return fuse_quantized_layer(config, values, {n: s[i] for n, s in scales.items()}, mlp, quantize)


def fuse_quantized_layer(config: ModelConfig, fields: dict, scales: dict, mlp: bool, fmt: str | None) -> dict:
    """fuse_layer for a layer whose fields named in `scales` are 8-bit values (per-output-channel
    float32 scales, the checkpoint layout's output axes): those come out Quantized, their scales
    fused as the values are (with the contracted axes as size-1 ones)."""
    out = fuse_layer(config, fields, mlp)
    if not scales:
        return out
    contract = lambda n: checkpoint_contracted("layers." + n)  # noqa: E731
    fused = fuse_layer(config, {n: jnp.expand_dims(s, tuple(range(contract(n)))) for n, s in scales.items()}, mlp)
    return out | {name: as_quantized(out[name], s, fmt, CONTRACTED[name], scale_has_contracted_axes=True,
                                     lead=LEAD.get(name, 0))
                  for name, s in fused.items()}


def assemble(config: ModelConfig, top: dict, layers: list[dict], mesh: Mesh | None,
             expert_parallel: bool = False) -> Weights:
    """Weights from the top-level arrays and each layer's fused fields (fuse_layer's names), all
    in their dtype on their shards: kv heads repeated for the mesh, layers laid out for this
    backend (layout.scan_layers), the mesh (and whether the experts split by expert) recorded."""
    r = kv_repeats(config, 1 if mesh is None else mesh.size)
    for layer in layers:
        layer |= {name: _repeat_kv(layer[name], r) for name in ("wqkv", "bqkv") if name in layer}
    stacked = arrange_layers(config, tuple(LayerWeights(**layer) for layer in layers))
    weights = Weights(layers=stacked, expert_parallel=expert_parallel and mesh is not None, **top)
    return place(weights, serving_config(config, 1 if mesh is None else mesh.size), mesh)


def quantize_weights(weights: Weights, config: ModelConfig, fmt: str) -> Weights:
    """`weights` with their projections in 8 bits (jaxspec.model.quantize), converted on the
    devices a layer at a time (one compiled graph for all layers), each 8-bit array and scale on
    the shards its projection had. config: the one the weights run with (serving_config)."""
    check_scheme(fmt)
    if isinstance(weights.layers, tuple):
        layers = tuple(quantize_layer(layer, fmt, False) for layer in weights.layers)
    else:
        layers = quantize_layer(weights.layers, fmt, True)
    lm_head = None if weights.lm_head is None else quantize(weights.lm_head, 1, fmt)
    return place(weights.replace(layers=layers, lm_head=lm_head), config, weights.mesh)
