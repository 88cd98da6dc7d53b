"""Lossless acceptance of a drafted chain, as pure functions over [b, K] proposals.

Greedy: accept while the draft token equals the target's argmax; the first mismatch is replaced
by the target's argmax (a bonus token when all K match).
Sampling (Leviathan et al. / Chen et al.): accept draft token d at position j with probability
min(1, p_j(d) / q_j(d)); at the first rejection draw from normalize(max(p_j - q_j, 0)); when all
K are accepted draw a bonus token from p_K. The emitted tokens are then distributed exactly as
the target's own sampling distribution p. A point-mass proposal (q one-hot, as n-gram lookup
makes) is the same rule: accept d with probability p(d), else draw from p with d removed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def leading_true(accept: jnp.ndarray) -> jnp.ndarray:
    """[b, K] bool -> [b] int32 length of the all-True prefix."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1)


def accept_greedy(draft_tokens: jnp.ndarray, target_logits: jnp.ndarray):
    """draft_tokens [b, K], target_logits [b, K+1, v] -> (accepted [b], next token [b])."""
    target_argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [b, K+1]
    accepted = leading_true(draft_tokens == target_argmax[:, :-1])
    next_token = jnp.take_along_axis(target_argmax, accepted[:, None], axis=1)[:, 0]
    return accepted, next_token


def accept_sampling(
    draft_tokens: jnp.ndarray,  # [b, K]
    q: jnp.ndarray | None,  # [b, K, v] draft distributions the tokens were drawn from; None: point masses
    p: jnp.ndarray,  # [b, K+1, v] target distributions at the same positions (+ bonus)
    uniforms: jnp.ndarray,  # [b, K] in [0, 1)
    keys: jnp.ndarray,  # [b, 2] for the residual / bonus draw
):
    """-> (accepted [b] int32, next token [b] int32), the speculative rejection rule in float32."""
    K = draft_tokens.shape[1]
    p_d = jnp.take_along_axis(p[:, :K], draft_tokens[..., None], axis=-1)[..., 0]
    q_d = 1.0 if q is None else jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    accepted = leading_true(uniforms * q_d < p_d)  # u < p/q, without dividing
    p_at = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [b, v]
    if q is None:  # remove the rejected token (none at the bonus slot)
        rejected = jnp.take_along_axis(jnp.pad(draft_tokens, ((0, 0), (0, 1)), constant_values=-1), accepted[:, None], 1)
        residual = jnp.where(jnp.arange(p.shape[-1])[None, :] == rejected, 0.0, p_at)
    else:
        q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # no draft at the bonus slot
        q_at = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
        residual = jnp.maximum(p_at - q_at, 0.0)
    # A rejection is impossible where p <= q everywhere; fall back to p so the draw stays defined.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_at)
    next_token = jax.vmap(lambda k, r: jax.random.categorical(k, jnp.log(r)))(keys, residual)
    return accepted, next_token.astype(jnp.int32)
