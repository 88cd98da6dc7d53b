"""Batch-job execution on this process's devices: continuous slots (records handed back as they
finish) or static batches of one prompt-length bucket, budget bucket and greedy-ness. A Ray
replica (jaxspec.jobs.ray_workers) runs its chunks through here too."""

from __future__ import annotations

from jaxspec.decoding.method import DecodeMethod
from jaxspec.jobs.records import Record
from jaxspec.serving.batching import bucket
from jaxspec.serving.runner import run


def plan_chunks(records: list[Record], batch_size: int) -> list[list[Record]]:
    """Device batches: records of one prompt-length bucket, budget bucket and greedy-ness, split
    at batch_size. A chunk never spans buckets, so a job pads little; each bucket pair is one
    graph, all compiled up front in parallel (jaxspec.serving.static)."""
    def shape(r: Record):
        q = r.request
        return bucket(len(q.token_ids)), bucket(q.max_new_tokens), not q.sampling.greedy

    groups: dict[tuple, list[Record]] = {}
    for r in sorted(records, key=lambda r: (shape(r), len(r.request.token_ids), r.line)):
        groups.setdefault(shape(r), []).append(r)
    return [g[i : i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]


def run_local(target, draft, todo: list[Record], settings, method: DecodeMethod, emit) -> None:
    """Serves `todo` by `method` with settings.scheduler at settings.batch_size; emit(records,
    completions, decode_s, compile_s, worker=None) as records finish."""
    attention = settings.options.attention_impl  # the fused kernel on GPUs (XLA's on the CPU)
    prefix_cache = settings.options.prefix_cache
    if settings.scheduler == "continuous":
        def on_done(pairs, decode_s, compile_s):  # rows written as they finish, a return to the host at a time
            emit([todo[i] for i, _ in pairs], [c for _, c in pairs], decode_s, compile_s, None)

        run(target, [r.request for r in todo], settings.batch_size, method, draft, attention=attention,
            scheduler="continuous", refill_at=settings.refill_at, on_done=on_done, prefix_cache=prefix_cache)
        return
    index = {id(r): i for i, r in enumerate(todo)}
    groups = [[index[id(r)] for r in chunk] for chunk in plan_chunks(todo, settings.batch_size)]

    def on_batch(pairs, decode_s, compile_s):
        emit([todo[i] for i, _ in pairs], [c for _, c in pairs], decode_s, compile_s, None)

    run(target, [r.request for r in todo], settings.batch_size, method, draft, attention=attention,
        on_done=on_batch, groups=groups, prefix_cache=prefix_cache)
