"""Adaptive K's loops: one speculative loop per K of a small set, all sharing the widest one's state
(its cache room, draft state and per-position counters), so the continuous scheduler can switch
between them at any return to the host (jaxspec.serving.adaptive_k chooses). K = 0 is a paused
drafter: a verify pass of the pending token alone, which is a plain step, with the drafter's state
kept (n-gram history written; a draft model's cache left behind, and caught up by the loop's
`resume` before K > 0 runs again). Which K runs never changes what is accepted: greedy output is
the same at every K, and sampling is exact at every K."""

from __future__ import annotations

import dataclasses

from jaxspec.decoding.drafting import Drafter, Round
from jaxspec.decoding.speculative import SpeculativeLoop
from jaxspec.errors import InputError


def k_choices(k_max: int) -> tuple[int, ...]:
    """The compiled K values up to k_max: 0, then k_max halved down to 1 (3 -> 0, 1, 3; 8 -> 0, 1, 2, 4, 8)."""
    ks = {0}
    k = k_max
    while k:
        ks.add(k)
        k //= 2
    return tuple(sorted(ks))


@dataclasses.dataclass(frozen=True)
class PausedDrafter:
    """K = 0: proposes nothing (the round verifies only the pending token) and keeps `inner`'s state
    following the committed tokens where that costs no model pass (its `follow`, else its commit)."""

    inner: Drafter

    @property
    def tree(self):
        return (-1,)

    def init(self, params, batch, capacity: int, max_out: int, first, **extra):
        return self.inner.init(params, batch, capacity, max_out, first, **extra)

    def propose(self, params, state, r: Round):
        return r.last[:, None], None, state

    def commit(self, params, state, r: Round, path, emitted, kept):
        return getattr(self.inner, "follow", self.inner.commit)(params, state, r, path, emitted, kept)


def adaptive_loops(loop: SpeculativeLoop, ks: tuple[int, ...], name: str) -> dict[int, SpeculativeLoop]:
    """{K: the loop drafting K tokens} for each K in ks, from the widest loop (`loop`, K = max(ks));
    name: the method's, for the error when its drafter has no K to vary (an EAGLE-3 head's state is
    sized by K; a draft model's named tree is fixed)."""
    with_k = getattr(loop.drafter, "with_k", None)
    if with_k is None:
        raise InputError(f"adaptive K varies the chain length of a draft model, n-gram lookup or suffix drafting; "
                         f"{name} has no K to vary (use a fixed num_draft_tokens)")
    return {k: dataclasses.replace(loop, drafter=with_k(k) if k else PausedDrafter(loop.drafter)) for k in ks}
