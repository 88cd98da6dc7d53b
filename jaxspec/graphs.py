"""Compiled graphs, kept by whoever runs them: a bounded LRU cache with hit and miss counts.

Every loaded Model carries one (`model.graphs`), which generate(), batch jobs and the canary use
unless given another. Bounded because each XLA executable holds memory and memory maps: a
long-lived process that compiled every shape it met reached Linux's 65,530 maps per process."""

from __future__ import annotations

import collections
import threading
import time

import jax

from jaxspec.checks import check_int

DEFAULT_MAX_GRAPHS = 32  # a job compiles a handful; a server meets a few buckets of each


class GraphCache:
    """key -> compiled executable, least recently used evicted past `max_graphs`."""

    def __init__(self, max_graphs: int = DEFAULT_MAX_GRAPHS):
        self.max_graphs = check_int(max_graphs, "max_graphs", 1)
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0
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
        start = time.perf_counter()
        exe = lower().compile()
        spent = time.perf_counter() - start
        with self._lock:
            self.misses += 1
            self.compile_s += spent
            self._graphs[key] = exe
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
                self.evictions += 1
        return exe, spent

    def executable(self, fn, static: dict, *args) -> tuple[object, float]:
        """get() for the jitted `fn` at these arguments (their structure, shapes and dtypes) and
        static arguments."""
        shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves(args))
        key = (fn, tuple(sorted(static.items())), jax.tree.structure(args), shapes)
        return self.get(key, lambda: fn.lower(*args, **static))

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()

    def counts(self) -> dict:
        return {"graphs": len(self), "max_graphs": self.max_graphs, "hits": self.hits, "misses": self.misses,
                "evictions": self.evictions, "compile_s": self.compile_s}
