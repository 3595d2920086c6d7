"""Tensorwise scaling of the quantize operators, against torch's own float8 casts.

The reference is written here from the definition (torchao's dynamic scaling): the format's
largest value over the tensor's largest magnitude, floored at 1e-12, divided in float64 and
rounded to FP32; the tensor times it, cast with ``Tensor.to(float8_*)``, divided back.
"""

from __future__ import annotations

import pytest
import torch
from devices import TEST_DEVICE

import lpcompile  # noqa: F401  (registers torch.ops.lowprec)
from lpcompile import quantize
from lpcompile.numerics.scale_grad import range_counts

F8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
q = torch.ops.lowprec.quantize
qg = torch.ops.lowprec.quantize_grad


def reference_scale(x: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    amax = x.detach().abs().max().double().clamp(min=1e-12)
    scale = (torch.finfo(dtype).max / amax).float()
    return 2.0 ** torch.floor(torch.log2(scale)) if pow2 else scale


def reference(x: torch.Tensor, fmt: str, pow2: bool = False) -> torch.Tensor:
    dtype = F8[fmt]
    scale = reference_scale(x, dtype, pow2)
    largest = torch.finfo(dtype).max
    return ((x.float() * scale).clamp(-largest, largest).to(dtype).float() / scale).to(x.dtype)


def spread(n: int = 4099, magnitude: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Normal values times ``magnitude``, over many binades, zeros and ties included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * magnitude * torch.exp2(torch.randint(-12, 4, (n,), generator=g))
    x[::97] = 0.0
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("magnitude", [1e-7, 0.02, 3e4])
def test_tensorwise_equals_the_cast_of_the_tensor_scaled_to_the_format_range(fmt, magnitude):
    x = spread(magnitude=magnitude)
    expected = reference(x, fmt)
    assert torch.equal(quantize(x, fmt, scaling="tensorwise"), expected)
    # the largest magnitude lands on the format's largest value, whatever the tensor's range
    torch.testing.assert_close(expected.abs().max(), x.abs().max(), rtol=2.0**-22, atol=0)
    pow2 = quantize(x, fmt, scaling="tensorwise_pow2")
    assert torch.equal(pow2, reference(x, fmt, pow2=True))
    scale = reference_scale(x, F8[fmt], pow2=True)
    assert torch.frexp(scale).mantissa.item() == 0.5  # a power of two
    assert torch.finfo(F8[fmt]).max / 2 < x.abs().max() * scale <= torch.finfo(F8[fmt]).max


def test_without_scaling_tiny_values_flush_where_tensorwise_keeps_them():
    x = spread(magnitude=1e-7)
    plain, scaled = quantize(x, "e4m3"), quantize(x, "e4m3", scaling="tensorwise")
    assert (plain == 0).float().mean() > 0.9
    assert (scaled == 0).float().mean() < 0.05  # the zeros in x, and values 2^17 below its largest
    normal = x.abs() >= x.abs().max() * 2.0**-8  # in E4M3's normal range once scaled
    assert ((scaled - x).abs() <= x.abs() * 2.0**-4)[normal].all()  # E4M3's half-ulp, relative


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_operator_rounds_like_the_reference(dtype):
    """On ``LOWPREC_TEST_DEVICE`` (``scripts/gpu_check.sh`` runs it on a GPU)."""
    x = spread(magnitude=0.3).to(TEST_DEVICE, dtype)
    seed = torch.tensor(5, device=TEST_DEVICE)

    def both(x):
        return (
            q(x, "e4m3", "nearest", "saturate", None, 0, None, "tensorwise"),
            q(x, "e5m2", "stochastic", "inf", seed, 7, None, "tensorwise_pow2"),
        )

    with torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        compiled = torch.compile(both, fullgraph=True)(x)
    eager = both(x)
    assert torch.equal(compiled[0], reference(x, "e4m3"))
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager, strict=True))


def test_stochastic_rounding_of_the_scaled_tensor_brackets_it():
    x = spread(magnitude=2.0)
    scale = reference_scale(x, torch.float8_e5m2, pow2=True)  # a power of two: exact products
    out = quantize(x, "e5m2", "stochastic", seed=3, scaling="tensorwise_pow2", overflow="inf")
    scaled = out * scale
    down = (x * scale).to(torch.float8_e5m2).float()  # the nearest: one of the two neighbours
    assert torch.isfinite(out).all()
    assert torch.equal(scaled.to(torch.float8_e5m2).float(), scaled)  # on the scaled grid
    assert ((scaled - down).abs() <= down.abs() * 2.0**-2 + 2.0**-16).all()  # within a step
    assert not torch.equal(out, quantize(x, "e5m2", seed=3, scaling="tensorwise_pow2"))


def test_special_tensors():
    zeros = torch.zeros(5)
    assert torch.equal(quantize(zeros, "e4m3", scaling="tensorwise"), zeros)
    # below the 1e-12 floor the scale stops growing: the values round as if the amax were 1e-12
    tiny = torch.tensor([1e-20, -3e-21])
    expected = (tiny * (448 / 1e-12)).to(torch.float8_e4m3fn).float() / torch.tensor(448 / 1e-12)
    assert torch.equal(quantize(tiny, "e4m3", scaling="tensorwise"), expected)
    for bad in (float("inf"), float("nan")):
        out = quantize(torch.tensor([1.0, bad, -2.0]), "e5m2", scaling="tensorwise", overflow="inf")
        assert torch.isnan(out).all(), out  # a loss scaler sees it, whatever the overflow mode
    empty = torch.empty(0, 3)
    assert quantize(empty, "e4m3", scaling="tensorwise").shape == (0, 3)


def test_the_gradient_rounding_scales_the_incoming_gradient():
    x = torch.randn(64, requires_grad=True)
    grad = spread(64, magnitude=1e-6, seed=1)
    qg(x, "e5m2", "nearest", "inf", None, 0, "tensorwise").backward(grad)
    assert torch.equal(x.grad, reference(grad, "e5m2"))
    x.grad = None
    q(x, "e4m3", "nearest", "saturate", None, 0, None, "tensorwise").backward(grad)
    assert torch.equal(x.grad, grad)  # straight through


def test_bad_arguments_are_refused():
    x = torch.randn(4)
    with pytest.raises(ValueError, match="scaling must be one of"):
        quantize(x, "e4m3", scaling="channelwise")
    with pytest.raises(ValueError, match="pass no scale"):
        quantize(x, "e4m3", scale=2.0, scaling="tensorwise")


def test_range_counts_count_the_scaled_tensor():
    x = spread(magnitude=1e3)
    smallest = 2.0**-9  # E4M3's smallest subnormal
    scaled = x * reference_scale(x, torch.float8_e4m3fn)
    beyond, nonfinite, nonzero, below = range_counts(x, "e4m3", "tensorwise").tolist()
    assert (beyond, nonfinite, nonzero) == (0, 0, int((x != 0).sum()))
    assert below == int(((scaled != 0) & (scaled.abs() < smallest)).sum()) > 0
    assert range_counts(x, "e4m3")[0] > 0  # unscaled, values of 1e3 overflow E4M3


@pytest.mark.parametrize("fmt,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_sixteen_bit_formats_scale_to_their_range_too(fmt, dtype):
    """FP16's factor puts the largest magnitude at 65504; BF16's, which would pass FP32's
    largest value for small tensors, is capped there (the scaled tensor stays finite)."""
    for magnitude in (1e-30, 1e-3, 1.0):
        x = spread(257, magnitude=magnitude)
        largest = torch.finfo(dtype).max
        amax = x.abs().max().double().clamp(min=1e-12)
        scale = (largest / amax).clamp(max=torch.finfo(torch.float32).max).float()
        expected = (x * scale).clamp(-largest, largest).to(dtype).float() / scale
        got = quantize(x, fmt, scaling="tensorwise")
        assert torch.isfinite(got).all() and torch.equal(got, expected), (fmt, magnitude)
