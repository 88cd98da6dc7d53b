"""Speculative decoding: propose -> verify -> accept -> commit, all inside one jitted while_loop.

Per row, with n committed tokens s[0..n): the target cache holds s[0..n-1) (length n - 1) and
s[n-1] is pending. Each round:
  1. the drafter (jaxspec.decoding.drafting: a draft model's chain or tree, n-gram lookup) fills its
     static tree, node 0 = s[n-1];
  2. the target scores every node in one forward pass (a chain causally; a tree with positions
     = depth and the ancestor mask);
  3. the longest accepted path plus one target token is committed (cut at EOS /
     max_new_tokens), the target cache keeps exactly that path (a tree's nodes move into
     place), and the drafter follows; rejected entries are overwritten next round.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.decoding.acceptance import accept_greedy, accept_sampling
from jaxspec.decoding.constraints import RowConstraints, masked, node_states
from jaxspec.decoding.drafting import Drafter, Round
from jaxspec.decoding.logprobs import LOGPROB_FIELDS, logprob_buffers, token_logprobs
from jaxspec.decoding.penalties import penalized, penalized_nodes, penalty_buffers, penalty_start
from jaxspec.decoding.sampling import (
    SamplingArrays,
    filtered_logits,
    row_keys,
    sample_tokens,
)
from jaxspec.decoding.state import (
    FINISH_PADDING,
    RUNNING,
    Batch,
    commit_tokens,
    prefill,
)
from jaxspec.decoding.tree_verify import (
    TreePlan,
    accept_tree_greedy,
    accept_tree_sampling,
    move_path,
    path_to,
)
from jaxspec.decoding.trees import ancestor_mask, chain
from jaxspec.model.cache import KVCache
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import forward
from jaxspec.model.weights import Weights


@struct.dataclass
class SpecState:
    target_cache: KVCache
    draft: object  # the drafter's state pytree
    prev_token: jnp.ndarray  # [b] s[n-2]
    last_token: jnp.ndarray  # [b] s[n-1], pending in the target cache
    out_tokens: jnp.ndarray  # [b, max_out]
    num_generated: jnp.ndarray  # [b]
    finish: jnp.ndarray  # [b]
    stop_state: jnp.ndarray  # [b] int32: each row's stop-string automaton state
    constraint_state: jnp.ndarray  # [b] int32: each row's structured-output automaton state (constraints.py)
    out_logprobs: jnp.ndarray  # [b, max_out, 1 + k] float32 (logprobs.py), [b, 0, 0] when not asked for
    out_logprob_ids: jnp.ndarray  # [b, max_out, 1 + k] int32
    token_counts: jnp.ndarray  # [b, v] int32 output counts (penalties.py), [b, 0] when no row has a penalty
    in_prompt: jnp.ndarray  # [b, v] bool, [b, 0] likewise
    logit_bias: jnp.ndarray  # [b, v] float32, [b, 0] likewise
    rounds: jnp.ndarray  # [b] target verify passes while the row was running
    accepted_per_position: jnp.ndarray  # [b, D] accepted at draft position / tree depth j + 1
    drafted_per_position: jnp.ndarray  # [b, D] rounds that drafted position / depth j + 1 (adaptive K varies it)
    experts_read: jnp.ndarray  # [b] float32 a mixture of experts' distinct experts per layer, summed over verify passes


def _target_distribution(logits: jnp.ndarray, sampling: SamplingArrays) -> jnp.ndarray:
    """[b, t, v]: the filtered sampling distribution, one-hot argmax for greedy rows."""
    one_hot = jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
    p = jax.nn.softmax(filtered_logits(logits, sampling), axis=-1)
    return jnp.where((sampling.temperature == 0)[:, None, None], one_hot, p)


def verify(weights: Weights, config: ModelConfig, plan: TreePlan, cache: KVCache, tokens, q, n, keys,
           sampling: SamplingArrays, greedy_only: bool, attention: str, features_at=(), penalties=None,
           constraint: RowConstraints | None = None):
    """The target's pass over the proposed nodes and the lossless acceptance.
    tokens [b, t]; q [b, t-1, v] or None (point masses); keys [b, t, 2]: t-1 uniforms, 1 final.
    -> (accepted depth [b], emitted [b, D+1], path [b, D+1], target cache with the path in place,
    the path's features [b, D+1, F] at features_at (forward's), or None without, the logits
    [b, t, v] of every node, raw and as scored, and a mixture of experts' distinct experts read
    per row and layer [b]: zeros for a dense target). penalties: (output counts [b, v], prompt tokens
    [b, v], biases [b, v]) to penalize each node's logits with, its path's drafts counted (penalties.py).
    constraint: the rows' structured-output constraints: each node's logits are masked by the state
    its path reaches (constraints.py)."""
    t, D = plan.size, plan.max_depth
    is_chain = plan.parents == chain(t - 1)
    cache = cache.replace(lengths=n - 1)
    routing = config.is_moe
    if is_chain:
        logits, cache, *extra = forward(weights, config, tokens, cache, attention=attention,
                                        features_at=features_at, routing=routing)
    else:
        positions = (n - 1)[:, None] + jnp.asarray(plan.depth, jnp.int32)[None, :]
        logits, cache, *extra = forward(weights, config, tokens, cache, positions,
                                        jnp.asarray(ancestor_mask(plan.parents)), attention=attention,
                                        features_at=features_at, routing=routing)
    features = extra[:1] if features_at else []
    experts = unique_experts(extra[-1], config.num_experts) if routing else jnp.zeros(n.shape, jnp.float32)
    raw = logits
    if penalties is not None:
        logits = penalized_nodes(logits, tokens, plan.parents, *penalties, sampling)
    if constraint is not None:
        states = node_states(constraint.tables, constraint.sets, constraint.state, tokens, plan.parents)
        logits = constraint.masked(logits, states)
    uniforms = None if greedy_only else jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(keys[:, : t - 1])
    p = None if greedy_only else _target_distribution(logits, sampling)
    if is_chain:
        drafts = tokens[:, 1:]
        if greedy_only:
            accepted, next_token = accept_greedy(drafts, logits)
        else:
            accepted, next_token = accept_sampling(drafts, q, p, uniforms, keys[:, t - 1])
        path = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
    else:
        accepted, next_token, best = accept_tree_greedy(plan, tokens, logits)
        if not greedy_only:
            sampled = accept_tree_sampling(plan, tokens, q, p, uniforms, keys[:, t - 1])
            greedy_row = sampling.temperature == 0
            accepted, next_token, best = (jnp.where(greedy_row, g, x) for g, x in zip((accepted, next_token, best), sampled))
        path = path_to(plan, best)  # [b, D+1]
        drafts = jnp.take_along_axis(tokens, path, axis=1)[:, 1:]
        cache = move_path(cache, n - 1, path)
    j = jnp.arange(D + 1)[None, :]
    emitted = jnp.where(j < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), next_token[:, None])
    path_features = jnp.take_along_axis(features[0], path[:, :, None], axis=1) if features else None
    return accepted, emitted, path, cache, path_features, raw, logits, experts


def unique_experts(routing: jnp.ndarray, num_experts: int) -> jnp.ndarray:
    """routing [L, b, t, k] (the experts each node chose in each layer) -> [b] float32: the
    distinct experts each row's pass read per layer, the mean over layers."""
    L, b, t, k = routing.shape
    hit = jnp.zeros((L, b, num_experts), bool).at[
        jnp.arange(L)[:, None, None], jnp.arange(b)[None, :, None], routing.reshape(L, b, t * k)].set(True)
    return jnp.sum(hit, axis=(0, 2)).astype(jnp.float32) / L


@dataclasses.dataclass(frozen=True)
class SpeculativeLoop:
    """Propose -> verify -> accept -> commit rounds. params: the drafter's arrays (a draft model's
    weights, or None)."""

    config: ModelConfig  # the target's
    drafter: Drafter
    logprobs: int = -1  # top alternatives recorded per token (logprobs.py); -1: no logprobs
    penalties: bool = False  # a row has a penalty: the state counts tokens (penalties.py)

    @property
    def result_fields(self) -> tuple[str, ...]:
        fields = ("out_tokens", "num_generated", "finish", "rounds", "accepted_per_position", "drafted_per_position")
        fields += ("experts_read",) if self.config.is_moe else ()
        return fields + (LOGPROB_FIELDS if self.logprobs >= 0 else ())

    def _per_token(self, logits, scored, chosen, batch: Batch) -> dict | None:
        """The logprob buffers' values for tokens `chosen` [b, m] drawn from logits [b, m, v]
        (`scored`: after any penalties)."""
        if self.logprobs < 0:
            return None
        lp, ids = token_logprobs(logits, chosen, batch.sampling, self.logprobs, scored)
        return {"out_logprobs": lp, "out_logprob_ids": ids}

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the drafter reads (an EAGLE-3 head's), else none."""
        return getattr(self.drafter, "feature_layers", ())

    @property
    def slack(self) -> int:
        """Cache slots past a row's budget: a round writes its tree's nodes past the committed length."""
        return len(self.drafter.tree) + 1

    def start(self, weights: Weights, params, batch: Batch, capacity: int, max_out: int,
              greedy_only: bool, attention: str = "xla") -> SpecState:
        """Prefill and the first token (from the target's prefill, exactly as in plain decoding):
        the loop state of a fresh batch (padding rows finished)."""
        c = self.config
        D = TreePlan.of(self.drafter.tree).max_depth
        b = batch.tokens.shape[0]
        layers = self.feature_layers
        logits, t_cache, *features = prefill(weights, c, batch, capacity, layers, attention, batch.prefix)
        zeros = jnp.zeros((b,), jnp.int32)
        rules = penalty_start(batch, c.vocab_size) if self.penalties else None
        scored = penalized(logits, jnp.zeros((b, c.vocab_size), jnp.int32), rules["in_prompt"], rules["logit_bias"],
                           batch.sampling) if self.penalties else logits
        tables = batch.constraint_tables.value
        if tables.on:  # every row starts in its constraint's first state
            scored = masked(scored, tables, batch.constraint_sets, zeros)
        first = sample_tokens(scored, batch.sampling, row_keys(batch.seeds, zeros), greedy_only)
        extra = {"features": features[0]} if layers else {}
        state = SpecState(
            target_cache=t_cache,
            draft=self.drafter.init(params, batch, capacity, max_out, first, **extra),
            prev_token=jnp.take_along_axis(batch.tokens, jnp.maximum(batch.prompt_lens - 1, 0)[:, None], 1)[:, 0],
            last_token=first,
            out_tokens=jnp.full((b, max_out), c.pad_token_id, jnp.int32),
            num_generated=zeros,
            finish=jnp.where(batch.prompt_lens > 0, RUNNING, FINISH_PADDING),
            stop_state=zeros,
            constraint_state=zeros,
            rounds=zeros,
            accepted_per_position=jnp.zeros((b, D), jnp.int32),
            drafted_per_position=jnp.zeros((b, D), jnp.int32),
            experts_read=jnp.zeros((b,), jnp.float32),
            **logprob_buffers(b, max_out, self.logprobs),
            **penalty_buffers(b, c.vocab_size, self.penalties),
        )
        if self.penalties:
            state = state.replace(**rules)
        return commit_tokens(state, first[:, None], jnp.ones_like(first), batch, c.eos_token_ids,
                             self._per_token(logits[:, None], scored[:, None], first[:, None], batch))[0]

    def fits(self, s: SpecState, batch: Batch) -> jnp.ndarray:
        """[b]: a round has room (it writes the tree's t nodes at slots n - 1 .. n + t - 2)."""
        return batch.prompt_lens + s.num_generated + len(self.drafter.tree) - 1 <= s.target_cache.capacity

    def step(self, weights: Weights, params, batch: Batch, s: SpecState, greedy_only: bool,
             attention: str) -> SpecState:
        """One propose -> verify -> accept -> commit round for every running row."""
        drafter, c = self.drafter, self.config
        plan = TreePlan.of(drafter.tree)
        t, D = plan.size, plan.max_depth
        b = batch.prompt_lens.shape[0]
        running = s.finish == RUNNING
        n = batch.prompt_lens + s.num_generated  # committed tokens per row
        # Per row and round: t - 1 keys for the drafter, t - 1 uniforms and one final draw.
        keys = jax.vmap(lambda k: jax.random.split(k, 2 * t - 1))(row_keys(batch.seeds, s.num_generated))
        tables = batch.constraint_tables.value
        constraint = RowConstraints(tables, batch.constraint_sets, s.constraint_state) if tables.on else None
        r = Round(n, s.prev_token, s.last_token, keys[:, : t - 1], batch.sampling, greedy_only, attention, constraint)
        tokens, q, draft = drafter.propose(params, s.draft, r)
        accepted, emitted, path, t_cache, features, logits, scored, experts = verify(
            weights, c, plan, s.target_cache, tokens, q, n, keys[:, t - 1 :], batch.sampling, greedy_only, attention,
            self.feature_layers, (s.token_counts, s.in_prompt, s.logit_bias) if self.penalties else None, constraint)
        # emitted[:, j] was drawn from the verify pass's logits at the path's node j
        on_path = lambda x: jnp.take_along_axis(x, path[:, :, None], axis=1)  # noqa: E731
        per_token = self._per_token(on_path(logits), on_path(scored), emitted, batch)
        s2, kept = commit_tokens(s, emitted, accepted + 1, batch, c.eos_token_ids, per_token)
        extra = {"features": features} if self.feature_layers else {}
        draft = drafter.commit(params, draft, r, path, emitted, kept, **extra)
        # The last two committed tokens seed the next round.
        all_tokens = jnp.concatenate([s.last_token[:, None], emitted], axis=1)
        rows = jnp.arange(b)
        prev = jnp.where(kept > 0, all_tokens[rows, jnp.maximum(kept - 1, 0)], s.prev_token)
        last = jnp.where(kept > 0, all_tokens[rows, kept], s.last_token)
        # The state's depth may exceed this loop's: adaptive K's loops share the widest one's state.
        depth = jnp.arange(s.accepted_per_position.shape[1])[None, :]
        at_depth = depth < accepted[:, None]
        return s2.replace(
            target_cache=t_cache,
            draft=draft,
            prev_token=prev,
            last_token=last,
            rounds=s.rounds + running,
            accepted_per_position=s.accepted_per_position + (running[:, None] & at_depth),
            drafted_per_position=s.drafted_per_position + (running[:, None] & (depth < D)),
            experts_read=s.experts_read + jnp.where(running, experts, 0),
        )

    def resume(self, params, batch: Batch, s: SpecState) -> SpecState:
        """After paused rounds (adaptive K at 0): a drafter that fell behind catches up."""
        catch_up = getattr(self.drafter, "catch_up", None)
        if catch_up is None:
            return s
        return s.replace(draft=catch_up(params, s.draft, s.out_tokens, batch.prompt_lens,
                                        batch.prompt_lens + s.num_generated, s.finish == RUNNING))
