"""Rowwise scaling in compiled training steps (recipe ``fp8-rowwise``): each matmul's
operands scaled per row of the dimension that matmul sums over, forward and backward,
against a model written by hand with torch's float8 casts, against torchao's rowwise
float8 training (its CPU emulation), and in the reports."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from grid import (
    Calls,
    GridCheck,
    grid_step,
    on_nvfp4_blocks,
    on_scaled_fp8_rows,
    torchao_blockwise,
    torchao_blockwise_tiles,
    torchao_nvfp4,
    torchao_nvfp4_tiles,
)
from torch import nn

import lpcompile
from lpcompile.backend.state import REGISTRY
from lpcompile.config import LowPrecConfig
from lpcompile.numerics.rng import hadamard_signs
from lpcompile.passes.joint import rowwise

aten = torch.ops.aten

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Factors that are not powers of two, and E5M2 errors: not torchao's recipe, checked by hand
ROWS = {
    "recipe": "fp8-rowwise",
    "weight": {"scaling": "rowwise"},
    "activation": {"scaling": "rowwise"},
    "error": {"fmt": "e5m2", "scaling": "rowwise"},
}


def _cast(t: torch.Tensor, dtype: torch.dtype, dim: int) -> torch.Tensor:
    """``t`` with each line along ``dim`` scaled to ``dtype``'s range, cast with torch, scaled back."""
    largest = torch.finfo(dtype).max
    scale = (largest / t.abs().amax(dim, keepdim=True).double().clamp(min=1e-12)).float()
    return (t * scale).clamp(-largest, largest).to(dtype).float() / scale


class _RowwiseLinear(torch.autograd.Function):
    """``F.linear`` without its bias, every GEMM's operands cast along the dimension that
    GEMM sums over."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _cast(x, E4M3, -1) @ _cast(weight, E4M3, -1).T

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x2, grad2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        error = _cast(grad2, E5M2, -1)
        grad_x = error @ _cast(weight, E4M3, 0)  # sums over the weight's rows
        grad_w = _cast(grad2, E5M2, 0).T @ _cast(x2, E4M3, 0)  # sums over the tokens
        return grad_x.reshape(x.shape), grad_w


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


def _by_hand(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    # the bias added after, as torchao adds it
    h = torch.relu(_RowwiseLinear.apply(x, model[0].weight) + model[0].bias)
    return _RowwiseLinear.apply(h, model[2].weight) + model[2].bias


def _inputs(tokens: int = 16) -> torch.Tensor:
    x = torch.randn(2, tokens // 2, 64, generator=torch.Generator().manual_seed(tokens))
    x[0, 0, :4] = torch.tensor([1e-3, 2e4, -5.0, 0.0])  # one row far above the others
    x[1] *= 1e-3
    return x.requires_grad_()


def _compiled(options: dict, x: torch.Tensor, **compile_options) -> tuple[nn.Module, torch.Tensor]:
    torch._dynamo.reset()
    model = _mlp()
    out = torch.compile(model, backend="lowprec", options=options, **compile_options)(x)
    out.square().mean().backward()
    return model, out.detach()


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad, *(p.grad for p in model.parameters())]


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = _mlp()
    out = _by_hand(model, x)
    out.square().mean().backward()
    return out.detach(), _grads(model, x)


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_a_training_step_equals_the_model_written_with_torch_casts(executor):
    x = _inputs()
    model, out = _compiled({**ROWS, "executor": executor}, x)
    expected, grads = _reference(x.detach().requires_grad_())
    assert torch.equal(out, expected)
    for i, (got, want) in enumerate(zip(_grads(model, x), grads, strict=True)):
        assert torch.equal(got, want), i


def test_without_a_rounding_per_matmul_the_gradients_differ(monkeypatch):
    """Rowwise sites reused as they are by the backward's matmuls (the rows of the wrong
    dimension): the comparison above tells them apart."""
    monkeypatch.setattr(rowwise, "MATMULS", {})
    x = _inputs()
    model, out = _compiled({**ROWS, "executor": "eager"}, x)
    expected, grads = _reference(x.detach().requires_grad_())
    assert torch.equal(out, expected)  # the forward's rows are the sites' own
    assert not torch.equal(model[0].weight.grad, grads[1])


def test_dynamic_shapes_round_each_batch_like_the_reference():
    torch._dynamo.reset()
    model = _mlp()
    compiled = torch.compile(model, backend="lowprec", options=ROWS, dynamic=True)
    for tokens in (16, 24):
        x = _inputs(tokens)
        out = compiled(x)
        out.square().mean().backward()
        expected, grads = _reference(x.detach().requires_grad_())
        assert torch.equal(out.detach(), expected), tokens
        assert torch.equal(model[0].weight.grad, grads[1]), tokens
        model.zero_grad()


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8-blockwise"])
def test_block_scalings_compile_one_graph_for_every_number_of_tokens(recipe):
    """A symbolic number of tokens, along which the weight gradients' operands are blocked
    (padded where it is no multiple of the block): one graph for every number above one
    block (Inductor specializes a dimension of one), with a static compile's bits at each."""
    options = {
        "recipe": recipe,
        **{role: {"rounding": "nearest"} for role in ("weight", "activation", "error")},
    }
    torch._dynamo.reset()
    model = _mlp()
    run = torch.compile(model, backend="lowprec", options=options, dynamic=True)
    for tokens in (136, 200, 256):
        x = _hadamard_inputs(tokens)
        run(x).square().mean().backward()
        static = _mlp()
        torch.compile(static, backend="lowprec", options=options)(x).square().mean().backward()
        for got, want in zip(model.parameters(), static.parameters(), strict=True):
            assert torch.equal(got.grad, want.grad), tokens
        model.zero_grad()
    assert len({row.graph_id for row in lpcompile.coverage(model)}) == 1


def test_outputs_and_gradients_equal_torchao_rowwise_float8_training():
    float8 = pytest.importorskip("torchao.float8")
    x = _inputs()
    model, out = _compiled({"recipe": "fp8-rowwise"}, x)
    config = float8.Float8LinearConfig.from_recipe_name("rowwise")
    config = float8.Float8LinearConfig(**{**config.__dict__, "emulate": True})
    peer = float8.convert_to_float8_training(_mlp(), config=config)
    x_peer = x.detach().requires_grad_()
    expected = peer(x_peer)
    expected.square().mean().backward()
    assert torch.equal(out, expected.detach())
    assert torch.equal(x.grad, x_peer.grad)
    for (name, p), q in zip(model.named_parameters(), peer.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


class _ConvAttention(nn.Module):
    """A convolution, a fused attention and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).transpose(1, 2)  # (batch, length, channels)
        q = k = v = h.unflatten(-1, (2, 8)).transpose(1, 2)
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.proj(a)


def test_convolutions_and_fused_attention_take_one_factor_per_tensor():
    torch.manual_seed(0)
    model, x = _ConvAttention(), torch.randn(2, 8, 12)
    check = grid_step(
        model, {"x": x}, {**ROWS, "executor": "eager"}, GridCheck(on_operand=on_scaled_fp8_rows)
    )
    products = {op for op, _ in check.products}
    assert {"convolution.default", "mm.default"} <= products, check.products
    assert any("attention" in op for op in products), check.products
    assert check.off_grid == {}, check.products
    rows = {row.layer: row.quantized for row in lpcompile.coverage(model)}
    assert rows["conv"]["weight"] == "e4m3 nearest saturate tensorwise"
    assert rows["conv"]["error"] == "e5m2 nearest inf tensorwise"
    assert set(rows["proj"].values()) == {"e4m3 nearest saturate rowwise", "e5m2 nearest inf rowwise"}
    attention = next(name for name in rows if name not in ("conv", "proj"))
    assert rows[attention]["activation"] == "e4m3 nearest saturate tensorwise", rows


def test_stochastic_rounding_draws_a_stream_per_rounding_and_repeats_with_the_seed():
    options = {
        **ROWS,
        "executor": "eager",
        **{r: {"rounding": "stochastic", "scaling": "rowwise"} for r in ROWS},
    }
    options["recipe"] = "fp8-rowwise"
    runs = []
    for _ in range(2):
        x = _inputs()
        model, out = _compiled(options, x)
        runs.append((out, _grads(model, x)))
        sites = list(REGISTRY.records[-1].sites.values())
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))
    # each layer's three sites, and three roundings of the backward's per layer (the weight
    # along its rows, the activation and the error along the tokens): streams of their own
    assert len({s.offset for s in sites}) == len(sites) == 6 + 6
    nearest, _ = _reference(_inputs().detach().requires_grad_())
    assert not torch.equal(runs[0][0], nearest)


def test_adaptive_variants_round_with_the_same_streams():
    """With adaptive loss scaling of unscaled errors, the step that records statistics runs
    a variant of the graph (the eager executor): its roundings per matmul are the plain
    variant's sites, not new ones."""
    torch._dynamo.reset()
    model = _mlp()
    options = {
        "recipe": "fp8-e5m2-als",
        "executor": "eager",
        "loss_scale_interval": 2,
        **{role: {"scaling": "rowwise"} for role in ("weight", "activation")},
    }
    compiled = torch.compile(model, backend="lowprec", options=options)
    counts = []
    for _ in range(3):
        compiled(_inputs()).square().mean().backward()
        record = REGISTRY.records[-1]
        counts.append(len(record.sites))
    joints = [r.graph for r in record.records if r.name == "round_operands_per_matmul"]
    assert len(joints) == 2 and counts == [counts[0]] * 3, (joints, counts)


def test_recipe_and_options():
    config = LowPrecConfig.from_options({"recipe": "fp8-rowwise"})
    assert config.weight.scaling == config.error.scaling == "rowwise_pow2"
    assert (config.weight.fmt, config.error.fmt, config.weight_grad.enabled) == ("e4m3", "e4m3", False)
    with pytest.raises(ValueError, match="divides each layer's loss scale back out"):
        LowPrecConfig.from_options({"recipe": "fp8-e5m2-als", "error": {"scaling": "rowwise"}})


class _Matmul(nn.Module):
    """``x @ w`` with ``w`` stored (in, out): its forward sums over the weight's first dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_a_weight_read_along_its_first_dimension_is_scaled_per_column(executor):
    x = _inputs().detach()[0]
    torch._dynamo.reset()
    model = _Matmul()
    compiled = torch.compile(model, backend="lowprec", options={**ROWS, "executor": executor})
    expected = _cast(x, E4M3, -1) @ _cast(model.w.detach(), E4M3, 0)
    with torch.no_grad():  # an inference graph: the joint passes run over it too
        assert torch.equal(compiled(x), expected)
    x.requires_grad_()
    out = compiled(x)
    assert torch.equal(out.detach(), expected)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    out.backward(grad)
    assert torch.equal(x.grad, _cast(grad, E5M2, -1) @ _cast(model.w.detach(), E4M3, 1).T)
    assert torch.equal(model.w.grad, _cast(x.detach(), E4M3, 0).T @ _cast(grad, E5M2, 0))


# -- MX: blocks of 32 along each matmul's summed dimension ---------------------------------


def _torchao_mx_linear(x: torch.Tensor, layer: nn.Linear, mode: str) -> torch.Tensor:
    """torchao's MXFP8 training matmul (emulated: its casts in torch) with the scale
    calculation ``mode``, the bias added after."""
    mxfp8 = pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    kernels = pytest.importorskip("torchao.quantization.quantize_.common.kernel_preference")
    e4m3, torch_cast = torch.float8_e4m3fn, config.MXFP8Dim1CastKernelChoice.TORCH
    y = mxfp8.mx_mm.apply(
        x,
        layer.weight,
        e4m3,
        e4m3,
        e4m3,
        32,
        kernels.KernelPreference.EMULATED,
        config.MXFP8Dim0CastKernelChoice.TORCH,
        torch_cast,
        getattr(config.ScaleCalculationMode, mode),
        False,
    )
    return y + layer.bias


EVEN = {role: {"scaling": "mx_even"} for role in ("weight", "activation", "error")}


@pytest.mark.parametrize(
    "options, mode",
    [
        ({"recipe": "mxfp8"}, "FLOOR"),
        ({"recipe": "mxfp8-rceil"}, "RCEIL"),
        ({"recipe": "mxfp8", **EVEN}, "EVEN"),
    ],
)
@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_mxfp8_step_equals_torchao_mxfp8_training(executor, options, mode):
    x = _inputs(32)  # torchao's casts along the tokens need a multiple of 32 of them
    model, out = _compiled({**options, "executor": executor}, x)
    peer = _mlp()
    x_peer = x.detach().requires_grad_()
    expected = _torchao_mx_linear(torch.relu(_torchao_mx_linear(x_peer, peer[0], mode)), peer[2], mode)
    expected.square().mean().backward()
    assert torch.equal(out, expected.detach())
    assert torch.equal(x.grad, x_peer.grad)
    for i in (0, 2):
        assert torch.equal(model[i].weight.grad, peer[i].weight.grad), i
    scaling = {"FLOOR": "mx", "RCEIL": "mx_rceil", "EVEN": "mx_even"}[mode]
    rows = {row.layer: row.quantized for row in lpcompile.coverage(model)}
    assert rows["0"] == {
        "weight": f"e4m3 nearest saturate {scaling}",
        "activation": f"e4m3 nearest saturate {scaling}",
        "error": f"e4m3 nearest inf {scaling}",
    }


@pytest.mark.parametrize(
    ("recipe", "per_tensor", "blocks"),
    [
        ("mxfp8", "e4m3 nearest saturate tensorwise_pow2", "e4m3 nearest saturate mx"),
        ("nvfp4", "e2m1-finite nearest saturate tensorwise", "e2m1-finite nearest saturate nvfp4"),
        # tiles of a convolution's weight would split the channels it sums over
        ("nvfp4-2d", "e2m1-finite nearest saturate tensorwise", "e2m1-finite nearest saturate nvfp4_2d"),
        ("fp8-blockwise", "e4m3 nearest saturate tensorwise", "e4m3 nearest saturate blockwise_2d"),
    ],
)
def test_block_scaled_recipes_round_convolutions_and_fused_attention_per_tensor(recipe, per_tensor, blocks):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ConvAttention()
    compiled = torch.compile(model, backend="lowprec", options={"recipe": recipe})
    compiled(torch.randn(2, 8, 12)).sum().backward()
    rows = {row.layer: row.quantized for row in lpcompile.coverage(model)}
    assert rows["conv"]["weight"] == per_tensor
    assert rows["proj"]["weight"] == blocks


# -- NVFP4: blocks of 16 along each matmul's summed dimension, under a factor per tensor ----


def _nvfp4(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torchao_nvfp4(t, dim)[0]


class _NVFP4Linear(torch.autograd.Function):
    """``F.linear`` with every GEMM's operands rounded by torchao along the dimension it sums
    over; with ``tiles``, the weight rounded once per tile of 16 x 16, for both GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, tiles):
        ctx.save_for_backward(x, weight)
        ctx.tiles = tiles
        return _nvfp4(x, -1) @ (torchao_nvfp4_tiles(weight) if tiles else _nvfp4(weight, -1)).T

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x2, grad2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = _nvfp4(grad2, -1) @ (torchao_nvfp4_tiles(weight) if ctx.tiles else _nvfp4(weight, 0))
        grad_w = _nvfp4(grad2, 0).T @ _nvfp4(x2, 0)
        return grad_x.reshape(x.shape), grad_w, None


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_nvfp4_step_equals_the_model_written_with_torchao_nvfp4_quantize(executor):
    """Errors rounded to nearest here (the recipe rounds them stochastically); lowprec
    divides by its factors where torchao multiplies by the scales, one FP32 rounding apart."""
    x = _inputs()
    options = {"recipe": "nvfp4", "executor": executor, "error": {"rounding": "nearest"}}
    model, out = _compiled(options, x)
    peer = _mlp()
    x_peer = x.detach().requires_grad_()
    h = torch.relu(_NVFP4Linear.apply(x_peer, peer[0].weight, False) + peer[0].bias)
    expected = _NVFP4Linear.apply(h, peer[2].weight, False) + peer[2].bias
    expected.square().mean().backward()
    close = {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(out, expected.detach(), **close)
    torch.testing.assert_close(x.grad, x_peer.grad, **close)
    for i in (0, 2):
        torch.testing.assert_close(model[i].weight.grad, peer[i].weight.grad, **close)
    rows = {row.layer: row.quantized for row in lpcompile.coverage(model)}
    assert rows["0"]["error"] == "e2m1-finite nearest inf nvfp4"


# -- DeepSeek-V3's blockwise FP8: weights per tile of 128 x 128, other operands per block of 128 --


class _BlockwiseLinear(torch.autograd.Function):
    """``F.linear`` as torchao's blockwise FP8 training computes it: the weight rounded once
    per tile of 128 x 128 for both GEMMs that read it, every other operand in blocks of 128
    along the dimension its GEMM sums over."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torchao_blockwise(x, -1) @ torchao_blockwise_tiles(weight).T

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x2, grad2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        error = torchao_blockwise(grad2, -1)
        grad_x = error @ torchao_blockwise_tiles(weight)
        grad_w = torchao_blockwise(grad2, 0).T @ torchao_blockwise(x2, 0)
        return grad_x.reshape(x.shape), grad_w


def _wide_mlp() -> nn.Sequential:
    """Layers of several blocks and tiles, one tile far below the others."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 384), nn.ReLU(), nn.Linear(384, 128))
    with torch.no_grad():
        model[0].weight[128:256, :128] *= 1e-3
    return model


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_blockwise_step_equals_the_model_written_with_torchaos_blockwise_casts(executor):
    """``fp8-blockwise``; 160 tokens: the weight gradients' blocks along the tokens end short.
    lowprec divides by its factors where torchao multiplies by the reciprocals, one FP32
    rounding apart."""
    x = torch.randn(2, 80, 256, generator=torch.Generator().manual_seed(1))
    x[1, :, 128:] *= 1e-3  # blocks of a row far apart
    x.requires_grad_()
    torch._dynamo.reset()
    model = _wide_mlp()
    options = {"recipe": "fp8-blockwise", "executor": executor}
    out = torch.compile(model, backend="lowprec", options=options)(x)
    out.square().mean().backward()
    peer = _wide_mlp()
    x_peer = x.detach().requires_grad_()
    h = torch.relu(_BlockwiseLinear.apply(x_peer, peer[0].weight) + peer[0].bias)
    expected = _BlockwiseLinear.apply(h, peer[2].weight) + peer[2].bias
    expected.square().mean().backward()
    pairs = [(out, expected), (x.grad, x_peer.grad)]
    pairs += [(got.grad, want.grad) for got, want in zip(model.parameters(), peer.parameters(), strict=True)]
    for got, want in pairs:  # FP32 sums of 256 and more products: their rounding, relative to the largest
        largest = want.abs().max().item()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-5 * largest)
    rows = {row.layer: row.quantized for row in lpcompile.coverage(model)}
    assert rows["0"]["weight"] == "e4m3 nearest saturate blockwise_2d"
    assert rows["0"]["error"] == "e4m3 nearest inf blockwise"


QUANTIZE = torch.ops.lowprec.quantize.default
# op -> the positions of its operands a test reads: the matmuls' factors, quantize's input
OPERANDS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2), QUANTIZE: (0,)}


def _operands(calls: Calls) -> list[tuple[Any, int, torch.Tensor]]:
    """(op, position, tensor) of each operand :data:`OPERANDS` names, in call order."""
    return [(func, i, args[i]) for func, args, _ in calls.calls for i in OPERANDS[func]]


def test_nvfp4_2d_weights_are_one_rounding_per_tile_for_both_gemms():
    """``nvfp4-2d``: the forward's GEMM reads each weight as rounded per tile of 16 x 16
    (checked against the tiles rounded with torchao's FP4 cast), and the input gradient's
    GEMM reads the same values; the other operands are NVFP4 blocks along the summed
    dimension. The eager executor: a dispatch mode sees its calls."""
    x = _inputs()
    calls = Calls(aten.mm.default, aten.addmm.default)
    grid_step(_mlp(), {"input": x}, {"recipe": "nvfp4-2d", "executor": "eager"}, calls)
    seen = _operands(calls)
    peer = _mlp()
    for weight in (peer[0].weight, peer[2].weight):
        tiles = torchao_nvfp4_tiles(weight.detach())
        forward = [t for _, _, t in seen if t.shape == weight.T.shape]  # x @ w.T
        backward = [t for _, _, t in seen if t.shape == weight.shape]  # grad_y @ w
        assert len(forward) == 1 and len(backward) == 1
        torch.testing.assert_close(forward[0].T, tiles, rtol=2.0**-22, atol=0.0)
        assert torch.equal(backward[0], forward[0].T)
    others = [(f, i, t) for f, i, t in seen if 16 in t.shape]  # the tokens' operands
    assert len(others) == 8 and all(on_nvfp4_blocks(f, i, t) for f, i, t in others)


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_under_autocast_each_matmul_rounds_its_fp32_operands_along_its_summed_dimension(executor):
    """Rowwise factors are no powers of two, so under autocast the matmuls run in FP32 on
    the FP32 weights and inputs (a bfloat16 input cast up), their results cast to bfloat16
    once: the backward's matmuls still round their own copies, not the forward's rows."""
    x = _inputs().detach()[0].requires_grad_()
    torch._dynamo.reset()
    model = _mlp()
    compiled = torch.compile(model, backend="lowprec", options={**ROWS, "executor": executor})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
    out.float().square().mean().backward()
    reference, x_ref = _mlp(), x.detach().requires_grad_()

    def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        # the bias added after the product, in bfloat16, as torchao adds it
        return _RowwiseLinear.apply(x.float(), layer.weight).bfloat16() + layer.bias.bfloat16()

    expected = linear(torch.relu(linear(x_ref, reference[0])), reference[2])
    expected.float().square().mean().backward()
    assert torch.equal(out, expected)
    assert torch.equal(x.grad, x_ref.grad)
    for i in (0, 2):
        assert torch.equal(model[i].weight.grad, reference[i].weight.grad), i


class _Halves(torch.autograd.Function):
    """``x @ w.T`` computed by halves of ``w`` (its output features), backward written out:
    the backward's matmuls read halves of the error and of the weight."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        a, b = weight.chunk(2)
        return torch.cat([x @ a.T, x @ b.T], -1)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        a, b = weight.chunk(2)
        grad_a, grad_b = grad.chunk(2, -1)
        return grad_a @ a + grad_b @ b, torch.cat([grad_a.T @ x, grad_b.T @ x])


class _HalvesModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(5)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Halves.apply(x, self.weight)


def test_a_functions_matmuls_round_their_operands_along_their_summed_dimensions():
    """A Function's bodies round the chunks of the weight and of the error its matmuls read,
    once each; the backward's matmuls read them along other dimensions than the forward's."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(6))
    x[:, 16:] *= 1e-4  # the halves' rows differ in magnitude
    x.requires_grad_()
    check = grid_step(
        _HalvesModel(), {"x": x}, {**ROWS, "executor": "eager"}, GridCheck(on_operand=on_scaled_fp8_rows)
    )
    assert check.count == 6 and check.off_grid == {}, check.products


def test_a_matmul_reading_a_rounding_through_another_op_is_named():
    """Where a matmul reads a rowwise site through an op that is no copy of it, the pass
    cannot give it its own rounding: it warns, naming the layer."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lpcompile.passes.driver import CompileContext, Site

    def scaled_matmul(x, w):
        rounded = torch.ops.lowprec.quantize(x, "e4m3", "nearest", "saturate", None, 0, None, "rowwise")
        return torch.mm(rounded * 2, w)

    gm = make_fx(scaled_matmul, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 4))
    ctx = CompileContext(LowPrecConfig.from_options(ROWS), graph_id=0, stream=0)
    ctx.sites[0] = Site(0, "activation", "proj", "e4m3", "nearest", "saturate", "rowwise", "quantize")
    with pytest.warns(UserWarning, match=r"'proj' \(through aten.mul.Tensor\)"):
        rowwise.round_operands_per_matmul(gm, ctx)


def _hadamard_along_rows(t: torch.Tensor, seed: int) -> torch.Tensor:
    """``t`` (rows a multiple of 16) with each block of 16 rows mixed by the random
    Hadamard transform: Sylvester's 16 x 16 Hadamard matrix over 4 times the signs."""
    h = torch.ones(1, 1)
    for _ in range(4):
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), h)
    signs = torch.tensor(hadamard_signs(seed), dtype=torch.float32)
    transform = h * signs / 4  # columns times the signs: H @ diag(signs)
    return (transform @ t.unflatten(0, (-1, 16))).flatten(0, 1)


def _hadamard_inputs(tokens: int) -> torch.Tensor:
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3))
    x[0, :8] *= 50.0  # an outlier token
    return x


def _hadamard_step(tokens: int, hadamard: bool) -> tuple[nn.Module, list[tuple[Any, int, torch.Tensor]]]:
    """A step with ``tokens`` tokens: the model, and the operands of its products and roundings."""
    options = {"recipe": "nvfp4-2d", "executor": "eager", "wgrad_hadamard": hadamard}
    calls = Calls(*OPERANDS)
    model = _mlp()
    grid_step(model, {"input": _hadamard_inputs(tokens)}, options, calls)
    return model, _operands(calls)


def test_wgrad_hadamard_transforms_the_weight_gradients_operands_alone():
    """NVIDIA's random Hadamard transform of the weight gradient's operands, along the
    tokens: the first layer's input, transformed by hand (Sylvester's matrix), is what gets
    rounded for its weight gradient; the weight gradient's GEMM reads NVFP4 blocks along the
    tokens; the other GEMMs read what they read without it; and the transform cancels in
    the product (the weight gradients stay near FP32's, as without it)."""
    torch._dynamo.reset()
    model, seen = _hadamard_step(48, True)
    _, plain = _hadamard_step(48, False)
    x = _hadamard_inputs(48)
    expected = _hadamard_along_rows(x, 0).T  # [features, tokens]: the tokens summed, last
    rounded = [t for f, _, t in seen if f is QUANTIZE and t.shape == (64, 48)]
    assert sum(torch.allclose(t, expected, rtol=1e-5, atol=1e-5) for t in rounded) == 1
    products = [(f, i, t) for f, i, t in seen if f is not QUANTIZE]
    before = [(f, i, t) for f, i, t in plain if f is not QUANTIZE]
    # mm(grad_y.T, x): the tokens are the first operand's columns and the second's rows
    wgrad = [(f, i, t) for f, i, t in products if f is aten.mm.default and t.shape[1 - i] == 48]
    assert len(wgrad) == 4 and all(on_nvfp4_blocks(f, i, t) for f, i, t in wgrad)
    same = [torch.equal(a[2], b[2]) for a, b in zip(products, before, strict=True)]
    assert sum(same) == len(products) - 4  # the forward's and the input gradients' GEMMs
    peer = _mlp()
    peer(x).square().mean().backward()
    for i in (0, 2):
        exact = peer[i].weight.grad
        assert (model[i].weight.grad - exact).norm() < 0.5 * exact.norm(), i


def test_wgrad_hadamard_names_the_layers_whose_tokens_no_transform_fits():
    torch._dynamo.reset()
    short = r"\(24 tokens, no multiple of 16\)"
    with pytest.warns(UserWarning, match=f"'0' {short}, '2' {short}"):
        model, _ = _hadamard_step(24, True)
    torch._dynamo.reset()
    plain, _ = _hadamard_step(24, False)
    assert all(
        torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters(), strict=True)
    )


def test_a_compile_from_aot_autograds_cache_repeats_the_joint_passes_warnings():
    """The second compile, served by AOT autograd's cache, runs no joint pass: the warning
    the Hadamard transform's pass gave the first comes again."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    options = {"recipe": "nvfp4-2d", "wgrad_hadamard": True}
    counters.clear()
    with fresh_cache():
        for _ in range(2):
            torch._dynamo.reset()
            model = torch.compile(_mlp(), backend="lowprec", options=options)
            with pytest.warns(UserWarning, match=r"'0' \(24 tokens, no multiple of 16\)"):
                model(_hadamard_inputs(24)).square().mean().backward()
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, dict(counters["aot_autograd"])


@pytest.mark.parametrize("hadamard", [False, True])
def test_nvfp4_2d_compiles_to_the_eager_executors_bits(hadamard):
    """The outputs and the weight gradients bit for bit (the bias gradients' sums over the
    tokens add in another order under Inductor)."""
    results = []
    for executor in ("eager", "inductor"):
        torch._dynamo.reset()
        model = _mlp()
        options = {"recipe": "nvfp4-2d", "executor": executor, "wgrad_hadamard": hadamard}
        out = torch.compile(model, backend="lowprec", options=options)(_hadamard_inputs(48))
        out.square().mean().backward()
        results.append([out.detach(), model[0].weight.grad, model[2].weight.grad])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_wgrad_hadamard_under_dynamic_shapes_guards_the_tokens():
    """A symbolic number of tokens: the graph compiled for a multiple of 16 transforms, and
    gives a static compile's bits (errors rounded to nearest: the second call would draw
    other bits); a length that is none recompiles, without it."""
    options = {
        "recipe": "nvfp4-2d",
        "executor": "eager",
        "wgrad_hadamard": True,
        "error": {"rounding": "nearest"},
    }
    torch._dynamo.reset()
    static = _mlp()
    torch.compile(static, backend="lowprec", options=options)(_hadamard_inputs(48)).square().mean().backward()
    torch._dynamo.reset()
    model = _mlp()
    run = torch.compile(model, backend="lowprec", options=options, dynamic=True)
    run(_hadamard_inputs(32)).square().mean().backward()
    model.zero_grad()
    run(_hadamard_inputs(48)).square().mean().backward()
    assert torch.equal(model[0].weight.grad, static[0].weight.grad)
    with pytest.warns(UserWarning, match=r"'0' \(40 tokens, no multiple of 16\)"):
        run(_hadamard_inputs(40)).square().mean().backward()


def test_wgrad_hadamard_and_its_seed_are_in_the_joint_passes_cache_key():
    """AOT autograd's cache keys on the graph before the joint passes, which the transform
    and its signs leave no trace in."""
    from lpcompile.backend.compile import JointPasses
    from lpcompile.passes.driver import CompileContext

    def key(**options) -> str:
        config = LowPrecConfig.from_options({"recipe": "nvfp4-2d", **options})
        return JointPasses(CompileContext(config, graph_id=0, stream=0), "", True).uuid()

    keys = {key(), key(wgrad_hadamard=True), key(wgrad_hadamard=True, seed=1), key(seed=1)}
    assert len(keys) == 3  # the seed alone changes no joint pass


def test_wgrad_hadamard_sums_in_fp32_under_bfloat16_autocast():
    """The transform's sums of 16 values run in FP32 (in bfloat16 each of its four steps
    would round, and the transform would no longer cancel in the product): the first
    layer's input (FP32: its product runs in FP32, the NVFP4 factors being no powers of
    two), transformed by hand, is what gets rounded."""
    torch._dynamo.reset()
    x = _hadamard_inputs(48)
    calls = Calls(QUANTIZE)
    options = {"recipe": "nvfp4-2d", "executor": "eager", "wgrad_hadamard": True}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grid_step(_mlp(), {"input": x}, options, calls)
    expected = _hadamard_along_rows(x, 0).T
    rounded = [t for _, (t, *_), _ in calls.calls if t.shape == (64, 48)]
    assert [t.dtype for t in rounded].count(torch.float32) == 1
    assert any(
        t.dtype == torch.float32 and torch.allclose(t, expected, rtol=1e-6, atol=1e-6) for t in rounded
    )
