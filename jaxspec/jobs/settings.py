"""A batch job's settings as values that check themselves: the per-record defaults, and how the
job runs (decode method, scheduler, canary, replicas, outputs). Every bad setting raises
InputError naming the field before any work is done."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxspec.checks import check_int, check_number, is_int, is_number
from jaxspec.decoding.method import DEFAULT_NUM_DRAFT, MAX_DRAFT_TOKENS
from jaxspec.decoding.trees import resolve_tree
from jaxspec.errors import InputError
from jaxspec.sampling_params import GREEDY, SamplingParams
from jaxspec.serving.options import RunOptions
from jaxspec.serving.runner import SCHEDULERS

AUTO_KS = (2, 3, 4)  # draft-model chain lengths the canary tries by default
AUTO_NGRAM_KS = (4, 8)  # n-gram lookup lengths the canary tries by default


def check_sample(sample) -> float | int:
    """The canary's sample: a fraction (float in (0, 1]) or a record count (int >= 1)."""
    if not (is_number(sample) and isinstance(sample, float)) and not is_int(sample):
        raise InputError(f"auto_sample must be a fraction in (0, 1] or a count >= 1; got {sample!r}")
    if isinstance(sample, float):
        return check_number(sample, "auto_sample as a fraction", "in (0, 1]", lambda x: 0 < x <= 1)
    return check_int(sample, "auto_sample as a count", 1, allowed=">= 1")


def _ks(values, field: str) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InputError(f"{field} must be a list of integers in [1, {MAX_DRAFT_TOKENS}]; got {values!r}")
    return tuple(check_int(k, f"{field} entry", 1, MAX_DRAFT_TOKENS) for k in values)


def _path_or_flag(value, field: str):
    if value is not None and not isinstance(value, (bool, str, Path)):
        raise InputError(f"{field} must be a path, True (the default path) or None (none); got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """How a batch job runs; see jaxspec.jobs.job.run_job.

    num_draft_tokens: K for the job's draft (a draft model's chain, or n-gram lookup).
    sampling: the jaxspec.SamplingParams of records that give none of their own (a record's own
    settings are put over it); default: greedy, 128 tokens, seed 0.
    options: the run options (jaxspec.serving.options.RunOptions: deterministic,
    warn_below_acceptance); a job's attention is always "auto".
    Shorthand keywords set one field of those: max_new_tokens, temperature, top_k, top_p, min_p,
    seed (sampling); deterministic, warn_below_acceptance, prefix_cache, adaptive_k (options:
    adaptive_k chooses K as the continuous scheduler refills, serving/adaptive_k.py).
    batch_size: records decoded at once: slots of the continuous scheduler, rows of a static batch.
    scheduler: "continuous" refills a slot as soon as its record finishes, writing the records
    that finished at each return to the host in one durable write; "static" runs padded batches
    of similar records until each batch's longest ends (one durable write per batch).
    refill_at: continuous slots freed before new records are let in (default:
    jaxspec.serving.continuous.default_refill_at).
    auto: the canary (jaxspec.jobs.canary) times plain decoding, the draft model at each K in
    auto_ks and each named tree in auto_trees, and n-gram lookup at each K in auto_ngram_ks, on a
    sample (auto_sample: a fraction in (0, 1], at least 8 records and two batches, or a count),
    best of auto_repeats passes; speculation is chosen only when auto_min_speedup times faster.
    With options.deterministic each record's tokens depend on that record alone, bit for bit,
    whatever the batch size, scheduler or drafter (docs/deterministic.md); the canary then tries
    no trees.
    workers: model replicas; more than 1 runs them as Ray actors (the `distributed` extra), each
    with gpus_per_worker GPUs (default: the target's tensor_parallel on GPUs, none on the CPU),
    on a local Ray instance or the cluster at ray_address ("auto", "HOST:PORT").
    metrics_log / plot_path: True for OUT.metrics.jsonl / OUT.png, a path, or None to skip;
    summary_path: default OUT.summary.json. progress: a tqdm bar on stderr.
    """

    num_draft_tokens: int = DEFAULT_NUM_DRAFT
    sampling: SamplingParams = GREEDY
    options: RunOptions = RunOptions()
    batch_size: int = 8
    scheduler: str = "continuous"
    refill_at: int | None = None
    auto: bool = False
    auto_sample: float | int = 0.05
    auto_ks: tuple[int, ...] = AUTO_KS
    auto_trees: tuple[str, ...] = ()
    auto_ngram_ks: tuple[int, ...] = AUTO_NGRAM_KS
    auto_repeats: int = 2
    auto_min_speedup: float = 1.05
    workers: int = 1
    gpus_per_worker: float | None = None
    ray_address: str | None = None
    metrics_log: str | Path | bool | None = True
    summary_path: str | Path | None = None
    plot_path: str | Path | bool | None = True
    progress: bool = True
    # shorthand keywords, folded into `sampling` and `options` (None afterwards)
    max_new_tokens: dataclasses.InitVar[int | None] = None
    temperature: dataclasses.InitVar[float | None] = None
    top_k: dataclasses.InitVar[int | None] = None
    top_p: dataclasses.InitVar[float | None] = None
    min_p: dataclasses.InitVar[float | None] = None
    seed: dataclasses.InitVar[int | None] = None
    deterministic: dataclasses.InitVar[bool | None] = None
    warn_below_acceptance: dataclasses.InitVar[float | None] = None
    prefix_cache: dataclasses.InitVar[bool | None] = None
    adaptive_k: dataclasses.InitVar[bool | None] = None

    def __post_init__(self, max_new_tokens, temperature, top_k, top_p, min_p, seed, deterministic,
                      warn_below_acceptance, prefix_cache, adaptive_k):
        check_int(self.num_draft_tokens, "num_draft_tokens", 1, MAX_DRAFT_TOKENS)
        if not isinstance(self.sampling, SamplingParams):
            raise InputError(f"sampling must be a jaxspec.SamplingParams; got {self.sampling!r}")
        if not isinstance(self.options, RunOptions):
            raise InputError(f"options must be a RunOptions; got {self.options!r}")
        given = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                     seed=seed)
        object.__setattr__(self, "sampling", self.sampling.updated({k: v for k, v in given.items() if v is not None}))
        run = dict(deterministic=deterministic, warn_below_acceptance=warn_below_acceptance, prefix_cache=prefix_cache,
                   adaptive_k=adaptive_k)
        object.__setattr__(self, "options", self.options.updated({k: v for k, v in run.items() if v is not None}))
        if self.options.attention != "auto":
            raise InputError(f"a batch job's attention is auto (the fused kernel on GPUs); got {self.options.attention!r}")
        check_int(self.batch_size, "batch_size", 1)
        if self.scheduler not in SCHEDULERS:
            raise InputError(f"scheduler must be one of {', '.join(SCHEDULERS)}; got {self.scheduler!r}")
        if self.options.adaptive_k and self.scheduler != "continuous":
            raise InputError("adaptive_k chooses K as the continuous scheduler refills its slots; "
                             f"scheduler is {self.scheduler!r}")
        if self.refill_at is not None:
            check_int(self.refill_at, "refill_at", 1)
        for name in ("auto", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be True or False; got {getattr(self, name)!r}")
        check_sample(self.auto_sample)
        object.__setattr__(self, "auto_ks", _ks(self.auto_ks, "auto_ks"))
        object.__setattr__(self, "auto_ngram_ks", _ks(self.auto_ngram_ks, "auto_ngram_ks"))
        if isinstance(self.auto_trees, str):
            raise InputError(f"auto_trees must be a list of tree names; got {self.auto_trees!r}")
        object.__setattr__(self, "auto_trees", tuple(self.auto_trees))
        if self.options.deterministic and self.auto_trees:
            raise InputError(f"auto_trees must be empty with deterministic (it verifies chains only); "
                             f"got {list(self.auto_trees)}")
        for name in self.auto_trees:
            resolve_tree(name)
        check_int(self.auto_repeats, "auto_repeats", 1)
        check_number(self.auto_min_speedup, "auto_min_speedup", "a number > 0", lambda x: x > 0)
        check_int(self.workers, "workers", 1)
        if self.gpus_per_worker is not None:
            check_number(self.gpus_per_worker, "gpus_per_worker", "a number >= 0", lambda x: x >= 0)
        if self.ray_address is not None and not isinstance(self.ray_address, str):
            raise InputError(f"ray_address must be a string (auto or HOST:PORT); got {self.ray_address!r}")
        _path_or_flag(self.metrics_log, "metrics_log")
        _path_or_flag(self.plot_path, "plot_path")
        if self.summary_path is not None and not isinstance(self.summary_path, (str, Path)):
            raise InputError(f"summary_path must be a path or None; got {self.summary_path!r}")

    def paths(self, out_path: Path) -> dict[str, Path | None]:
        """Where the summary, plot and metrics log go for output OUT.jsonl (None: not written)."""
        stem = out_path.with_suffix("") if out_path.suffix else out_path
        chosen = lambda value, default: default if value is True else (Path(value) if value else None)  # noqa: E731
        return {
            "summary": Path(self.summary_path) if self.summary_path else Path(f"{stem}.summary.json"),
            "plot": chosen(self.plot_path, Path(f"{stem}.png")),
            "metrics_log": chosen(self.metrics_log, Path(f"{stem}.metrics.jsonl")),
        }
