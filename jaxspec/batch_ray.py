"""Batch jobs over Ray: model replicas as Ray actors, fed chunks of records; the driver stays the
one writer, so the crash-safety rules of a local job hold unchanged.

Ray's own machinery does the rest: each replica is an actor with unlimited restarts and task
retries (`max_restarts=-1, max_task_retries=-1`), so a replica that dies mid-chunk is restarted
(reloading its models) and the chunk is served again; `ActorPool.map_unordered` keeps every
replica busy and hands chunks back as they finish. A chunk's lines are written only when its
result reaches the driver, so no record is written twice. Ray is imported only here (the
`distributed` extra).
"""

from __future__ import annotations

import os

CHUNKS_PER_WORKER_BATCH = 4  # records per chunk = this x batch_size: slots stay busy, a lost chunk stays small


class Replica:
    """One worker: the target (and draft) loaded in its own process, on its own devices."""

    def __init__(self, target: dict, draft):
        import jaxspec

        self.target = jaxspec.load(target["path"], dtype=target["dtype"], tensor_parallel=target["tensor_parallel"])
        self.draft = draft if not isinstance(draft, dict) else jaxspec.load(
            draft["path"], dtype=draft["dtype"], tensor_parallel=draft["tensor_parallel"])

    def pid(self) -> int:
        return os.getpid()

    def run(self, key: int, requests, batch_size: int, num_draft: int, tree, ngram, scheduler: str, refill_at):
        """-> (key, completions, decode_s, compile_s, worker pid): the key names the chunk."""
        from jaxspec.generate import resolve_attention
        from jaxspec.runner import run
        from jaxspec.trees import resolve_tree

        draft = (ngram or self.draft) if num_draft else None
        outs = run(self.target, requests, batch_size, draft=draft, num_draft=num_draft,
                   tree=resolve_tree(tree) if tree else None, attention=resolve_attention("auto"),
                   scheduler=scheduler, refill_at=refill_at)
        return key, list(outs), outs.metrics.decode_s, outs.metrics.compile_s, os.getpid()


def _spec(model) -> dict:
    return {"path": str(model.path), "dtype": model.dtype.name, "tensor_parallel": model.tensor_parallel}


def run_on_ray(target, draft, todo: list, settings, method: tuple, emit, address: str | None = None) -> None:
    """Serves `todo` (Records) on settings.workers replicas; emit(records, completions, decode_s,
    compile_s, worker) for each chunk as it comes back. method: (num_draft, tree, ngram)."""
    import ray
    from ray.util import ActorPool

    from jaxspec.loading import Model

    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                 **({} if address else {"num_cpus": max(os.cpu_count() or 1, settings.workers)}))
    gpus = settings.gpus_per_worker
    actor = ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=1, num_gpus=gpus)(Replica)
    draft_spec = _spec(draft) if isinstance(draft, Model) else draft
    pool = ActorPool([actor.remote(_spec(target), draft_spec) for _ in range(settings.workers)])
    size = CHUNKS_PER_WORKER_BATCH * settings.batch_size
    chunks = [todo[i : i + size] for i in range(0, len(todo), size)]
    num_draft, tree, ngram = method

    def submit(a, key):
        return a.run.remote(key, [r.request for r in chunks[key]], settings.batch_size, num_draft, tree, ngram,
                            settings.scheduler, settings.refill_at)

    try:
        for key, completions, decode_s, compile_s, worker in pool.map_unordered(submit, range(len(chunks))):
            emit(chunks[key], completions, decode_s, compile_s, worker)
    finally:
        if started:  # the local instance this job started ends with it
            ray.shutdown()
