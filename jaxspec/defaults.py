"""Where the embedded default models live.

The repository ships the real code models in Hugging Face format under checkpoints/hf/; `make
demo` converts them to Orbax checkpoints under checkpoints/. Loading prefers the converted copy.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = REPO_ROOT / "checkpoints"
DEFAULT_TARGET = "code-target-16m"
DEFAULT_DRAFT = "code-draft-4m"
DEFAULT_EAGLE = "code-eagle-16m"  # an EAGLE-3 head for the target (scripts/train_eagle.py)


def embedded_model(name: str) -> Path:
    """The converted checkpoint checkpoints/NAME if present, else the HF copy checkpoints/hf/NAME."""
    converted = CHECKPOINTS / name
    return converted if (converted / "jaxspec.json").is_file() else CHECKPOINTS / "hf" / name
