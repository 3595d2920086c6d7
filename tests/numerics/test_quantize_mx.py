"""MX scaling of the quantize operator (OCP microscaling: a power-of-two factor per block of
32 values along the last dimension), against torch's own float8 casts and torchao's ``to_mx``.

The reference is written here from the definition: a block's scale is 2 to the power of
floor(log2 of its largest magnitude) minus the exponent of the element format's largest
value, at least 2^-126; the block divided by it, clamped to the format's range, cast with
``Tensor.to(float8_*)``, multiplied back.
"""

from __future__ import annotations

import pytest
import torch
from devices import TEST_DEVICE

import lpcompile  # noqa: F401  (registers torch.ops.lowprec)
from lpcompile import quantize

F8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MAX_EXP = {"e4m3": 8, "e5m2": 15}  # 448 = 1.75 * 2^8, 57344 = 1.75 * 2^15
q = torch.ops.lowprec.quantize


def reference(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` (last dimension a multiple of 32) rounded per block by the definition."""
    blocks = x.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    exponent = torch.frexp(amax).exponent - 1  # floor(log2(amax)) of a normal amax
    scale = torch.exp2((exponent - MAX_EXP[fmt]).float()).clamp(min=2.0**-126)
    largest = torch.finfo(F8[fmt]).max
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


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_each_block_equals_the_cast_of_the_block_scaled_by_a_power_of_two(fmt):
    x = blocks()
    out = quantize(x, fmt, scaling="mx")
    assert torch.equal(out, reference(x, fmt))
    # blocks apart: a block alone rounds the same
    assert torch.equal(out[..., 32:64], quantize(x[..., 32:64].contiguous(), fmt, scaling="mx"))
    # per row instead of per block flushes the small blocks' values
    assert (quantize(x, fmt, scaling="rowwise_pow2") == 0).sum() > (out == 0).sum() * 2


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_it_equals_torchao_to_mx(fmt):
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    x = blocks()
    scale, data = mx.to_mx(x, F8[fmt], 32)
    scale = (scale.view(torch.uint8).to(torch.int32) << 23).view(torch.float32).clamp(min=2.0**-126)
    expected = (data.float().unflatten(-1, (-1, 32)) * scale.unsqueeze(-1)).flatten(-2)
    assert torch.equal(quantize(x, fmt, scaling="mx"), expected)


def test_a_last_block_shorter_than_32_rounds_as_if_padded_with_zeros():
    x = blocks((4, 96))[:, :83].contiguous()
    padded = torch.nn.functional.pad(x, (0, 13))
    assert torch.equal(quantize(x, "e4m3", scaling="mx"), reference(padded, "e4m3")[:, :83])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [96, 83])
def test_the_compiled_operator_rounds_like_the_reference(dtype, length):
    """Inductor's lowering (blocks viewed, padded, reduced) on ``LOWPREC_TEST_DEVICE``."""
    x = blocks((6, 5, 96))[..., :length].contiguous().to(TEST_DEVICE, dtype)
    x[1, 1, 3] = float("inf")
    seed = torch.tensor(5, device=TEST_DEVICE)

    def both(x):
        return (
            q(x, "e4m3", "nearest", "saturate", None, 0, None, "mx"),
            q(x, "e5m2", "stochastic", "inf", seed, 7, None, "mx"),
        )

    with (
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._inductor.config.patch(fx_graph_cache=False),
    ):
        torch._dynamo.reset()
        compiled = torch.compile(both, fullgraph=True)(x)
    for a, b in zip(compiled, both(x), strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


def test_special_blocks():
    x = blocks((2, 96))
    x[0, 40] = float("inf")
    x[1, 70] = float("nan")
    x[1, :32] = 0.0
    out = quantize(x, "e4m3", scaling="mx")
    assert out[0, 32:64].isnan().all() and out[1, 64:].isnan().all()  # only their blocks
    assert not out[0, :32].isnan().any() and not out[0, 64:].isnan().any()
    assert torch.equal(out[1, :32], x[1, :32])  # an all-zero block stays zero
    tiny = torch.full((32,), 1e-40)  # a scale below 2^-126 is held there, as torchao's
    assert torch.equal(quantize(tiny, "e4m3", scaling="mx"), reference(tiny, "e4m3"))
    scalar = torch.tensor(3.3)
    assert torch.equal(
        quantize(scalar, "e4m3", scaling="mx"), quantize(scalar.reshape(1), "e4m3", scaling="mx")[0]
    )
