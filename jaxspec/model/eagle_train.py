"""Training an EAGLE-3 head for a loaded target (scripts/train_eagle.py is the command).

The recipe is EAGLE-3's: the target is frozen and runs each batch once, giving the features the
head reads (the residual stream entering its feature layers) and the distributions it learns
(the target's own next-token probabilities over the draft vocabulary); the head learns with a
"training-time test": S draft steps unrolled over every position at once, step s reading its own
step s - 1 outputs where drafting would, and attending as drafting would (to true-feature keys up
to where the chain started, and to its own earlier steps' keys on the diagonal). The loss is the
cross-entropy to the target's distribution, step s weighted 0.8^(s-1).

Parameters are plain arrays in the [in, out] orientation (`init_params`); `to_published` turns
them into the published layout that jaxspec.load reads back as an EagleHead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model.config import ModelConfig
from jaxspec.model.eagle import FEATURES, draft_vocab_tensors
from jaxspec.model.forward import forward, rms_norm
from jaxspec.model.cache import KVCache
from jaxspec.model.rope import apply_rope, inverse_frequencies, rope_tables

STEP_DECAY = 0.8


def draft_vocabulary(token_counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent target ids (sorted): the head's vocabulary."""
    size = min(size, len(token_counts))
    return np.sort(np.argsort(-token_counts, kind="stable")[:size])


def init_params(target, draft_ids: np.ndarray, intermediate_size: int, seed: int = 0) -> dict:
    """A fresh head at the target's width; its final norm and head start as the target's (over
    the draft vocabulary), everything else random."""
    c: ModelConfig = target.config
    d, nh, nkv, hd, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, intermediate_size
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
    dense = lambda i, o: jax.random.normal(next(keys), (i, o), jnp.float32) / np.sqrt(i)  # noqa: E731
    w = target.weights
    lm = w.embed.T if w.lm_head is None else w.lm_head
    return {
        "fc": dense(FEATURES * d, d), "embed_norm": jnp.ones(d), "hidden_norm": jnp.ones(d),
        "q": dense(2 * d, nh * hd), "k": dense(2 * d, nkv * hd), "v": dense(2 * d, nkv * hd), "o": dense(nh * hd, d) * 0.1,
        "mlp_norm": jnp.ones(d), "gate": dense(d, f), "up": dense(d, f), "down": dense(f, d) * 0.1,
        "norm": jnp.array(w.final_norm, jnp.float32, copy=True), "lm_head": jnp.array(lm[:, draft_ids], jnp.float32),
    }


def target_pass(target_weights, target_config: ModelConfig, tokens, layers: tuple[int, ...]):
    """The frozen target over tokens [b, T]: (its features [b, T, 3d] at `layers`, its
    log-probabilities [b, T, V])."""
    cache = KVCache.create(target_config, tokens.shape[0], tokens.shape[1], target_weights.embed.dtype,
                           stacked=not isinstance(target_weights.layers, tuple))
    logits, _, feats = forward(target_weights, target_config, tokens, cache, features_at=layers)
    return feats, jax.nn.log_softmax(logits, axis=-1)


def ttt_logits(params: dict, config: ModelConfig, embed, feats, tokens, steps: int) -> list[jnp.ndarray]:
    """Draft-vocabulary logits of each training-time-test step, [b, T-1, Vd] each, for the pairs
    (features of x_i, x_{i+1}) at positions i = 0 .. T-2 of tokens [b, T] (feats [b, T, 3d]).
    Every step predicts x_{i+2}; step s >= 2 reads step s-1's output at i - 1 (valid from i = s-1)."""
    c = config
    b, T = tokens.shape
    n = T - 1
    nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    g = nh // nkv
    eps = c.rms_norm_eps
    e = rms_norm(embed[tokens[:, 1:]].astype(jnp.float32), params["embed_norm"], eps)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    cos, sin = rope_tables(positions, inverse_frequencies(c.rope, hd), jnp.float32)
    i = jnp.arange(n)[:, None]
    j = jnp.arange(n)[None, :]
    hidden = feats[:, :n].astype(jnp.float32) @ params["fc"]
    keys, values, out = [], [], []
    for s in range(1, steps + 1):
        if s > 1:  # each position reads the last step's output one position back
            hidden = jnp.pad(out[-1][:, :-1], ((0, 0), (1, 0), (0, 0)))
        x = jnp.concatenate([e, rms_norm(hidden, params["hidden_norm"], eps)], axis=-1)
        q = apply_rope((x @ params["q"]).reshape(b, n, nh, hd), cos, sin)
        keys.append(apply_rope((x @ params["k"]).reshape(b, n, nkv, hd), cos, sin))
        values.append((x @ params["v"]).reshape(b, n, nkv, hd))
        # step s at i sees step 1's keys up to i - s + 1, and step r's (2 <= r <= s) at i - s + r
        masks = [j <= i - s + 1] + [j == i - s + r for r in range(2, s + 1)]
        k_all, v_all = jnp.concatenate(keys, axis=1), jnp.concatenate(values, axis=1)
        mask = jnp.concatenate(masks, axis=1)  # [n, s * n]
        scores = jnp.einsum("bingd,bjnd->bngij", q.reshape(b, n, nkv, g, hd), k_all) / np.sqrt(hd)
        scores = jnp.where(mask, scores, -jnp.inf)  # every row sees at least its own key
        attn = jnp.einsum("bngij,bjnd->bingd", jax.nn.softmax(scores, axis=-1), v_all).reshape(b, n, nh * hd)
        y = hidden + attn @ params["o"]
        h = rms_norm(y, params["mlp_norm"], eps)
        y = y + (jax.nn.silu(h @ params["gate"]) * (h @ params["up"])) @ params["down"]
        out.append(y)
    return [rms_norm(y, params["norm"], eps) @ params["lm_head"] for y in out]


def ttt_loss(params, config: ModelConfig, embed, feats, tokens, target_logp, draft_ids, steps: int):
    """(loss, per-step top-1 agreement with the target's argmax) over tokens [b, T]."""
    logits = ttt_logits(params, config, embed, feats, tokens, steps)
    n = tokens.shape[1] - 1
    want = target_logp[:, 1 : n + 1][..., draft_ids]  # the target at x_{i+1}, over the draft vocabulary
    want = jax.nn.softmax(want, axis=-1)
    best = jnp.argmax(target_logp[:, 1 : n + 1], axis=-1)  # the target's greedy x_{i+2}
    loss, agree = 0.0, []
    for s, lg in enumerate(logits, start=1):
        valid = (jnp.arange(n) >= s - 1)[None, :]
        ce = -jnp.sum(want * jax.nn.log_softmax(lg, axis=-1), axis=-1)
        loss = loss + STEP_DECAY ** (s - 1) * jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.sum(valid * jnp.ones_like(ce))
        hit = jnp.asarray(draft_ids)[jnp.argmax(lg, axis=-1)] == best
        agree.append(jnp.sum(valid & hit) / jnp.sum(valid * jnp.ones_like(ce)))
    return loss, jnp.stack(agree)


@functools.partial(jax.jit, static_argnames=("target_config", "config", "layers", "steps", "optimizer"),
                   donate_argnames=("params", "opt_state"))
def train_step(params, opt_state, target_weights, tokens, draft_ids, *, target_config, config, layers, steps, optimizer):
    """One optimizer step on a batch of token windows [b, T]; -> (params, opt_state, loss, agreement)."""
    feats, logp = target_pass(target_weights, target_config, tokens, layers)  # not differentiated: an input
    (loss, agree), grads = jax.value_and_grad(ttt_loss, has_aux=True)(
        params, config, target_weights.embed, feats, tokens, logp, draft_ids, steps)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return jax.tree.map(lambda p, u: p + u, params, updates), opt_state, loss, agree


def to_published(params: dict, config: ModelConfig, draft_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The published layout's tensors (torch's [out, in] orientation) of trained params."""
    a = {k: np.asarray(v, np.float32) for k, v in params.items()}
    return {
        "fc.weight": a["fc"].T, "midlayer.input_layernorm.weight": a["embed_norm"],
        "midlayer.hidden_norm.weight": a["hidden_norm"], "midlayer.post_attention_layernorm.weight": a["mlp_norm"],
        "midlayer.self_attn.q_proj.weight": a["q"].T, "midlayer.self_attn.k_proj.weight": a["k"].T,
        "midlayer.self_attn.v_proj.weight": a["v"].T, "midlayer.self_attn.o_proj.weight": a["o"].T,
        "midlayer.mlp.gate_proj.weight": a["gate"].T, "midlayer.mlp.up_proj.weight": a["up"].T,
        "midlayer.mlp.down_proj.weight": a["down"].T, "norm.weight": a["norm"], "lm_head.weight": a["lm_head"].T,
        **draft_vocab_tensors(draft_ids, config.vocab_size),
    }
