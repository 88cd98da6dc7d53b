"""Batch-job execution on this process's devices: continuous slots (records handed back as they
finish) or static batches of one prompt-length bucket, budget bucket and greedy-ness. A Ray
replica (jaxspec.jobs.ray_workers) runs its chunks through here too."""

from __future__ import annotations

from jaxspec.decoding.method import DecodeMethod
from jaxspec.jobs.records import Record
from jaxspec.serving.batching import bucket
from jaxspec.serving.requests import samples
from jaxspec.serving.runner import run


def plan_chunks(records: list[Record], batch_size: int) -> list[list[Record]]:
    """Device batches: records of one prompt-length bucket, budget bucket and greedy-ness, of at
    most batch_size rows (a record takes a row per sample, SamplingParams.n; one of more samples
    than batch_size fills batches of its own). A chunk never spans buckets, so a job pads little;
    each bucket pair is one graph, all compiled up front in parallel (jaxspec.serving.static)."""
    def shape(r: Record):
        q = r.request
        return bucket(len(q.token_ids)), bucket(q.max_new_tokens), not q.sampling.greedy

    groups: dict[tuple, list[Record]] = {}
    for r in sorted(records, key=lambda r: (shape(r), len(r.request.token_ids), r.line)):
        groups.setdefault(shape(r), []).append(r)
    chunks = []
    for group in groups.values():
        chunk, rows = [], 0
        for r in group:
            if chunk and rows + r.request.sampling.n > batch_size:
                chunks.append(chunk)
                chunk, rows = [], 0
            chunk.append(r)
            rows += r.request.sampling.n
        chunks.append(chunk)
    return chunks


def run_local(target, draft, todo: list[Record], settings, method: DecodeMethod, emit) -> None:
    """Serves `todo` by `method` with settings.scheduler at settings.batch_size; emit(records,
    completions, decode_s, compile_s, worker=None) as records finish, completions[i] the list of
    records[i]'s SamplingParams.n samples in index order (a record is handed back once all are done)."""
    rows = [(i, sample) for i, r in enumerate(todo) for sample in samples(r.request)]
    waiting: dict[int, list] = {}  # record -> its samples done so far
    spent = [0.0, 0.0]  # decode and compile seconds not yet reported with a finished record

    def on_done(pairs, decode_s, compile_s):
        spent[0] += decode_s
        spent[1] += compile_s
        done = []
        for row, completion in pairs:
            i = rows[row][0]
            got = waiting.setdefault(i, [])
            got.append(completion)
            if len(got) == todo[i].request.sampling.n:
                done.append(i)
        if done:
            emit([todo[i] for i in done], [sorted(waiting.pop(i), key=lambda c: c.index) for i in done], *spent, None)
            spent[:] = [0.0, 0.0]

    options = dict(attention=settings.options.attention_impl,  # the fused kernel on GPUs (XLA's on the CPU)
                   prefix_cache=settings.options.prefix_cache, prefix_cache_tokens=settings.options.prefix_cache_tokens,
                   on_done=on_done, adaptive_k=settings.options.adaptive_k)
    requests = [sample for _, sample in rows]
    if settings.scheduler == "continuous":
        run(target, requests, settings.batch_size, method, draft, scheduler="continuous", refill_at=settings.refill_at,
            **options)
        return
    first_row: dict[int, int] = {}
    for row, (i, _) in enumerate(rows):
        first_row.setdefault(i, row)
    index = {id(r): i for i, r in enumerate(todo)}
    groups = []
    for chunk in plan_chunks(todo, settings.batch_size):
        chunk_rows = [first_row[index[id(r)]] + k for r in chunk for k in range(r.request.sampling.n)]
        groups += [chunk_rows[j : j + settings.batch_size] for j in range(0, len(chunk_rows), settings.batch_size)]
    run(target, requests, settings.batch_size, method, draft, groups=groups, **options)
