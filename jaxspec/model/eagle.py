"""EAGLE-3 draft heads: one decoder layer that reads the target's own hidden states.

The published layout (what SGLang and vLLM load): config.json with "architectures":
["LlamaForCausalLMEagle3"], a Llama config of one layer (its vocab_size the target's),
draft_vocab_size, optional target_hidden_size; weights fc.weight [d, 3 * target hidden],
midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight,
midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v read 2d: the normed token embedding beside the
normed hidden state), midlayer.mlp.{gate,up,down}_proj.weight, norm.weight, lm_head.weight
[draft vocab, d], d2t (draft id -> target id - draft id) and t2d; embed_tokens.weight is
optional (else the target's). A "model." prefix on the names is accepted.

The head at position i reads the pair (hidden h_i, token x_{i+1}) and predicts x_{i+2}:
h_i is fc(the target's residual stream entering its feature layers at token x_i), or, for
tokens the target has not run yet, the head's own output at i - 1. Its output (before the final
norm) is that next hidden state; its logits are over the draft vocabulary, which d2t maps into
the target's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.errors import CheckpointError, ConfigError, InputError
from jaxspec.model import layout
from jaxspec.model.cache import KVCache
from jaxspec.model.config import ModelConfig, config_from_hf, read_config_json
from jaxspec.model.forward import attention_mask, gated_mlp, rms_norm, self_attention
from jaxspec.model.rope import inverse_frequencies
from jaxspec.model.safetensors_files import FP8_E4M3, open_all, read_tensor
from jaxspec.model.weights import LayerWeights, fuse_layer

ARCHITECTURES = ("LlamaForCausalLMEagle3",)
FEATURES = 3  # low, middle and high layers of the target


def is_eagle3(folder: str | Path) -> bool:
    """Whether a folder's config.json names an EAGLE-3 head (ConfigError if it is corrupt)."""
    if not (Path(folder) / "config.json").is_file():
        return False
    return bool(set(read_config_json(folder).get("architectures") or ()) & set(ARCHITECTURES))


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice where the config names none (SGLang, vLLM): the inputs of layers 2, L / 2
    and L - 3 of the target (clamped into a shallow target's range).

    Feature layers here are forward's `features_at`: i is the input of layer i, L the last
    layer's output. The config's `eagle_aux_hidden_state_layer_ids` name the layers whose
    *outputs* are read (k here is k + 1), as SGLang and SpecForge read them."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    layer: ModelConfig  # the head's decoder layer as a one-layer model (vocab_size: the target's)
    target_hidden_size: int
    draft_vocab_size: int
    feature_layers: tuple[int, ...] | None = None  # features_at indices; None: default_feature_layers

    def layers_for(self, target: ModelConfig) -> tuple[int, ...]:
        return self.feature_layers or default_feature_layers(target.num_layers)


@struct.dataclass
class EagleWeights:
    fc: jnp.ndarray  # [3 * target hidden, d]
    embed_norm: jnp.ndarray  # [d] input_layernorm: on the token's embedding
    layer: LayerWeights  # attn_norm is hidden_norm (on the hidden state); q/k/v read [2d]
    final_norm: jnp.ndarray  # [d]
    lm_head: jnp.ndarray  # [d, draft vocab]
    d2t: jnp.ndarray  # [draft vocab] int32: the target's id of each draft token
    embed: jnp.ndarray | None = None  # [V, d]; None: the target's


@dataclasses.dataclass(eq=False)
class EagleHead:
    """What jaxspec.load returns for an EAGLE-3 folder: pass it as the draft."""

    config: EagleConfig
    weights: EagleWeights
    name: str
    path: Path
    dtype: jnp.dtype
    mesh: object = None  # the mesh of a split target it runs beside, whole on each device (replicated_on)

    def check_target(self, target: ModelConfig, target_name: str = "target") -> None:
        """Raises InputError, naming both, when this head cannot draft for `target`."""
        c = self.config
        fc_in = self.weights.fc.shape[0]
        if fc_in != FEATURES * target.hidden_size:
            raise InputError(f"EAGLE-3 head {self.name}: fc.weight reads {fc_in} features = {FEATURES} x "
                             f"{fc_in / FEATURES:g}, but {target_name}'s hidden size is {target.hidden_size}")
        if c.layer.vocab_size != target.vocab_size:
            raise InputError(f"EAGLE-3 head {self.name}: vocab_size {c.layer.vocab_size} differs from "
                             f"{target_name}'s {target.vocab_size}")
        if self.weights.embed is None and c.layer.hidden_size != target.hidden_size:
            raise InputError(f"EAGLE-3 head {self.name} has no embed_tokens and its hidden size "
                             f"{c.layer.hidden_size} differs from {target_name}'s {target.hidden_size}")
        for i in c.layers_for(target):
            if not 0 <= i <= target.num_layers:
                raise InputError(f"EAGLE-3 head {self.name}: eagle_aux_hidden_state_layer_ids reads the output "
                                 f"of layer {i - 1}, outside {target_name}'s {target.num_layers} layers")


def eagle_config(cfg: dict) -> EagleConfig:
    """EagleConfig from an EAGLE-3 config.json dict."""
    layer_cfg = {"model_type": "llama", **cfg, "num_hidden_layers": 1}
    layer = config_from_hf(layer_cfg)
    try:
        draft_vocab = int(cfg.get("draft_vocab_size") or layer.vocab_size)
        target_hidden = int(cfg.get("target_hidden_size") or layer.hidden_size)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"EAGLE-3 config: draft_vocab_size / target_hidden_size must be integers ({e})") from e
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids is not None and (len(ids) != FEATURES or not all(isinstance(i, int) and i >= 0 for i in ids)):
        raise ConfigError(f"EAGLE-3 config: eagle_aux_hidden_state_layer_ids must be {FEATURES} layer numbers "
                          f">= 0; got {ids}")
    return EagleConfig(layer, target_hidden, draft_vocab, tuple(i + 1 for i in ids) if ids else None)


def _read_tensors(folder: Path) -> dict[str, np.ndarray]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files (an EAGLE-3 head's weights)")
    out = {}
    for name, (path, handle) in open_all(files, "numpy").items():
        if handle.get_slice(name).get_dtype() == FP8_E4M3:  # read_tensor would give its bits, not values
            raise CheckpointError(f"tensor {name} in {path} is fp8: an EAGLE-3 head's weights are floating point")
        out[name.removeprefix("model.")] = read_tensor(name, path, handle)
    return out


def load_eagle(folder: str | Path, dtype) -> EagleHead:
    """An EAGLE-3 head from a folder in the published layout (module docstring), in `dtype`."""
    folder = Path(folder)
    config = eagle_config(read_config_json(folder))
    c = config.layer
    d, nh, nkv, hd, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    t = _read_tensors(folder)
    expected = {
        "fc.weight": (d, FEATURES * config.target_hidden_size),
        "midlayer.input_layernorm.weight": (d,), "midlayer.hidden_norm.weight": (d,),
        "midlayer.post_attention_layernorm.weight": (d,),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * d), "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * d), "midlayer.self_attn.o_proj.weight": (d, nh * hd),
        "midlayer.mlp.gate_proj.weight": (f, d), "midlayer.mlp.up_proj.weight": (f, d),
        "midlayer.mlp.down_proj.weight": (d, f), "norm.weight": (d,),
        "lm_head.weight": (config.draft_vocab_size, d), "d2t": (config.draft_vocab_size,),
    }
    for name, shape in expected.items():
        if name not in t:
            raise CheckpointError(f"{folder}: EAGLE-3 tensor {name} is missing")
        if name != "fc.weight" and tuple(t[name].shape) != shape:
            raise CheckpointError(f"{folder}: {name} has shape {list(t[name].shape)}; the config says {list(shape)}")
    fc = t["fc.weight"]
    if fc.ndim != 2 or fc.shape[0] != d or fc.shape[1] % FEATURES:
        raise CheckpointError(f"{folder}: fc.weight has shape {list(fc.shape)}; expected [{d}, {FEATURES} x target hidden]")
    as_dtype = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    fields = {
        "attn_norm": t["midlayer.hidden_norm.weight"], "mlp_norm": t["midlayer.post_attention_layernorm.weight"],
        "wq": t["midlayer.self_attn.q_proj.weight"].T.reshape(2 * d, nh, hd),
        "wk": t["midlayer.self_attn.k_proj.weight"].T.reshape(2 * d, nkv, hd),
        "wv": t["midlayer.self_attn.v_proj.weight"].T.reshape(2 * d, nkv, hd),
        "wo": t["midlayer.self_attn.o_proj.weight"].T.reshape(nh, hd, d),
        "w_gate": t["midlayer.mlp.gate_proj.weight"].T, "w_up": t["midlayer.mlp.up_proj.weight"].T,
        "w_down": t["midlayer.mlp.down_proj.weight"].T,
    }
    layer = LayerWeights(**fuse_layer(c, {k: as_dtype(v) for k, v in fields.items()}, layout.fuse_mlp()))
    d2t = np.arange(config.draft_vocab_size) + t["d2t"].astype(np.int64)
    if d2t.min() < 0 or d2t.max() >= c.vocab_size:
        raise CheckpointError(f"{folder}: d2t maps draft ids outside the target vocabulary [0, {c.vocab_size})")
    embed = t.get("embed_tokens.weight")
    weights = EagleWeights(
        fc=as_dtype(fc.T), embed_norm=as_dtype(t["midlayer.input_layernorm.weight"]), layer=layer,
        final_norm=as_dtype(t["norm.weight"]), lm_head=as_dtype(t["lm_head.weight"].T),
        d2t=jnp.asarray(d2t, jnp.int32), embed=None if embed is None else as_dtype(embed))
    return EagleHead(config, weights, folder.name, folder, jnp.dtype(dtype))


def convert_eagle(folder: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """An EAGLE-3 folder, checked as a load checks it, written to `out` in the same published
    layout (one safetensors file without the "model." prefix, the config as it was), its float
    tensors cast to `dtype` (None keeps theirs): the head is one layer, so an Orbax checkpoint
    would buy no load time."""
    from safetensors.numpy import save_file

    folder, out = Path(folder), Path(out)
    load_eagle(folder, jnp.float32)  # every check a load makes, before anything is written
    floats = lambda a: dtype is not None and jnp.issubdtype(a.dtype, jnp.floating)  # noqa: E731  (bfloat16 too)
    tensors = {k: np.ascontiguousarray(v.astype(jnp.dtype(dtype)) if floats(v) else v)
               for k, v in _read_tensors(folder).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = read_config_json(folder)
    if dtype is not None:
        config["torch_dtype"] = str(jnp.dtype(dtype))
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def head_cache(config: EagleConfig, batch: int, capacity: int, dtype) -> KVCache:
    """The head's own KV cache: one layer, per-layer layout on every backend."""
    return KVCache.create(config.layer, batch, capacity, dtype, stacked=False)


def head_forward(w: EagleWeights, config: EagleConfig, embed_table, tokens, hidden, cache: KVCache,
                 positions=None, logits_at=None, chunk_mask=None):
    """tokens [b, t] (target ids) and hidden [b, t, d] (fc'd target features, or the head's own
    outputs) -> (draft-vocabulary logits [b, t, V_d] float32, or [b, m, V_d] at logits_at [b, m];
    the head's output hidden states [b, t, d]; cache with the t new keys and values written in
    slots lengths + arange(t), at `positions` (default those slots), each seeing the cache before
    it and the chunk's tokens chunk_mask [t, t] allows (default causal: a tree's ancestors)).
    The cache's lengths are not advanced."""
    c = config.layer
    b, t = tokens.shape
    if positions is None:
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    causal = jnp.tril(jnp.ones((t, t), bool)) if chunk_mask is None else chunk_mask
    mask = attention_mask(cache.lengths, positions, cache.capacity, causal, None)
    table = embed_table if w.embed is None else w.embed
    e = table[tokens].astype(hidden.dtype)
    h = jnp.concatenate([rms_norm(e, w.embed_norm, c.rms_norm_eps), rms_norm(hidden, w.layer.attn_norm, c.rms_norm_eps)],
                        axis=-1)
    inv_freq = inverse_frequencies(c.rope, c.head_dim)
    attn, k, v = self_attention(c, inv_freq, mask, positions, causal, "xla", False, None, cache.lengths, w.layer, h,
                                cache.k[0], cache.v[0])
    x = hidden + attn
    x = x + gated_mlp(w.layer, rms_norm(x, w.layer.mlp_norm, c.rms_norm_eps), False, None)
    sel = x if logits_at is None else jnp.take_along_axis(x, logits_at[:, :, None], axis=1)
    logits = jnp.einsum("btd,dv->btv", rms_norm(sel, w.final_norm, c.rms_norm_eps), w.lm_head,
                        preferred_element_type=jnp.float32)
    return logits, x, cache.replace(k=(k,), v=(v,))


def fuse_features(w: EagleWeights, features: jnp.ndarray) -> jnp.ndarray:
    """The target's [..., 3 * target hidden] features -> the head's hidden [..., d]."""
    return jnp.einsum("btf,fd->btd", features.astype(w.fc.dtype), w.fc)


def save_eagle_folder(folder: str | Path, target: ModelConfig, tensors: dict[str, np.ndarray],
                      feature_layers: tuple[int, ...] | None = None, dtype: str = "float32") -> Path:
    """Writes an EAGLE-3 head for `target` in the published layout: `tensors` under their
    published names (torch's [out, in] orientation; d2t, t2d) and the config.json SGLang and vLLM
    read, its sizes taken from the tensors."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    d = tensors["norm.weight"].shape[0]
    f = tensors["midlayer.mlp.down_proj.weight"].shape[1]
    hd = target.head_dim
    # safetensors' numpy writer takes each buffer as laid out: a transposed view came back wrong
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = {
        "architectures": list(ARCHITECTURES), "model_type": "llama", "hidden_size": d, "intermediate_size": f,
        "num_attention_heads": tensors["midlayer.self_attn.q_proj.weight"].shape[0] // hd,
        "num_key_value_heads": tensors["midlayer.self_attn.k_proj.weight"].shape[0] // hd, "head_dim": hd,
        "num_hidden_layers": 1, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope.theta,
        "vocab_size": target.vocab_size, "draft_vocab_size": tensors["lm_head.weight"].shape[0],
        "target_hidden_size": target.hidden_size, "max_position_embeddings": target.max_position_embeddings,
        "hidden_act": "silu", "torch_dtype": dtype,
    }
    if feature_layers is not None:  # features_at indices; the config names the layers before them
        if min(feature_layers) < 1:
            raise InputError(f"feature layers {feature_layers}: the embedding (0) has no layer id to publish")
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in feature_layers]}
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return folder


def draft_vocab_tensors(draft_ids: np.ndarray, vocab_size: int) -> dict[str, np.ndarray]:
    """d2t (draft id -> target id - draft id) and t2d (target ids the draft vocabulary holds)."""
    draft_ids = np.sort(np.asarray(draft_ids))
    t2d = np.zeros(vocab_size, bool)
    t2d[draft_ids] = True
    return {"d2t": (draft_ids - np.arange(len(draft_ids))).astype(np.int64), "t2d": t2d}


def random_eagle_folder(folder: str | Path, target: ModelConfig, draft_vocab_size: int | None = None,
                        seed: int = 0, fc_width: int | None = None, intermediate_size: int | None = None) -> Path:
    """Writes an EAGLE-3 head of random weights for `target` in the published layout (tests, and
    benchmarks at real shapes); fc_width overrides fc's input width (to test the refusal)."""
    d, V = target.hidden_size, target.vocab_size
    Vd = draft_vocab_size or V
    nh, nkv, hd = target.num_heads, target.num_kv_heads, target.head_dim
    f = intermediate_size or target.intermediate_size
    rng = np.random.default_rng(seed)
    dense = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)  # noqa: E731
    ones = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    tensors = {
        "fc.weight": dense(d, fc_width or FEATURES * d),
        "midlayer.input_layernorm.weight": ones(d), "midlayer.hidden_norm.weight": ones(d),
        "midlayer.post_attention_layernorm.weight": ones(d),
        "midlayer.self_attn.q_proj.weight": dense(nh * hd, 2 * d), "midlayer.self_attn.k_proj.weight": dense(nkv * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": dense(nkv * hd, 2 * d), "midlayer.self_attn.o_proj.weight": dense(d, nh * hd),
        "midlayer.mlp.gate_proj.weight": dense(f, d), "midlayer.mlp.up_proj.weight": dense(f, d),
        "midlayer.mlp.down_proj.weight": dense(d, f), "norm.weight": ones(d), "lm_head.weight": dense(Vd, d),
        **draft_vocab_tensors(rng.choice(V, Vd, replace=False) if Vd < V else np.arange(V), V),
    }
    return save_eagle_folder(folder, target, tensors)
