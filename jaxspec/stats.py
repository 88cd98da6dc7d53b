"""What every request and every call reports back."""

from __future__ import annotations

import dataclasses


class _Rates:
    """Derived rates of anything with drafted, accepted, new_tokens and target_steps fields."""

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted; None for plain decoding."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_step(self) -> float:
        """Mean new tokens per target forward pass (1.0 for plain decoding)."""
        return self.new_tokens / self.target_steps if self.target_steps else 0.0


@dataclasses.dataclass(frozen=True)
class RequestStats(_Rates):
    prompt_tokens: int
    new_tokens: int
    target_steps: int  # target forward passes that produced this row's tokens (prefill counts 1)
    drafted: int = 0  # draft tokens proposed (0 for plain decoding)
    accepted: int = 0  # draft tokens the target accepted
    accepted_per_position: tuple[int, ...] = ()  # accepted count at draft position 1..K
    drafted_per_position: tuple[int, ...] = ()  # proposals at draft position 1..K

    @property
    def per_position_acceptance(self) -> tuple[float, ...]:
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position))

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            tokens_per_step=self.tokens_per_step,
            per_position_acceptance=list(self.per_position_acceptance),
        )
        return out


@dataclasses.dataclass(frozen=True)
class CallMetrics(_Rates):
    """Whole-call numbers of one generate() call."""

    requests: int
    new_tokens: int
    wall_s: float  # everything, compile included
    compile_s: float  # time spent compiling graphs not seen before
    decode_s: float  # device time of the decode graphs, compile excluded
    graphs_compiled: int
    target_steps: int = 0  # target forward passes over all requests (prefills included)
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            **dataclasses.asdict(self), "tokens_per_s": self.tokens_per_s,
            "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step,
        }


@dataclasses.dataclass(frozen=True)
class Completion:
    text: str | None  # generated part only; None when the model has no tokenizer
    token_ids: list[int]  # generated tokens, the final EOS included when finish_reason == "eos"
    finish_reason: str  # "eos" or "length"
    stats: RequestStats


class Completions(list):
    """A list of Completion in prompt order, with the call's `metrics` attached."""

    def __init__(self, items, metrics: CallMetrics):
        super().__init__(items)
        self.metrics = metrics
