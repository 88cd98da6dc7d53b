"""How a call runs, as one value (beside what it decodes, DecodeMethod, and how each request
samples, SamplingParams): the attention implementation, deterministic mode and the acceptance
warning line. generate, batch jobs and the CLI carry it whole; it checks itself on construction."""

from __future__ import annotations

import dataclasses

import jax

from jaxspec.checks import check_int, check_number
from jaxspec.errors import InputError
from jaxspec.model.forward import ATTENTION_IMPLS
from jaxspec.serving.prefixes import PREFIX_BLOCK, PREFIX_CACHE_TOKENS
from jaxspec.serving.warnings import DEFAULT_WARN_BELOW

ATTENTION_CHOICES = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """attention: "auto" (the fused Pallas kernel on GPUs, XLA's attention on the CPU), "xla" or
    "pallas" (on the CPU in interpret mode, for tests). deterministic: every row's result depends
    on that row alone, bit for bit, in any dtype (docs/deterministic.md; chains only).
    warn_below_acceptance: log a warning when a call's acceptance rate falls below it.
    prefix_cache: prompts that begin with the same blocks of tokens (a system prompt, a few-shot
    preamble, the n samples of one prompt) prefill them once (serving/prefixes.py); the output is
    the same without it. prefix_cache_tokens: the bound on those prefixes' cache (the store's
    rows x width, in tokens); the prefixes that spare most are kept within it. adaptive_k: the
    continuous scheduler chooses K (0 = plain) at each return to the host from num_draft_tokens
    halved down to 0, by round costs timed at the start and the acceptance so far
    (serving/adaptive_k.py); a call of more prompts than one batch, or a batch job, uses it."""

    attention: str = "auto"
    deterministic: bool = False
    warn_below_acceptance: float = DEFAULT_WARN_BELOW
    prefix_cache: bool = True
    prefix_cache_tokens: int = PREFIX_CACHE_TOKENS
    adaptive_k: bool = False

    def __post_init__(self):
        for name in ("deterministic", "prefix_cache", "adaptive_k"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if self.deterministic and self.attention not in ("auto", "deterministic"):
            raise InputError(f"deterministic mode runs its own attention kernel: leave attention 'auto'; "
                             f"got {self.attention!r}")
        if self.attention not in ("auto", *ATTENTION_IMPLS):
            raise InputError(f"attention must be one of auto, {', '.join(ATTENTION_IMPLS)}; got {self.attention!r}")
        check_number(self.warn_below_acceptance, "warn_below_acceptance", "in [0, 1]", lambda x: 0 <= x <= 1)
        check_int(self.prefix_cache_tokens, "prefix_cache_tokens", PREFIX_BLOCK)

    @property
    def attention_impl(self) -> str:
        """What the loop runs: "deterministic" (its own kernels), else "auto" resolved for this backend."""
        if self.deterministic or self.attention == "deterministic":
            return "deterministic"
        if self.attention == "auto":
            return "xla" if jax.default_backend() == "cpu" else "pallas"
        return self.attention

    @staticmethod
    def add_cli_args(parser, attention: bool = True) -> None:
        if attention:
            parser.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto",
                                help="attention for decode/verify steps: the fused Pallas kernel on GPUs (auto), or XLA")
        parser.add_argument("--deterministic", action="store_true",
                            help="deterministic mode: every prompt's tokens depend on that prompt alone, bit for bit, "
                                 "in any dtype (alone or in any batch, plain or speculative; chains only; "
                                 "docs/deterministic.md)")
        parser.add_argument("--warn-below-acceptance", type=float, default=DEFAULT_WARN_BELOW,
                            help=f"warn when the acceptance rate falls below this (default {DEFAULT_WARN_BELOW})")
        parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                            help="prefill every prompt whole, rather than shared prefixes once (for comparison: "
                                 "the output is the same)")
        parser.add_argument("--prefix-cache-tokens", type=int, default=PREFIX_CACHE_TOKENS,
                            help="the most cache the shared prefixes may hold, in tokens (default "
                                 f"{PREFIX_CACHE_TOKENS}); those that spare most are kept")
        parser.add_argument("--adaptive-k", action="store_true",
                            help="choose K (0 = plain) as the job runs, from --num-draft-tokens halved down to 0, by "
                                 "round costs timed at the start and the acceptance so far (continuous scheduler)")

    @classmethod
    def from_cli(cls, args) -> "RunOptions":
        return cls(getattr(args, "attention", "auto"), args.deterministic, args.warn_below_acceptance, args.prefix_cache,
                   args.prefix_cache_tokens, args.adaptive_k)

    def updated(self, values: dict) -> "RunOptions":
        return dataclasses.replace(self, **values) if values else self


RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunOptions))
