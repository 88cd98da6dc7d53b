"""prompt_logprobs: the target's log-probability of each prompt token after the ones before it,
with the top alternatives (vLLM's layout: None for the first token, then {token id: logprob}).

A forward pass over the prompt with every position's logits, outside the decode loop and only
for the requests that ask (the loop's prefill keeps the last position's logits alone). The prompt
is padded to its length bucket (causal attention: the padding changes no earlier position), so a
call compiles one graph per bucket. They are raw log-probabilities, before any sampling setting.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model.cache import KVCache
from jaxspec.model.forward import forward
from jaxspec.serving.batching import bucket
from jaxspec.serving.requests import Request


@functools.partial(jax.jit, static_argnames=("config", "k"))
def _scores(weights, tokens, *, config, k: int):
    """tokens [1, P] -> (each next token's logprob [P - 1], top-k logprobs and ids [P - 1, k])."""
    cache = KVCache.create(config, 1, tokens.shape[1], weights.embed.dtype,
                           stacked=not isinstance(weights.layers, tuple), mesh=weights.mesh)
    logits, _ = forward(weights, config, tokens, cache)
    lp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[0, 1:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, k)
    return chosen, top_lp, top_ids


def prompt_logprobs(target, request: Request) -> list[dict[int, float] | None]:
    """The request's prompt logprobs: None for its first token, then the token's and the top
    SamplingParams.prompt_logprobs alternatives' log-probabilities."""
    ids = list(request.token_ids)
    k = request.sampling.prompt_logprobs
    padded = np.full((1, bucket(len(ids))), target.config.pad_token_id, np.int32)
    padded[0, : len(ids)] = ids
    chosen, top_lp, top_ids = jax.device_get(_scores(target.weights, jnp.asarray(padded), config=target.config,
                                                     k=max(k, 1)))
    out: list[dict[int, float] | None] = [None]
    for i, token in enumerate(ids[1:]):
        entry = {token: float(chosen[i])}
        entry.update({int(t): float(v) for t, v in zip(top_ids[i, :k], top_lp[i, :k])})
        out.append(entry)
    return out


def with_prompt_logprobs(target, request: Request, completion):
    """`completion` with its prompt logprobs, where the request asks for them."""
    if request.sampling.prompt_logprobs is None:
        return completion
    return dataclasses.replace(completion, prompt_logprobs=prompt_logprobs(target, request))
