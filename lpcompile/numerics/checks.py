"""Argument checks shared by the public API: one message per kind of bad value.

Numbers are Python or NumPy numbers (``numbers.Real`` / ``numbers.Integral``);
``bool`` is refused where a number is meant, so ``True`` is never read as 1.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

FP32 = torch.finfo(torch.float32)


def is_real(value: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive(name: str, value: Any) -> None:
    """``value`` is a finite number > 0."""
    if not (is_real(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_nonnegative(name: str, value: Any) -> None:
    """``value`` is a finite number >= 0."""
    if not (is_real(value) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def check_fp32_scale(name: str, value: Any) -> None:
    """``value`` is > 0 and a normal FP32 number: its FP32 copy, and the reciprocal of
    that, are finite and not zero."""
    check_positive(name, value)
    if not FP32.tiny <= value <= FP32.max:
        raise ValueError(f"{name} must be a normal float32 number, in [2**-126, {FP32.max:.4g}]: {value!r}")


def check_count(name: str, value: Any) -> None:
    """``value`` is an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
