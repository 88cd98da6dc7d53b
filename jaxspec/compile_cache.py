"""The persistent compilation cache: compiled graphs kept on disk across runs, on by default.

A second run of the same job reads its graphs back instead of compiling them. The folder is,
in order: what `enable(path)` is given (the CLI's --compile-cache), the environment variable
JAXSPEC_COMPILE_CACHE, or ~/.cache/jaxspec/xla ($XDG_CACHE_HOME respected); "off" in either
place disables it, and a folder the user gave JAX directly (jax_compilation_cache_dir) is left
alone. The cache is size-bounded, which makes JAX take a file lock around every read and write:
several processes can share one folder without reading an entry another is still writing.
Benchmarks that report first-call compile times turn it off (`disable`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

ENV = "JAXSPEC_COMPILE_CACHE"
OFF = ("off", "0", "none", "false", "")
MAX_BYTES = 8 << 30  # evicted least recently used past this (and so locked: see above)

_hits = 0
_hits_lock = threading.Lock()
_listening = False
_decided = False  # enable() or disable() ran: later enable() calls without a path keep that choice


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxspec" / "xla"


def resolve(path: str | os.PathLike | None = None) -> Path | None:
    """The folder to use (None: off), from `path`, then $JAXSPEC_COMPILE_CACHE, then the default."""
    chosen = os.fspath(path) if path is not None else os.environ.get(ENV)
    if chosen is None:
        return default_dir()
    return None if chosen.strip().lower() in OFF else Path(chosen).expanduser()


def _count_hit(event: str, **kwargs) -> None:
    global _hits
    if event == "/jax/compilation_cache/cache_hits":
        with _hits_lock:
            _hits += 1


def hits() -> int:
    """Graphs read back from the disk cache in this process so far."""
    return _hits


def enable(path: str | os.PathLike | None = None) -> Path | None:
    """Turns the cache on at `path`, or with no path at the folder the module's doc names unless
    this process already chose (an earlier enable or disable, or a folder set on JAX directly);
    returns the folder in force, or None when off. jaxspec.load calls it, so every model that
    generate() or a batch job runs was loaded with the cache decided."""
    global _decided, _listening
    if not _listening:
        jax.monitoring.register_event_listener(_count_hit)
        _listening = True
    current = jax.config.jax_compilation_cache_dir
    if path is None and (_decided or current is not None):
        _decided = True
        return None if current is None else Path(current)
    folder = resolve(path)
    _decided = True
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    _apply(folder)
    return folder


def disable() -> None:
    """No persistent cache in this process from here on (a benchmark's first-call compiles)."""
    global _decided
    _decided = True
    _apply(None)


def _apply(folder: Path | None) -> None:
    if folder is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small graphs pay too
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    new = None if folder is None else str(folder)
    if jax.config.jax_compilation_cache_dir != new:
        # JAX opens its cache once, at the first compile after a folder is set: drop the open one.
        jax.config.update("jax_compilation_cache_dir", new)
        compilation_cache.reset_cache()
