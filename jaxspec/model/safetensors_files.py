"""Reading safetensors files: every tensor by name with its open file, and one tensor as stored;
a damaged file or tensor is a CheckpointError naming it. Shared by HF folders and EAGLE-3 heads."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jaxspec.errors import CheckpointError


def open_all(files: list[Path], framework: str) -> dict[str, tuple[Path, object]]:
    """tensor name -> (file, open handle)."""
    found: dict[str, tuple[Path, object]] = {}
    for path in files:
        try:
            handle = safe_open(str(path), framework=framework)
            names = list(handle.keys())
        except Exception as e:  # safetensors raises several types for a damaged header
            raise CheckpointError(f"cannot read safetensors file {path}: {e}") from None
        for name in names:
            if name in found:
                raise CheckpointError(f"tensor {name} appears in both {found[name][0].name} and {path.name}")
            found[name] = (path, handle)
    return found


def read_tensor(name: str, path: Path, handle) -> np.ndarray:
    """One tensor from an open safetensors file, as stored (HF layout and dtype); fp8 e4m3fn
    tensors (which numpy cannot hold) as their uint8 bits, memory-mapped."""
    try:
        if handle.get_slice(name).get_dtype() == FP8_E4M3:
            return _raw_bits(path, name)
        return handle.get_tensor(name)
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {name} from {path}: {e}") from None


FP8_E4M3 = "F8_E4M3"  # safetensors' name for float8 e4m3fn


@functools.lru_cache(maxsize=64)
def _header(path: Path) -> tuple[int, dict]:
    """(where the data starts, the header's tensor table) of a safetensors file."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def _raw_bits(path: Path, name: str) -> np.ndarray:
    start, table = _header(Path(path))
    begin, end = table[name]["data_offsets"]
    return np.memmap(path, np.uint8, "r", offset=start + begin, shape=(end - begin,)).reshape(table[name]["shape"])
