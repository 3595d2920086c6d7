"""Property tests of ``lpcompile.quantize`` (hypothesis) over random eXmY formats, shapes,
strides, dtypes, scales, seeds and offsets. A bounded number of examples runs in the fast
tier, more in the slow tier.

The oracle for small formats is the format's grid itself, listed value by value from its
definition (subnormal spacing, exponent range, largest finite value): each result must
be one of the two grid neighbours of its input, and rounding to nearest the nearer (ties
to the even mantissa)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lpcompile import FloatFormat, quantize

FAST, SLOW = 40, 400


def _grid(fmt: FloatFormat) -> torch.Tensor:
    """Every finite non-negative value of ``fmt``, ascending (float64)."""
    subnormals = [k * fmt.min_subnormal for k in range(2**fmt.man_bits)]
    normals = [
        (1 + m / 2**fmt.man_bits) * 2.0**e
        for e in range(fmt.min_exp, fmt.max_exp + 1)
        for m in range(2**fmt.man_bits)
    ]
    return torch.tensor(sorted(v for v in {*subnormals, *normals} if v <= fmt.max), dtype=torch.float64)


def _neighbours(x: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid values just below and just above |x| (equal where |x| is on the grid)."""
    mag = x.abs().double().clamp(max=grid[-1]).contiguous()  # searchsorted wants contiguous values
    hi = grid[torch.searchsorted(grid, mag, right=False).clamp(max=len(grid) - 1)]
    lo = grid[(torch.searchsorted(grid, mag, right=True) - 1).clamp(min=0)]
    return lo, hi


formats = st.builds(
    lambda e, m, special: (e, m, special),
    st.integers(2, 5),
    st.integers(0, 4),
    st.sampled_from(["ieee", "fn", "finite"]),
)
shapes = st.lists(st.integers(1, 9), min_size=1, max_size=3)


def _format(spec) -> FloatFormat:
    try:
        return FloatFormat(spec[0], spec[1], special=spec[2])
    except ValueError:
        assume(False)  # not a valid format (e.g. too few values for its special encodings)


def _input(shape, transpose: bool, dtype: torch.dtype, seed: int, fmt: FloatFormat) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * fmt.max / 4
    x = x.to(dtype)
    return x.transpose(0, -1) if transpose else x  # a strided view when it has 2+ dimensions


def check_rounding(spec, shape, transpose, dtype, seed, offset, stochastic) -> None:
    fmt = _format(spec)
    assume(fmt.fits_in(dtype))
    x = _input(shape, transpose, dtype, seed, fmt)
    rounding = "stochastic" if stochastic else "nearest"
    got = quantize(x, fmt, rounding, seed=seed, offset=offset)
    assert got.shape == x.shape and got.dtype == x.dtype
    lo, hi = _neighbours(x, _grid(fmt))
    mag = got.abs().double()
    assert ((mag == lo) | (mag == hi)).all(), f"{fmt.name}: not a neighbour of its input"
    assert (torch.sign(got) * torch.sign(x) >= 0).all()
    if stochastic:
        again = quantize(x, fmt, rounding, seed=seed, offset=offset)
        assert torch.equal(got, again), "the same seed and offset gave other bits"
        return
    # nearest: the nearer neighbour; at a tie, the one with an even mantissa
    below, above = x.abs().double() - lo, hi - x.abs().double()
    nearer = torch.where(below < above, lo, hi)
    tie = below == above
    assert (mag[~tie] == nearer[~tie]).all(), f"{fmt.name}: not the nearer neighbour"
    # monotone: sorting the input sorts the result
    flat, order = x.reshape(-1).double().sort()
    assert (got.reshape(-1)[order].double().diff() >= 0).all(), f"{fmt.name}: not monotone"
    assert torch.equal(quantize(got, fmt), got), "a rounded value moved when rounded again"


ARGS = dict(
    spec=formats,
    shape=shapes,
    transpose=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
    offset=st.integers(0, 2**32 - 1),
    stochastic=st.booleans(),
)


@settings(max_examples=FAST, deadline=None)
@given(**ARGS)
def test_rounding_properties(spec, shape, transpose, dtype, seed, offset, stochastic):
    check_rounding(spec, shape, transpose, dtype, seed, offset, stochastic)


@pytest.mark.slow
@settings(max_examples=SLOW, deadline=None)
@given(**ARGS)
def test_rounding_properties_many(spec, shape, transpose, dtype, seed, offset, stochastic):
    check_rounding(spec, shape, transpose, dtype, seed, offset, stochastic)


@settings(max_examples=FAST, deadline=None)
@given(
    shape=shapes,
    scale_exp=st.integers(-20, 20),
    name=st.sampled_from(["e5m2", "e4m3"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_nearest_equals_torchs_cast_with_scales(shape, scale_exp, name, seed):
    """``quantize(x, scale=s)`` is torch's float8 cast of ``x*s``, divided by ``s``, for a
    power-of-two ``s`` (exact); E4M3 saturates, as torch's cast does; E5M2's overflow
    goes to inf, as torch's cast does."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2.0**-scale_exp
    scale = 2.0**scale_exp
    dtype, overflow = (torch.float8_e5m2, "inf") if name == "e5m2" else (torch.float8_e4m3fn, "saturate")
    scaled = x * scale
    if name == "e4m3":
        scaled = scaled.clamp(-448, 448)  # torch's e4m3fn cast gives NaN beyond its range
    want = scaled.to(dtype).to(torch.float32) / scale
    assert torch.equal(quantize(x, name, scale=scale, overflow=overflow), want)


@settings(max_examples=FAST, deadline=None)
@given(
    shape=shapes,
    magnitude_exp=st.integers(-40, 30),
    name=st.sampled_from(["e5m2", "e4m3"]),
    pow2=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_tensorwise_equals_torchs_cast_of_the_scaled_tensor(shape, magnitude_exp, name, pow2, seed):
    """``quantize(x, scaling=...)`` is torch's float8 cast of ``x`` times torchao's factor,
    divided by it, at any magnitude (the 1e-12 floor on the largest magnitude included)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2.0**magnitude_exp
    dtype = torch.float8_e5m2 if name == "e5m2" else torch.float8_e4m3fn
    largest = torch.finfo(dtype).max
    scale = (largest / x.abs().max().double().clamp(min=1e-12)).float()
    if pow2:
        scale = 2.0 ** torch.floor(torch.log2(scale))
    want = (x * scale).clamp(-largest, largest).to(dtype).to(torch.float32) / scale
    scaling = "tensorwise_pow2" if pow2 else "tensorwise"
    assert torch.equal(quantize(x, name, scaling=scaling, overflow="inf"), want)
