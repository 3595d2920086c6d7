"""Blockwise scaling of the quantize operator (DeepSeek-V3's FP8 training): ``"blockwise"``
an FP32 factor per block of 128 values along the last dimension, ``"blockwise_2d"`` per tile
of 128 x 128 values of the last two, against torchao's ``blockwise_fp8_training`` casts:
its E4M3 codes times the reciprocal scales it returns (to within one FP32 rounding: lowprec
divides by its factor where torchao multiplies by the reciprocal)."""

from __future__ import annotations

import pytest
import torch
from devices import TEST_DEVICE, assert_compiled_rounding
from grid import torchao_blockwise, torchao_blockwise_tiles

import lpcompile  # noqa: F401  (registers torch.ops.lowprec)
from lpcompile import quantize
from lpcompile.numerics.formats import parse_format
from lpcompile.numerics.quantize import dynamic_scale

ONE_ROUNDING = {"rtol": 2.0**-22, "atol": 0.0}


def blocks(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values whose 32 x 32 squares differ in magnitude by up to 2^20, zeros included: blocks
    and tiles of 128 then differ from one another, and from their rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    squares = (*shape[:-2], -(-shape[-2] // 32), 1, -(-shape[-1] // 32), 1)
    scales = torch.exp2(torch.randint(-10, 10, squares, generator=g).float())
    scales = scales.expand(*squares[:-3], 32, squares[-2], 32).flatten(-2).flatten(-3, -2)
    x = x * scales[..., : shape[-2], : shape[-1]]
    x[..., ::17] = 0.0
    return x


def test_blocks_equal_torchaos_blockwise_activation_cast():
    x = blocks((3, 64, 300))  # a last block of 44, as if padded with zeros
    out = quantize(x, "e4m3", scaling="blockwise")
    expected = torchao_blockwise(x)
    torch.testing.assert_close(out, expected, **ONE_ROUNDING)
    assert torch.equal(out == 0, expected == 0)
    # a factor per row instead of per block flushes the small blocks' values
    assert (quantize(x, "e4m3", scaling="rowwise") == 0).sum() > (out == 0).sum()


def test_tiles_equal_torchaos_blockwise_weight_cast():
    w = blocks((256, 384), seed=1)
    out = quantize(w, "e4m3", scaling="blockwise_2d")
    torch.testing.assert_close(out, torchao_blockwise_tiles(w), **ONE_ROUNDING)
    # one rounding for the matmuls that sum over either dimension
    assert torch.equal(quantize(w.T.contiguous(), "e4m3", scaling="blockwise_2d"), out.T)
    assert not torch.equal(quantize(w.T.contiguous(), "e4m3", scaling="blockwise").T, out)
    # tiles cut short, as if padded with zeros; leading dimensions: each matrix its own tiles
    cut = w[:200, :300].contiguous()
    tiles = quantize(cut, "e4m3", scaling="blockwise_2d")
    torch.testing.assert_close(tiles, torchao_blockwise_tiles(cut), **ONE_ROUNDING)
    stacked = quantize(torch.stack([cut, 1e-4 * cut]), "e4m3", scaling="blockwise_2d")
    assert torch.equal(stacked[0], tiles)
    assert torch.equal(stacked[1], quantize(1e-4 * cut, "e4m3", scaling="blockwise_2d"))


def test_a_non_finite_value_spoils_its_own_block_alone():
    """An infinite magnitude makes its block's factor 0 and its values NaN, which a loss
    scaler sees; the other blocks round as before."""
    x = blocks((4, 256), seed=2)
    clean = quantize(x, "e4m3", scaling="blockwise")
    x[1, 130] = float("inf")
    out = quantize(x, "e4m3", scaling="blockwise")
    assert out[1, 128:].isnan().all()
    assert torch.equal(out[1, :128], clean[1, :128]) and torch.equal(out[[0, 2, 3]], clean[[0, 2, 3]])


@pytest.mark.parametrize("scaling", ["blockwise", "blockwise_2d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_blocks_and_tiles_round_like_the_reference(scaling, dtype):
    """Inductor's lowering of the blocks, and the decomposition of the tiles, with short last
    blocks and tiles, to nearest and stochastically."""
    x = blocks((2, 160, 300))[:, :150].contiguous().to(TEST_DEVICE, dtype)
    assert_compiled_rounding(x, scaling, "e4m3", "e4m3")


def test_stochastic_rounding_picks_a_neighbour_on_each_blocks_grid():
    x = blocks((8, 256), seed=3)
    nearest = quantize(x, "e4m3", scaling="blockwise")
    factors = dynamic_scale(x, parse_format("e4m3"), "blockwise")
    for seed in range(4):
        out = quantize(x, "e4m3", "stochastic", seed=seed, scaling="blockwise")
        scaled = out * factors
        torch.testing.assert_close(scaled, scaled.to(torch.float8_e4m3fn).float(), **ONE_ROUNDING)
        spacing = torch.maximum(nearest.abs() / 4, 2.0**-9 / factors)  # E4M3's, subnormals' at least
        assert ((out - x).abs() <= spacing).all()


def test_a_large_tensor_keeps_its_blocks_and_tiles_in_the_direct_apis_compiled_kernel(monkeypatch):
    from lpcompile.numerics import quantize as module

    w = blocks((2, 160, 300), seed=4)
    expected = {s: quantize(w, "e4m3", scaling=s) for s in ("blockwise", "blockwise_2d")}
    monkeypatch.setattr(module, "COMPILED_NUMEL", 1024)
    assert module._runs_compiled(w, None)
    with torch._inductor.config.patch(fx_graph_cache=False):
        for scaling, want in expected.items():
            assert torch.equal(quantize(w, "e4m3", scaling=scaling), want), scaling


@pytest.mark.parametrize(
    "scaling,shape",
    [("blockwise_2d", (4, 256)), ("blockwise", (4,)), ("rowwise", (4,)), ("blockwise_2d", (2, 130, 140))],
)
def test_under_vmap_each_slice_has_its_own_blocks_and_tiles(scaling, shape):
    """Vectors' tiles, and scalars' rows, would run across the slices of one tensor."""
    x = blocks(shape, seed=5) if len(shape) > 1 else torch.tensor([3.0, 1e-3, -7.0, 2e-5])
    x[1] *= 1e-3
    out = torch.vmap(lambda t: quantize(t, "e4m3", scaling=scaling))(x)
    for i in range(shape[0]):
        assert torch.equal(out[i], quantize(x[i], "e4m3", scaling=scaling)), i
