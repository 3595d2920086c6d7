"""NVFP4 scaling of the quantize operator (NVIDIA's two-level scaling of E2M1 values: an
E4M3 factor per block of 16 along the last dimension, under an FP32 one per tensor),
against torchao's ``nvfp4_quantize``: its E4M3 block scales, per-tensor scale and FP4
codes, multiplied back (to within one FP32 rounding: lowprec divides by its factor where
torchao multiplies by the scales)."""

from __future__ import annotations

import pytest
import torch
import torch._functorch.config
from devices import TEST_DEVICE, assert_compiled_rounding, compiled_afresh
from grid import on_e2m1_values, torchao_nvfp4, torchao_nvfp4_tiles

import lpcompile  # noqa: F401  (registers torch.ops.lowprec)
from lpcompile import quantize
from lpcompile.numerics.formats import parse_format
from lpcompile.numerics.quantize import dynamic_scale

q = torch.ops.lowprec.quantize
FP4 = "e2m1-finite"


def blocks(shape: tuple[int, ...] = (6, 4, 64), seed: int = 0) -> torch.Tensor:
    """Values whose blocks of 16 differ in magnitude by up to 2^24, zeros included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    scales = torch.exp2(torch.randint(-12, 12, (*shape[:-1], shape[-1] // 16, 1), generator=g).float())
    x = (x.unflatten(-1, (-1, 16)) * scales).flatten(-2)
    x[..., ::13] = 0.0
    x.view(-1, shape[-1])[0, 16:32] = 0.0  # an all-zero block
    return x


def test_it_equals_torchao_nvfp4_quantize():
    x = blocks()
    expected, _ = torchao_nvfp4(x)
    out = quantize(x, FP4, scaling="nvfp4")
    torch.testing.assert_close(out, expected, rtol=2.0**-22, atol=0.0)
    assert torch.equal(out == 0, expected == 0)
    # per tensor instead of per block flushes the small blocks' values
    assert (quantize(x, FP4, scaling="tensorwise") == 0).sum() > (out == 0).sum() * 2


def test_a_last_block_shorter_than_16_rounds_as_if_padded_with_zeros():
    x = blocks((4, 64))[:, :53].contiguous()
    expected, _ = torchao_nvfp4(x)  # padded with zeros
    torch.testing.assert_close(quantize(x, FP4, scaling="nvfp4"), expected, rtol=2.0**-22, atol=0.0)


def test_stochastic_rounding_picks_a_neighbour_on_the_grid_without_bias():
    x = blocks((2, 32), seed=3)
    _, factor = torchao_nvfp4(x)
    seeds = [torch.tensor(s) for s in range(400)]
    draws = torch.stack([q(x, FP4, "stochastic", "inf", seed, 0, None, "nvfp4") for seed in seeds])
    assert on_e2m1_values(draws * factor).all()
    assert (draws != draws[0]).any(0).sum() > 40  # it does draw
    # the mean of the draws is the value, to within four standard errors of the spread
    spread = draws.std(0) / 20
    assert ((draws.mean(0) - x).abs() <= 4 * spread + 1e-6 * x.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [64, 53])
def test_the_compiled_operator_rounds_like_the_reference(dtype, length):
    """Inductor's lowering (blocks viewed, padded, reduced; the tensor reduced) on
    ``LOWPREC_TEST_DEVICE``."""
    x = blocks((6, 4, 64))[..., :length].contiguous().to(TEST_DEVICE, dtype)
    seed = torch.tensor(5, device=TEST_DEVICE)
    overflowed = x[:2].clone()
    overflowed[1, 1, 3] = float("inf")

    def both(x, overflowed):
        return (
            q(x, FP4, "nearest", "saturate", None, 0, None, "nvfp4"),
            q(x, FP4, "stochastic", "inf", seed, 7, None, "nvfp4"),
            q(overflowed, FP4, "nearest", "saturate", None, 0, None, "nvfp4"),
        )

    compiled = compiled_afresh(both, x, overflowed)
    for a, b in zip(compiled, both(x, overflowed), strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    assert compiled[2].isnan().all()


def test_special_tensors():
    x = blocks((2, 64))
    x[0, 40] = float("inf")
    assert quantize(x, FP4, scaling="nvfp4").isnan().all()  # an overflow a loss scaler sees
    zeros = torch.zeros(3, 16)
    assert torch.equal(quantize(zeros, FP4, scaling="nvfp4"), zeros)
    scalar = torch.tensor(3.3)
    alone = quantize(scalar.reshape(1), FP4, scaling="nvfp4")[0]
    assert torch.equal(quantize(scalar, FP4, scaling="nvfp4"), alone)


def test_under_vmap_each_slice_has_its_own_tensor_scale():
    x = blocks((3, 2, 32))
    x[1] *= 1e6
    out = torch.vmap(lambda t: quantize(t, FP4, scaling="nvfp4"))(x)
    for i in range(3):
        assert torch.equal(out[i], quantize(x[i], FP4, scaling="nvfp4")), i


@pytest.mark.parametrize("scaling", ["mx", "nvfp4"])
def test_block_factors_compile_to_their_eager_values_with_a_short_last_block(scaling):
    """Inductor (CPU) fused the blocks' factors, repeated over a row 45 long and read by a
    pointwise kernel, with the last block's wrong; saturation counts read them so."""
    x = blocks((6, 4, 64))[..., :45].contiguous()

    def scaled(x):
        return x * dynamic_scale(x, parse_format("e2m1-finite"), scaling)

    with torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(scaled)(x), scaled(x))


def test_tiles_equal_the_tiles_rounded_with_torchaos_fp4_cast():
    """``"nvfp4_2d"``: an E4M3 factor per tile of 16 x 16 values of the last two dimensions."""
    w = blocks((64, 48), seed=1)
    w[16:32, 32:48] *= 1e-5  # a tile far below the others
    out = quantize(w, FP4, scaling="nvfp4_2d")
    expected = torchao_nvfp4_tiles(w)
    torch.testing.assert_close(out, expected, rtol=2.0**-22, atol=0.0)
    assert torch.equal(out == 0, expected == 0)
    # per tensor instead of per tile flushes the small tiles' values
    assert (quantize(w, FP4, scaling="tensorwise") == 0).sum() > (out == 0).sum()


def test_a_tile_rounds_the_same_in_a_transposed_tensor():
    """What makes NVIDIA's weights 2-D: the forward's matmul and the input gradient's read one
    rounding (per row blocks of 16 along either dimension differ)."""
    w = blocks((48, 80), seed=2)[:40, :75].contiguous()  # tiles cut short, as if padded with zeros
    tiles = quantize(w, FP4, scaling="nvfp4_2d")
    assert torch.equal(quantize(w.T.contiguous(), FP4, scaling="nvfp4_2d"), tiles.T)
    by_rows = quantize(w, FP4, scaling="nvfp4")
    assert not torch.equal(quantize(w.T.contiguous(), FP4, scaling="nvfp4").T, by_rows)
    padded = torch.nn.functional.pad(w, (0, 5, 0, 8))
    torch.testing.assert_close(tiles, torchao_nvfp4_tiles(padded)[:40, :75], rtol=2.0**-22, atol=0.0)
    # leading dimensions: each slice's own tiles (40 rows: tiles of the rows of both would
    # straddle them), under one tensor scale
    stacked = quantize(torch.stack([w, 2 * w]), FP4, scaling="nvfp4_2d")
    assert torch.equal(stacked[1] / 2, stacked[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_tiles_round_like_the_reference(dtype):
    x = blocks((2, 48, 80))[:, :40, :70].contiguous().to(TEST_DEVICE, dtype)
    assert_compiled_rounding(x, "nvfp4_2d", FP4, FP4)


def test_a_large_tensor_keeps_its_tiles_in_the_direct_apis_compiled_kernel(monkeypatch):
    """``lpcompile.quantize`` rounds large CPU tensors with a compiled kernel over a view of
    them: for tiles, a stack of matrices."""
    from lpcompile.numerics import quantize as module

    w = blocks((2, 48, 80), seed=4)
    expected = quantize(w, FP4, scaling="nvfp4_2d")
    monkeypatch.setattr(module, "COMPILED_NUMEL", 1024)
    assert module._runs_compiled(w, None)
    with torch._inductor.config.patch(fx_graph_cache=False):
        assert torch.equal(quantize(w, FP4, scaling="nvfp4_2d"), expected)
