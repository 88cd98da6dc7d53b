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

from jaxspec.errors import InputError
from jaxspec.jobs.local import run_local
from jaxspec.model.loading import Model, load

CHUNKS_PER_WORKER_BATCH = 4  # records per chunk = this x batch_size: slots stay busy, a lost chunk stays small


class Replica:
    """One worker: the target (and draft) loaded in its own process, on its own devices."""

    def __init__(self, target: dict, draft):
        self.target = load(**target)
        self.draft = load(**draft) if isinstance(draft, dict) else draft

    def run(self, key: int, records: list, settings, method):
        """-> (key, completions in the order of `records`, decode_s, compile_s, worker pid)."""
        where = {id(r): i for i, r in enumerate(records)}
        out, spent = [None] * len(records), [0.0, 0.0]

        def collect(done, completions, decode_s, compile_s, worker):
            for r, c in zip(done, completions):
                out[where[id(r)]] = c
            spent[0] += decode_s
            spent[1] += compile_s

        run_local(self.target, self.draft, records, settings, method, collect)
        return key, out, spent[0], spent[1], os.getpid()


def _spec(model) -> dict:
    """load()'s arguments that give a replica the driver's `model` again (its 8 bits too)."""
    return {"path": str(model.path), "dtype": model.dtype.name, "tensor_parallel": model.tensor_parallel,
            "expert_parallel": model.expert_parallel, "quantize": model.quantize}


def check_ray() -> None:
    """InputError unless Ray is installed (more than one worker runs the replicas on it)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise InputError("workers > 1 runs replicas on Ray: pip install 'jaxspec[distributed]'") from None


def run_on_ray(target, draft, todo: list, settings, method, emit) -> None:
    """Serves `todo` (Records) by `method` (a DecodeMethod) on settings.workers replicas, on the
    Ray cluster at settings.ray_address or a local instance; emit(records, completions, decode_s,
    compile_s, worker) for each chunk as it comes back."""
    import ray
    from ray.util import ActorPool

    address = settings.ray_address
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

    def submit(a, key):
        return a.run.remote(key, chunks[key], settings, method)

    try:
        for key, completions, decode_s, compile_s, worker in pool.map_unordered(submit, range(len(chunks))):
            emit(chunks[key], completions, decode_s, compile_s, worker)
    finally:
        if started:  # the local instance this job started ends with it
            ray.shutdown()
