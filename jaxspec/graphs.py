"""Compiled graphs, kept by whoever runs them: a bounded LRU cache with hit and miss counts.

Every loaded Model carries one (`model.graphs`), which generate(), batch jobs and the canary use
unless given another. Bounded because each XLA executable holds memory and memory maps: a
long-lived process that compiled every shape it met reached Linux's 65,530 maps per process."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
import time

import jax

from jaxspec import compile_cache
from jaxspec.checks import check_int

DEFAULT_MAX_GRAPHS = 32  # a job compiles a handful; a server meets a few buckets of each


class GraphCache:
    """key -> compiled executable, least recently used evicted past `max_graphs`."""

    def __init__(self, max_graphs: int = DEFAULT_MAX_GRAPHS):
        self.max_graphs = check_int(max_graphs, "max_graphs", 1)
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = self.disk_hits = 0
        self.compile_s = 0.0

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, key, lower) -> tuple[object, float]:
        """(the executable for `key`, seconds spent compiling it now: 0.0 on a hit). lower() gives
        the jax Lowered to compile on a miss."""
        with self._lock:
            if key in self._graphs:
                self._graphs.move_to_end(key)
                self.hits += 1
                return self._graphs[key], 0.0
        start, disk_before = time.perf_counter(), compile_cache.hits()
        exe = lower().compile()
        spent = time.perf_counter() - start
        self._store({key: exe}, spent, compile_cache.hits() - disk_before)
        return exe, spent

    def _store(self, compiled: dict, spent: float, disk_hits: int) -> None:
        """Keeps newly compiled graphs (disk_hits of them read back from the persistent cache),
        evicting the least recently used past max_graphs."""
        with self._lock:
            self.misses += len(compiled)
            self.disk_hits += min(len(compiled), disk_hits)
            self.compile_s += spent
            for key, exe in compiled.items():
                self._graphs[key] = exe
                self._graphs.move_to_end(key)
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
                self.evictions += 1

    @staticmethod
    def key(fn, static: dict, *args) -> tuple:
        """What tells one graph of the jitted `fn` from another: its static arguments and its
        arguments' structure, shapes and dtypes."""
        shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves(args))
        return fn, tuple(sorted(static.items())), jax.tree.structure(args), shapes

    def executable(self, fn, static: dict, *args) -> tuple[object, float]:
        """get() for the jitted `fn` at these arguments and static arguments."""
        return self.get(self.key(fn, static, *args), lambda: fn.lower(*args, **static))

    def precompile(self, calls, workers: int | None = None) -> tuple[float, list]:
        """Compiles every (fn, static, args) of `calls` not held yet, in parallel threads (XLA
        releases the GIL while it compiles; tracing stays on this thread). Returns (the seconds
        spent, which count as compile time; the executable of each call, in order: a graph held
        already counts as a hit, once)."""
        start, disk_before = time.perf_counter(), compile_cache.hits()
        keys = [self.key(fn, static, *args) for fn, static, args in calls]
        todo: dict = {}
        for key, (fn, static, args) in zip(keys, calls):
            if key not in self._graphs and key not in todo and len(todo) < self.max_graphs:
                todo[key] = fn.lower(*args, **static)
        with self._lock:
            held = {key: self._graphs[key] for key in keys if key in self._graphs}
            for key in held:
                self._graphs.move_to_end(key)
            self.hits += len(held)
        if not todo:
            return 0.0, [held.get(key) for key in keys]
        workers = workers or min(len(todo), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            compiled = dict(zip(todo, pool.map(lambda lowered: lowered.compile(), todo.values())))
        spent = time.perf_counter() - start
        self._store(compiled, spent, compile_cache.hits() - disk_before)
        return spent, [held.get(key, compiled.get(key)) for key in keys]

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()

    def counts(self) -> dict:
        return {"graphs": len(self), "max_graphs": self.max_graphs, "hits": self.hits, "misses": self.misses,
                "disk_hits": self.disk_hits, "evictions": self.evictions, "compile_s": self.compile_s}
