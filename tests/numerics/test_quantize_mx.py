"""MX scaling of the quantize operator (OCP microscaling: a power-of-two factor per block of
32 values along the last dimension), against torch's own float8 casts and torchao's ``to_mx``.

The reference is written here from the definitions of torchao's scale calculation modes:
``FLOOR`` (``scaling="mx"``, the OCP spec's) and ``CEIL`` (``"mx_ceil"``) take 2 to the
power of floor (ceil) of log2 of the block's largest magnitude, minus the exponent of the
element format's largest value, at least 2^-126; ``EVEN`` (``"mx_even"``) as ``FLOOR``, of
the largest magnitude first rounded to the element format's mantissa bits (half a step up);
``RCEIL`` (``"mx_rceil"``, cuBLAS's) 2 to
the power of ceil of log2 of that magnitude over the format's largest value (the quotient
in FP32), the exponent clamped to [-127, 127], and 1 where it is -127. The block divided by
it, clamped to the format's range, cast with ``Tensor.to(float8_*)``, multiplied back.
"""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config
from devices import TEST_DEVICE, assert_compiled_rounding

import lpcompile  # noqa: F401  (registers torch.ops.lowprec)
from lpcompile import quantize

F8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MAX_EXP = {"e4m3": 8, "e5m2": 15}  # 448 = 1.75 * 2^8, 57344 = 1.75 * 2^15
MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}


MODES = {"mx": "FLOOR", "mx_ceil": "CEIL", "mx_rceil": "RCEIL", "mx_even": "EVEN"}


def ceil_log2(value: torch.Tensor) -> torch.Tensor:
    """ceil(log2(value)), exactly, of positive finite FP32 values (-200 for 0)."""
    mantissa, exponent = torch.frexp(value)  # value = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent).masked_fill(value == 0, -200)


def reference(x: torch.Tensor, fmt: str, scaling: str = "mx") -> torch.Tensor:
    """``x`` (last dimension a multiple of 32) rounded per block by the definition."""
    blocks = x.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    largest = torch.finfo(F8[fmt]).max
    if scaling == "mx_rceil":
        exponent = ceil_log2(amax / largest).clamp(-127, 127)
        scale = torch.where(exponent == -127, 1.0, torch.exp2(exponent.float()))
    else:
        mantissa, exponent = torch.frexp(amax)
        if scaling == "mx_even":  # the mantissa in [0.5, 1) rounded to the format's bits, half up
            steps = 2.0 ** (MANTISSA_BITS[fmt] + 1)
            exponent = exponent + (torch.floor(mantissa * steps + 0.5) == steps)
        exponent = exponent - 1  # floor(log2(amax)) of a normal amax
        if scaling == "mx_ceil":
            exponent = ceil_log2(amax)
        scale = torch.exp2((exponent - MAX_EXP[fmt]).float()).clamp(min=2.0**-126)
    out = (blocks / scale).clamp(-largest, largest).to(F8[fmt]).float() * scale
    return out.flatten(-2).to(x.dtype)


def blocks(shape: tuple[int, ...] = (6, 5, 96), seed: int = 0) -> torch.Tensor:
    """Values whose blocks of 32 differ in magnitude by up to 2^40, zeros included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 4, shape, generator=g))
    scales = torch.exp2(torch.randint(-20, 20, (*shape[:-1], shape[-1] // 32, 1), generator=g).float())
    x = (x.unflatten(-1, (-1, 32)) * scales).flatten(-2)
    x[..., ::29] = 0.0
    return x


@pytest.mark.parametrize("scaling", list(MODES))
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_each_block_equals_the_cast_of_the_block_scaled_by_a_power_of_two(fmt, scaling):
    x = blocks()
    out = quantize(x, fmt, scaling=scaling)
    assert torch.equal(out, reference(x, fmt, scaling))
    # blocks apart: a block alone rounds the same
    assert torch.equal(out[..., 32:64], quantize(x[..., 32:64].contiguous(), fmt, scaling=scaling))
    # per row instead of per block flushes the small blocks' values
    assert (quantize(x, fmt, scaling="rowwise_pow2") == 0).sum() > (out == 0).sum() * 2


def test_the_modes_differ_where_the_definitions_do():
    """A block whose largest magnitude is no power of two: CEIL's scale is twice FLOOR's, so
    its small values lose a bit; RCEIL's rounds the largest value to the format's largest.
    EVEN's is FLOOR's unless the largest magnitude rounds up to a power of two at the
    format's precision: then it is twice FLOOR's, where FLOOR's saturates that value."""
    x = torch.full((32,), 2.0**-8)
    x[0] = 300.0  # e4m3: floor scale 2^0, ceil 2^1, rceil 2^ceil(log2(300 / 448)) = 2^0
    x[1] = 2.0**-9  # E4M3's smallest subnormal at scale 1; at scale 2 half of it, a tie to 0
    floor, ceil, rceil, even = (quantize(x, "e4m3", scaling=s) for s in MODES)
    assert floor[1] == x[1] and ceil[1] == 0 and torch.equal(rceil, floor) and torch.equal(even, floor)
    assert torch.equal(ceil, reference(x, "e4m3", "mx_ceil"))
    x[0] = 1.9375 * 2.0**8  # 1.1111 in binary: E4M3's 3 bits round it, half up, to 2^9
    floor, even = quantize(x, "e4m3", scaling="mx"), quantize(x, "e4m3", scaling="mx_even")
    assert floor[0] == 448 and even[0] == 512 and floor[1] == x[1] and even[1] == 0
    x[0] = 1.9375 * 2.0**8 * (1 - 2.0**-10)  # just below the half step: no carry
    assert torch.equal(quantize(x, "e4m3", scaling="mx_even"), quantize(x, "e4m3", scaling="mx"))


def _torchao_blocks(x: torch.Tensor, fmt: str, mode: str) -> torch.Tensor:
    """torchao's ``to_mx`` of ``x`` in ``mode``, multiplied back: its RCEIL data times one
    over the reciprocal it scaled by, the others' times the E8M0 scale."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    scale, data = mx.to_mx(x, F8[fmt], 32, scaling_mode=getattr(config.ScaleCalculationMode, mode))
    biased = scale.view(torch.uint8).to(torch.int32).unsqueeze(-1)
    if mode == "RCEIL":
        scale = 1.0 / torch.where(biased == 0, 1.0, torch.exp2(127 - biased.float()))
    else:
        scale = (biased << 23).view(torch.float32).clamp(min=2.0**-126)
    return (data.float().unflatten(-1, (-1, 32)) * scale).flatten(-2)


@pytest.mark.parametrize("scaling", list(MODES))
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_it_equals_torchao_to_mx(fmt, scaling):
    x = blocks()
    x[0, 0, :32] = 0.0  # an all-zero block
    x[0, 1, :32] = torch.linspace(-1e-38, 1e-38, 32)  # a quotient below 2^-127
    assert torch.equal(quantize(x, fmt, scaling=scaling), _torchao_blocks(x, fmt, MODES[scaling]))
    x = x.bfloat16()  # (its blocks' values times their scales are bfloat16 values)
    assert torch.equal(quantize(x, fmt, scaling=scaling).float(), _torchao_blocks(x, fmt, MODES[scaling]))


def test_rceil_rounds_up_exactly_as_cublas_does():
    """A quotient one FP32 step above a power of two takes the next power of two (cuBLAS's
    and the Blackwell instruction's round-up). torchao's CPU fallback computes log2 in FP32,
    which rounds such a quotient's log2 to the integer (here for every power but 2^3): its
    scale is then half this one, and the block's other values, on E4M3's subnormal grid,
    round differently."""
    for power in (-20, -5, 3, 7, 30):
        quotient = torch.tensor(2.0**power).nextafter(torch.tensor(1e38))  # 2^power (1 + 2^-23)
        x = torch.full((32,), float(quotient * 448) * 2.0**-15)
        x[0] = quotient * 448
        assert ceil_log2(x[0] / 448) == power + 1
        assert torch.equal(quantize(x, "e4m3", scaling="mx_rceil"), reference(x, "e4m3", "mx_rceil"))


def test_a_last_block_shorter_than_32_rounds_as_if_padded_with_zeros():
    x = blocks((4, 96))[:, :83].contiguous()
    padded = torch.nn.functional.pad(x, (0, 13))
    assert torch.equal(quantize(x, "e4m3", scaling="mx"), reference(padded, "e4m3")[:, :83])


@pytest.mark.parametrize("scaling", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [96, 83])
def test_the_compiled_operator_rounds_like_the_reference(dtype, length, scaling):
    """Inductor's lowering (blocks viewed, padded, reduced) on ``LOWPREC_TEST_DEVICE``."""
    x = blocks((6, 5, 96))[..., :length].contiguous().to(TEST_DEVICE, dtype)
    x[1, 1, 3] = float("inf")
    x[2, 0, :32] = 0.0
    x[2, 1, :32] = 1e-38  # a quotient below 2^-127
    x[2, 2, 1] = 448 * 2.0**7 * (1 + 2.0**-7)  # one bfloat16 step above a power of two
    x[2, 3, 1] = 448 * 2.0**5  # a quotient that is a power of two (Triton's FP32 division is inexact)
    x[2, 4, :32] = 448 * 2.0**-126.5  # a subnormal quotient above 2^-127
    x[3, 0, 1] = 1.9375 * 2.0**5  # EVEN: rounds up to the next power of two at E4M3's bits
    x[3, 1, 1] = 1.9375 * 2.0**5 * (1 - 2.0**-10)  # ... and just below that at E4M3's
    x[3, 2, 1] = 3.3e38  # ... to 2^128 (FP32's infinity's exponent)
    assert_compiled_rounding(x, scaling, "e4m3", "e5m2")


@pytest.mark.parametrize("scaling", list(MODES))
def test_special_blocks(scaling):
    x = blocks((2, 96))
    x[0, 40] = float("inf")
    x[1, 70] = float("nan")
    x[1, :32] = 0.0
    out = quantize(x, "e4m3", scaling=scaling)
    assert out[0, 32:64].isnan().all() and out[1, 64:].isnan().all()  # only their blocks
    assert not out[0, :32].isnan().any() and not out[0, 64:].isnan().any()
    assert torch.equal(out[1, :32], x[1, :32])  # an all-zero block stays zero
    tiny = torch.full((32,), 1e-40)  # a scale below 2^-126 is held there, as torchao's
    assert torch.equal(quantize(tiny, "e4m3", scaling=scaling), reference(tiny, "e4m3", scaling))
    scalar = torch.tensor(3.3)
    assert torch.equal(
        quantize(scalar, "e4m3", scaling=scaling), quantize(scalar.reshape(1), "e4m3", scaling=scaling)[0]
    )
