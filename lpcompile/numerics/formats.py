"""Binary floating-point formats that values can be quantized to.

A :class:`FloatFormat` describes a sign/exponent/mantissa format by its bit
counts, its exponent bias and how it spends its top exponent code:

* ``"ieee"``: the top exponent code holds inf and NaN (E5M2, FP16, BF16);
* ``"fn"``: no inf; the top exponent code holds finite values except the
  all-ones mantissa, which is NaN (OCP E4M3, torch's ``float8_e4m3fn``);
* ``"finite"``: every code is a finite number (the OCP MX FP6/FP4 formats,
  ``ml_dtypes``' ``float6_e3m2fn``/``float4_e2m1fn``).

Every format here has IEEE-style subnormals and fits inside FP32, so each of
its values is exactly an FP32 value.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

import torch

Special = Literal["ieee", "fn", "finite"]

_NAMED = {
    "e5m2": (5, 2, "ieee"),
    "e4m3": (4, 3, "fn"),
    "e4m3fn": (4, 3, "fn"),
    "fp16": (5, 10, "ieee"),
    "bf16": (8, 7, "ieee"),
    "fp32": (8, 23, "ieee"),
}
_GENERIC = re.compile(r"^e(\d+)m(\d+)(fn|-ieee|-finite)?(?:-bias(-?\d+))?$")
_SUFFIX_SPECIAL = {None: "ieee", "-ieee": "ieee", "fn": "fn", "-finite": "finite"}
VALID_NAMES = (
    "e5m2, e4m3 (alias e4m3fn), fp16, bf16, fp32, 'eXmY' (IEEE inf/NaN), 'eXmYfn' "
    "(no inf, all-ones is NaN) or 'eXmY-finite' (no inf/NaN) with X in 2..8 and Y in 0..23, "
    "optionally followed by '-biasB' for a non-default exponent bias "
    "('eXmY-ieee' names the IEEE variant where 'eXmY' is taken, as e4m3 is)"
)


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format with IEEE-style subnormals."""

    exp_bits: int
    man_bits: int
    bias: int | None = None
    special: Special = "ieee"

    def __post_init__(self) -> None:
        if not 2 <= self.exp_bits <= 8:
            raise ValueError(f"exp_bits must be in 2..8, got {self.exp_bits}")
        if not 0 <= self.man_bits <= 23:
            raise ValueError(f"man_bits must be in 0..23, got {self.man_bits}")
        if self.special not in ("ieee", "fn", "finite"):
            raise ValueError(f"special must be 'ieee', 'fn' or 'finite', got {self.special!r}")
        if self.special == "fn" and self.man_bits == 0:
            raise ValueError("an 'fn' format needs at least one mantissa bit (all-ones is NaN)")
        if self.bias is None:
            object.__setattr__(self, "bias", (1 << (self.exp_bits - 1)) - 1)
        if self.min_exp < -126 or self.min_exp - self.man_bits < -149:
            raise ValueError(f"{self.name}: subnormals below FP32's range (bias {self.bias})")
        if self.max_exp > 127:
            raise ValueError(f"{self.name}: values beyond FP32's range (bias {self.bias})")
        if self.min_exp - self.man_bits > 104:  # rounding adds 2**(spacing + 23) in FP32
            raise ValueError(f"{self.name}: subnormal spacing above 2**104 is unsupported (bias {self.bias})")

    @property
    def name(self) -> str:
        """A name that :func:`parse_format` maps back to this format."""
        default_bias = self.bias == (1 << (self.exp_bits - 1)) - 1
        for name, spec in _NAMED.items():
            if spec == (self.exp_bits, self.man_bits, self.special) and default_bias:
                return name
        base = f"e{self.exp_bits}m{self.man_bits}"
        if default_bias and self.special == "ieee" and base in _NAMED:
            return base + "-ieee"  # plain 'e4m3' is taken by the fn variant
        suffix = {"ieee": "", "fn": "fn", "finite": "-finite"}[self.special]
        return base + suffix + ("" if default_bias else f"-bias{self.bias}")

    @property
    def has_inf(self) -> bool:
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.special != "finite"

    @property
    def min_exp(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def max_exp(self) -> int:
        """Exponent of the largest finite number."""
        top = (1 << self.exp_bits) - 1
        return (top - 1 if self.special == "ieee" else top) - self.bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        lost = 1 if self.special == "fn" else 0  # fn: all-ones mantissa is NaN
        return math.ldexp(2.0 - math.ldexp(1.0, -self.man_bits) * (1 + lost), self.max_exp)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.min_exp)

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, self.min_exp - self.man_bits)

    def fits_in(self, dtype: torch.dtype) -> bool:
        """Whether every value of this format is exactly a value of ``dtype``."""
        other = from_dtype(dtype)
        return (
            self.man_bits <= other.man_bits
            and self.min_exp - self.man_bits >= other.min_exp - other.man_bits
            and self.max <= other.max
        )

    def __str__(self) -> str:
        return self.name


def parse_format(spec: str | FloatFormat) -> FloatFormat:
    """Return the format named by ``spec`` (or ``spec`` itself if it is one)."""
    if isinstance(spec, FloatFormat):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a format is a name or a FloatFormat, got {spec!r}; valid names: {VALID_NAMES}")
    key = spec.strip().lower()
    if key in _NAMED:
        exp_bits, man_bits, special = _NAMED[key]
        return FloatFormat(exp_bits, man_bits, special=special)
    match = _GENERIC.match(key)
    if match:
        exp_bits, man_bits = int(match[1]), int(match[2])
        bias = None if match[4] is None else int(match[4])
        if 2 <= exp_bits <= 8 and 0 <= man_bits <= 23:
            try:
                return FloatFormat(exp_bits, man_bits, bias, _SUFFIX_SPECIAL[match[3]])
            except ValueError as err:
                raise ValueError(
                    f"invalid float format {spec!r}: {err}; valid names: {VALID_NAMES}"
                ) from None
    raise ValueError(f"unknown float format {spec!r}; valid names: {VALID_NAMES}")


_DTYPE_FORMATS = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e5m2: "e5m2",
    torch.float8_e4m3fn: "e4m3",
}


def from_dtype(dtype: torch.dtype) -> FloatFormat:
    """The format of a torch floating dtype."""
    if dtype not in _DTYPE_FORMATS:
        raise ValueError(f"no FloatFormat for dtype {dtype}")
    return parse_format(_DTYPE_FORMATS[dtype])


def torch_dtype(fmt: FloatFormat) -> torch.dtype | None:
    """The torch dtype holding exactly this format, if torch has one."""
    for dtype, name in _DTYPE_FORMATS.items():
        if parse_format(name) == fmt:
            return dtype
    return None
