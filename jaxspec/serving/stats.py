"""What every request and every call reports back."""

from __future__ import annotations

import dataclasses

from jaxspec.decoding.state import FINISH_REASONS
from jaxspec.serving.requests import Request


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
    # prompt tokens whose keys and values came from a prefix another request of the call ran
    # (vLLM's num_cached_tokens, OpenAI's usage.prompt_tokens_details.cached_tokens)
    cached_tokens: int = 0
    # a mixture-of-experts target's distinct experts per layer that a verify pass read, the mean
    # over its passes (what a round's bytes follow); None for a dense target or plain decoding
    experts_per_layer: float | None = None

    @property
    def per_position_acceptance(self) -> tuple[float, ...]:
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position))

    @classmethod
    def combined(cls, parts: list[RequestStats]) -> RequestStats:
        """Several requests' stats as one (a prompt's n samples): every count summed, prompt tokens
        too, so prompt_tokens - cached_tokens stays the prefill tokens they ran."""
        def positions(name):
            width = max(len(getattr(p, name)) for p in parts)
            return tuple(sum(getattr(p, name)[j] for p in parts if j < len(getattr(p, name))) for j in range(width))

        counts = ("prompt_tokens", "new_tokens", "target_steps", "drafted", "accepted", "cached_tokens")
        passes = [(p.experts_per_layer, p.target_steps - 1) for p in parts if p.experts_per_layer is not None]
        experts = sum(e * n for e, n in passes) / sum(n for _, n in passes) if passes else None
        return cls(**{f: sum(getattr(p, f) for p in parts) for f in counts},
                   accepted_per_position=positions("accepted_per_position"),
                   drafted_per_position=positions("drafted_per_position"), experts_per_layer=experts)

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
    graphs_compiled: int  # graphs this call compiled (graph cache misses)
    target_steps: int = 0  # target forward passes over all requests (prefills included)
    drafted: int = 0
    accepted: int = 0
    graph_cache_hits: int = 0  # graphs this call found compiled already
    graphs_from_disk: int = 0  # of graphs_compiled, those read back from the persistent compilation cache
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens the target's prefills ran (each shared prefix once)
    cached_tokens: int = 0  # the requests' cached_tokens: prompt tokens a shared prefix spared
    experts_per_layer: float | None = None  # RequestStats', the mean over the call's verify passes

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
    """One request's result, in vLLM's terms. finish_reason: "stop" (an EOS id or a stop token id
    was generated) or "length" (max_tokens, or the context, ran out); stop_reason: the stop token
    id that ended it, None for EOS and "length"."""

    text: str | None  # generated part only, without a stop token; None when the model has no tokenizer
    token_ids: list[int]  # generated tokens, the final EOS or stop token included when finish_reason == "stop"
    finish_reason: str  # "stop" or "length"
    stats: RequestStats
    stop_reason: int | str | None = None
    # per generated token, {token id: log-probability} of the chosen token and the top
    # SamplingParams.logprobs alternatives (vLLM's layout); None when not asked for
    logprobs: list[dict[int, float]] | None = None
    # per prompt token, None for the first, then the same layout (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    index: int = 0  # which of its prompt's SamplingParams.n samples


class Completions(list):
    """A list of Completion in prompt order, with the call's `metrics` attached."""

    def __init__(self, items, metrics: CallMetrics):
        super().__init__(items)
        self.metrics = metrics


def _request_stats(request: Request, out: dict, row: int, cached_tokens: int) -> RequestStats:
    n = int(out["num_generated"][row])
    if "rounds" not in out:  # plain decoding
        return RequestStats(prompt_tokens=len(request.token_ids), new_tokens=n, target_steps=n,
                            cached_tokens=cached_tokens)
    rounds = int(out["rounds"][row])
    # per draft position (chain) or tree depth: the rounds that drafted it (all of them, unless
    # adaptive K varied the depth) and how many accepted it
    per_position = tuple(int(a) for a in out["accepted_per_position"][row])
    drafted = tuple(int(d) for d in out["drafted_per_position"][row])
    return RequestStats(
        prompt_tokens=len(request.token_ids),
        new_tokens=n,
        target_steps=rounds + 1,  # the prefill produced the first token
        drafted=sum(drafted),
        accepted=sum(per_position),
        accepted_per_position=per_position,
        drafted_per_position=drafted,
        cached_tokens=cached_tokens,
        experts_per_layer=float(out["experts_read"][row]) / rounds if "experts_read" in out and rounds else None,
    )


def completion(tokenizer, request: Request, out: dict, row: int, eos_ids: tuple[int, ...] = (),
               cached_tokens: int = 0) -> Completion:
    """Row `row` of a decode loop's results (jaxspec.decoding.loop.results, on the host) as the
    request's Completion; text decoded with `tokenizer` (None: no text). eos_ids: the model's.
    cached_tokens: its prompt tokens a shared prefix spared (RequestStats')."""
    ids = out["out_tokens"][row, : int(out["num_generated"][row])].tolist()
    reason = FINISH_REASONS[int(out["finish"][row])]
    stops = request.sampling
    # vLLM's order: an EOS id is stop_reason None, then a stop token id, then a stop string.
    by_id = reason == "stop" and ids[-1] not in eos_ids and ids[-1] in stops.stop_token_ids
    text = tokenizer.decode(ids[:-1] if by_id else ids, skip_special_tokens=True) if tokenizer else None
    stop_reason = ids[-1] if by_id else None
    if reason == "stop" and not by_id and ids[-1] not in eos_ids and stops.stop and text is not None:
        text, stop_reason = _before_stop(text, stops.stop)
    return Completion(text, ids, reason, _request_stats(request, out, row, cached_tokens), stop_reason, _logprobs(request, out, row),
                      index=request.index)


def _logprobs(request: Request, out: dict, row: int) -> list[dict[int, float]] | None:
    """Row `row`'s recorded logprobs, each token's chosen entry and its first `logprobs` alternatives."""
    k = request.sampling.logprobs
    if k is None:
        return None
    n = int(out["num_generated"][row])
    ids, lps = out["out_logprob_ids"][row, :n, : 1 + k].tolist(), out["out_logprobs"][row, :n, : 1 + k].tolist()
    return [dict(zip(i, lp)) for i, lp in zip(ids, lps)]


def _before_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """The text before its earliest stop string, and that string (the loop ended the row on the
    token that completed it)."""
    found = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
    if not found:
        return text, None
    at, i = min(found)
    return text[:at], stops[i]
