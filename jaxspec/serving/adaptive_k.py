"""Adaptive K (RunOptions.adaptive_k): the continuous scheduler picks, at each return to the host,
the K (0 = plain) of a small compiled set that commits most tokens per second, from

  * round costs measured on this machine: at the job's start each K runs a few rounds of the real
    job (no work is thrown away), timed at the slot count the loop is compiled for, and again
    each time a draining job's loop moves to fewer rows (continuous.py: `shrink`);
  * acceptance measured so far, per draft position: accepted[j] / drafted[j] over every round that
    drafted position j + 1, so a chain of K is expected to commit 1 + sum(rate[:K]) tokens a round
    (positions never drafted yet extrapolate the last measured ratio geometrically).

A compiled loop pays for all its rows, so at a given row count the choice weighs tokens per round
against seconds per round: where a full batch is compute-bound (a CPU, or a GPU at large batch)
plain decoding wins, and as the job drains to fewer rows speculation does. As acceptance drifts
through a job (records that repeat themselves, records that do not) K follows it too. K never changes what is accepted
(decoding/adaptive.py)."""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("jaxspec")

TIMED_ROUNDS = 4  # rounds timed per K at the start (after one untimed round: the first run of a graph)


class AdaptiveK:
    """The host's choice of K: the round costs, the acceptance counts, and the K of each segment."""

    def __init__(self, ks: tuple[int, ...], depth: int):
        self.ks = tuple(sorted(ks))
        self.round_s: dict[int, dict[int, float]] = {}  # rows -> K -> seconds per round
        self.accepted, self.drafted = np.zeros(depth), np.zeros(depth)
        self.k = max(self.ks)

    def untimed(self, rows: int) -> list[int]:
        """The K values not yet timed at this row count, widest first (its rounds measure every position)."""
        return [k for k in sorted(self.ks, reverse=True) if k not in self.round_s.get(rows, {})]

    def next(self, rows: int) -> tuple[int, bool]:
        """(the K of the next segment of a loop of `rows` rows, whether it is a timing segment)."""
        untimed = self.untimed(rows)
        if untimed:
            self.k = untimed[0]
            return self.k, True
        costs = self.round_s[rows]
        best = max(self.ks, key=lambda k: self.tokens_per_round(k) / costs[k])
        if best != self.k:
            log.info("adaptive K: %d -> %d at %d rows (%s)", self.k, best, rows, self.describe(rows))
        self.k = best
        return best, False

    def timed(self, k: int, rows: int, seconds: float, rounds: int) -> None:
        """A timing segment of `rounds` rounds at K, `rows` rows, took `seconds` (dispatch to results)."""
        if rounds > 0:
            self.round_s.setdefault(rows, {})[k] = seconds / rounds
            if not self.untimed(rows):
                log.info("adaptive K: round costs at %d rows measured (%s)", rows, self.describe(rows))

    def record(self, accepted: np.ndarray, drafted: np.ndarray) -> None:
        """A segment's accepted and drafted counts per position, summed over rows."""
        self.accepted += accepted
        self.drafted += drafted

    def rates(self) -> np.ndarray:
        """P(draft positions 1..j + 1 all accepted) per j: measured, then extrapolated."""
        rates = np.zeros(len(self.drafted))
        for j in range(len(rates)):
            if self.drafted[j] > 0:
                rates[j] = self.accepted[j] / self.drafted[j]
            elif j >= 2 and rates[j - 2] > 0:
                rates[j] = rates[j - 1] * rates[j - 1] / rates[j - 2]
            elif j == 1:
                rates[j] = rates[0] * rates[0]
        return np.minimum(rates, 1.0)

    def tokens_per_round(self, k: int) -> float:
        return 1.0 + float(self.rates()[:k].sum())

    def describe(self, rows: int) -> str:
        costs = self.round_s.get(rows, {})
        return ", ".join(f"K={k}: {costs.get(k, float('nan')) * 1e3:.1f} ms/round, "
                         f"{self.tokens_per_round(k):.2f} tokens/round" for k in self.ks)

