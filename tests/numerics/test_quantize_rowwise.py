"""Rowwise scaling of the quantize operator, against torch's own float8 casts.

The reference is written here from the definition (torchao's axiswise dynamic scaling along
the last dimension): for each row, the format's largest value over the row's largest
magnitude, floored at 1e-12, divided in float64 and rounded to FP32; the row times it, cast
with ``Tensor.to(float8_*)``, divided back.
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


def row_scales(x: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    amax = x.detach().float().abs().amax(-1, keepdim=True).double().clamp(min=1e-12)
    scale = (torch.finfo(dtype).max / amax).float()
    return 2.0 ** torch.floor(torch.log2(scale)) if pow2 else scale


def reference(x: torch.Tensor, fmt: str, pow2: bool = False) -> torch.Tensor:
    dtype = F8[fmt]
    scale = row_scales(x, dtype, pow2)
    largest = torch.finfo(dtype).max
    return ((x.float() * scale).clamp(-largest, largest).to(dtype).float() / scale).to(x.dtype)


def rows(shape: tuple[int, ...] = (7, 5, 129), seed: int = 0) -> torch.Tensor:
    """Rows whose magnitudes differ by up to 2^60 from one another, zeros and a zero row included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 4, shape, generator=g))
    x = x * torch.exp2(torch.randint(-30, 30, (*shape[:-1], 1), generator=g).float())
    x[..., ::31] = 0.0
    if len(shape) > 2:
        x[0, 0] = 0.0
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_each_row_equals_the_cast_of_the_row_scaled_to_the_format_range(fmt):
    x = rows()
    out = quantize(x, fmt, scaling="rowwise")
    assert torch.equal(out, reference(x, fmt))
    # each row is its own tensor: the tensorwise rounding of each row alone
    for i, j in [(0, 1), (3, 2), (6, 4)]:
        assert torch.equal(out[i, j], quantize(x[i, j], fmt, scaling="tensorwise"))
    # each row's largest magnitude lands on the format's largest value
    nonzero = x.abs().amax(-1) > 0
    torch.testing.assert_close(out.abs().amax(-1)[nonzero], x.abs().amax(-1)[nonzero], rtol=2.0**-22, atol=0)
    assert torch.equal(quantize(x, fmt, scaling="rowwise_pow2"), reference(x, fmt, pow2=True))
    # a tensorwise factor flushes the small rows that rowwise scaling keeps
    assert (quantize(x, fmt, scaling="tensorwise") == 0).sum() > (out == 0).sum() * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_operator_rounds_like_the_reference(dtype):
    """Inductor's lowering (a reduction per row) on ``LOWPREC_TEST_DEVICE``."""
    x = rows().to(TEST_DEVICE, dtype)
    x[1, 1, 3] = float("inf")
    x[2, 2, 2] = float("nan")
    seed = torch.tensor(5, device=TEST_DEVICE)

    def both(x):
        return (
            q(x, "e4m3", "nearest", "saturate", None, 0, None, "rowwise"),
            q(x, "e5m2", "stochastic", "inf", seed, 7, None, "rowwise_pow2"),
        )

    with torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        compiled = torch.compile(both, fullgraph=True)(x)
    eager = both(x)
    assert torch.equal(compiled[0].nan_to_num(), reference(x, "e4m3").nan_to_num())
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


def test_special_rows():
    x = torch.tensor([[1.0, float("inf"), -2.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [1e-20, -3e-21, 0.0]])
    out = quantize(x, "e5m2", scaling="rowwise", overflow="inf")
    assert torch.isnan(out[0]).all()  # a row holding inf or NaN comes out NaN, the others not
    assert torch.equal(out[1], quantize(x[1], "e5m2", scaling="tensorwise"))
    assert torch.equal(out[2], x[2])
    # below the 1e-12 floor a row's factor stops growing, as a tensor's does
    assert torch.equal(out[3], quantize(x[3], "e5m2", scaling="tensorwise"))
    # a vector is one row; a 0-dim tensor and an empty one round as a whole
    v = rows((257,))
    assert torch.equal(quantize(v, "e4m3", scaling="rowwise"), quantize(v, "e4m3", scaling="tensorwise"))
    scalar = torch.tensor(3.3)
    assert torch.equal(
        quantize(scalar, "e4m3", scaling="rowwise"), quantize(scalar, "e4m3", scaling="tensorwise")
    )
    assert quantize(torch.empty(0, 3), "e4m3", scaling="rowwise").shape == (0, 3)


def test_range_counts_count_each_row_as_scaled():
    x = rows()
    smallest = 2.0**-9  # E4M3's smallest subnormal
    scaled = x * row_scales(x, F8["e4m3"])
    beyond, nonfinite, nonzero, below = range_counts(x, "e4m3", "rowwise").tolist()
    assert (beyond, nonfinite, nonzero) == (0, 0, int((x != 0).sum()))
    assert below == int(((scaled != 0) & (scaled.abs() < smallest)).sum())
    assert below < range_counts(x, "e4m3", "tensorwise")[3]


def test_a_large_tensor_rounds_per_row_in_the_compiled_kernel():
    """From 2^20 elements the direct API runs a compiled kernel: rows stay rows in it."""
    x = rows((256, 4, 1024), seed=1)
    assert x.numel() >= lpcompile.numerics.quantize.COMPILED_NUMEL
    assert torch.equal(quantize(x, "e4m3", scaling="rowwise"), reference(x, "e4m3"))
