"""One checker for every integer and number setting: the error names the field and what is allowed."""

from __future__ import annotations

import argparse
import math
import numbers

from jaxspec.errors import InputError


def is_int(x) -> bool:
    """An integer, bools excluded (True is an int in Python, never a sensible count)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_number(x) -> bool:
    """A finite real number, bools excluded."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _range(lo, hi, allowed: str | None) -> str:
    if allowed:
        return allowed
    if hi is None:
        return f">= {lo}"
    return f"in [{lo}, {hi}]"


def check_int(value, field: str, lo: int | None = None, hi: int | None = None, *,
              allowed: str | None = None, note: str = "", error=InputError) -> int:
    """`value` as an int when it is an integer in [lo, hi] (either bound may be None); otherwise
    `error` with "FIELD must be an integer >= LO; got VALUE" (or `allowed` in place of the range)."""
    if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        what = _range(lo, hi, allowed) if (lo is not None or allowed) else ""
        raise error(f"{field} must be an integer{' ' + what if what else ''}{note}; got {value!r}")
    return int(value)


def check_number(value, field: str, allowed: str, ok=lambda x: True, error=InputError) -> float:
    """`value` as a float when it is a finite number for which ok(value) holds; otherwise `error`
    with "FIELD must be ALLOWED; got VALUE"."""
    if not is_number(value) or not ok(value):
        raise error(f"{field} must be {allowed}; got {value!r}")
    return float(value)


def int_list(text: str) -> list[int]:
    """A command-line list "2,3,4" of integers >= 1 (argparse type)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def int_list_or_none(text: str) -> list[int]:
    """int_list, or [] for an empty string (argparse type)."""
    return int_list(text) if text.strip() else []
