"""HumanEval prompts (the benchmark's 164 Python function stubs) for benchmarks and checks."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from jaxspec.defaults import REPO_ROOT

# The repository's copy: <repo>/data/HumanEval.jsonl.gz (found from an editable install or a
# source checkout; pass `path` when the package is installed elsewhere).
DEFAULT_PATH = REPO_ROOT / "data" / "HumanEval.jsonl.gz"


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[str]:
    """The "prompt" field of each HumanEval record, in file order.

    path: a JSONL file, gzip-compressed when it ends in .gz; default DEFAULT_PATH.
    limit: keep only the first `limit` prompts (None: all of them).
    """
    path = Path(path) if path is not None else DEFAULT_PATH
    if not path.is_file():
        raise FileNotFoundError(f"HumanEval file {path} does not exist")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None; got {limit!r}")
    opener = gzip.open if path.suffix == ".gz" else open
    prompts: list[str] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(prompts) >= limit:
                break
            if not line.strip():
                continue
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a HumanEval record with a 'prompt' ({e})") from None
    return prompts
