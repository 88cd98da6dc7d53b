"""Logit bias, repetition, presence and frequency penalties (vLLM's semantics), applied to the
target's logits before temperature and the filters, with the counts each position would have in
plain decoding.

- logit bias (OpenAI's rule): each listed token's bias is added to its logit, first;

- repetition (HF's and vLLM's rule): a token seen in the prompt or the output has its logit divided
  by the penalty when > 0 and multiplied by it otherwise;
- presence and frequency (OpenAI's rule, over the output only):
  `logit - frequency * count - presence * (count > 0)`.

A row's output counts, prompt tokens and biases ride in the loop state. At a verify pass the logits of node
i are penalized with the committed counts plus the drafted tokens on the path to node i (itself
included), so greedy acceptance compares with plain decoding's argmax and sampled acceptance uses
plain decoding's distribution: the output stays lossless under every drafter (the drafts' own
distributions are left unpenalized; the acceptance rule is exact for any of them).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.sampling import SamplingArrays
from jaxspec.decoding.trees import ancestor_mask


def any_penalty(params) -> bool:
    """Whether a request's SamplingParams sets a penalty or a logit bias (the loop then keeps counts)."""
    return (params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0
            or bool(params.logit_bias))


def _penalize(x, counts, in_prompt, bias, params: SamplingArrays, extra: tuple):
    """x float32 [b, ..., v'] logits of tokens whose output counts, prompt presence and biases are given alike."""
    shape = (-1,) + extra + (1,)
    x = x + bias
    rep = params.repetition_penalty.reshape(shape)
    x = jnp.where((counts > 0) | in_prompt, jnp.where(x > 0, x / rep, x * rep), x)
    return (x - params.frequency_penalty.reshape(shape) * counts
            - params.presence_penalty.reshape(shape) * (counts > 0))


def penalized(logits, counts, in_prompt, bias, params: SamplingArrays):
    """logits [b, v] -> float32 [b, v], biased and penalized by the row's biases [b, v], output
    counts [b, v] and prompt [b, v]."""
    return _penalize(logits.astype(jnp.float32), counts, in_prompt, bias, params, ())


def penalized_nodes(logits, tokens, parents, counts, in_prompt, bias, params: SamplingArrays):
    """A verify pass's logits [b, t, v] over the proposed nodes tokens [b, t] (node 0 the last
    committed token, already counted; `parents` the static tree) -> float32 [b, t, v], node i
    penalized as if the drafted tokens on its path were committed."""
    path = jnp.asarray(ancestor_mask(parents) & (np.arange(len(parents)) > 0)[None, :], jnp.float32)  # [i, k]
    base = _penalize(logits.astype(jnp.float32), counts[:, None], in_prompt[:, None], bias[:, None], params, (1,))
    # Where node j's token appears in node i's context: its count there is the committed count plus
    # its occurrences on the path to i. Written for every (i, j), a duplicate token writes the same value.
    same = (tokens[:, :, None] == tokens[:, None, :]).astype(jnp.float32)  # [b, j, k]
    on_path = jnp.einsum("ik,bjk->bij", path, same).astype(counts.dtype)  # [b, i, j]
    t = tokens.shape[1]
    at = jnp.broadcast_to(tokens[:, None, :], (tokens.shape[0], t, t))  # [b, i, j] token ids
    raw = jnp.take_along_axis(logits.astype(jnp.float32), at, axis=-1)
    count = jnp.take_along_axis(counts, tokens, axis=1)[:, None, :] + on_path
    seen = jnp.take_along_axis(in_prompt, tokens, axis=1)[:, None, :]
    biased = jnp.take_along_axis(bias, tokens, axis=1)[:, None, :]
    value = _penalize(raw, count, jnp.broadcast_to(seen, count.shape), biased, params, (1,))
    b_idx = jnp.arange(tokens.shape[0])[:, None, None]
    i_idx = jnp.arange(t)[None, :, None]
    return base.at[b_idx, i_idx, at].set(value)


def count_tokens(counts, new, kept):
    """counts [b, v] + the first kept[b] tokens of new [b, m]."""
    live = (jnp.arange(new.shape[1])[None, :] < kept[:, None]).astype(counts.dtype)
    return counts.at[jnp.arange(new.shape[0])[:, None], new].add(live)


def prompt_tokens(batch_tokens, prompt_lens, vocab: int):
    """[b, v] bool: the tokens of each row's prompt."""
    b, p = batch_tokens.shape
    live = jnp.arange(p)[None, :] < prompt_lens[:, None]
    return jnp.zeros((b, vocab), bool).at[jnp.arange(b)[:, None], batch_tokens].max(live)


def logit_biases(bias_ids, bias_values, vocab: int):
    """[b, v] float32: each row's biases (bias_ids [b, B], -1 past them) on its tokens, 0 elsewhere."""
    b = bias_ids.shape[0]
    at = jnp.where(bias_ids >= 0, bias_ids, vocab)  # past the end: dropped
    return jnp.zeros((b, vocab), jnp.float32).at[jnp.arange(b)[:, None], at].set(bias_values, mode="drop")


def penalty_buffers(b: int, vocab: int, on: bool) -> dict:
    """The loop state's output counts, prompt tokens and biases ([b, 0] when no row has a penalty or bias)."""
    v = vocab if on else 0
    return {"token_counts": jnp.zeros((b, v), jnp.int32), "in_prompt": jnp.zeros((b, v), bool),
            "logit_bias": jnp.zeros((b, v), jnp.float32)}


def penalty_start(batch, vocab: int) -> dict:
    """A fresh batch's prompt tokens and biases, for the loop state (penalty_buffers' fields)."""
    return {"in_prompt": prompt_tokens(batch.tokens, batch.prompt_lens, vocab),
            "logit_bias": logit_biases(batch.bias_ids, batch.bias_values, vocab)}
