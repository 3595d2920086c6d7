"""Scaled products of float16 and bfloat16 models: a scaling whose factors are no powers of
two gives rounded operands that are no 16-bit values, so the product runs in FP32 and only
its result is rounded to the model's dtype, as an FP8 GEMM (and torchao's emulation of one)
computes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.grid import Calls, GridCheck, grid_step, on_scaled_fp8_grid, tensorwise_cast

aten = torch.ops.aten
DTYPES = [torch.bfloat16, torch.float16]


def _mlp(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).to(dtype)


def _step(model: nn.Module, x: torch.Tensor, options: dict) -> torch.Tensor:
    torch._dynamo.reset()
    out = torch.compile(model, backend="lowprec", options=options)(x)
    out.float().square().mean().backward()
    return out.detach()


@pytest.mark.parametrize(
    ("recipe", "executor"),
    [
        ("fp8-tensorwise", "inductor"),
        ("fp8-tensorwise", "eager"),
        # bfloat16 products (power-of-two factors), whose bias addition Inductor would fuse
        # into the matmul (addmm), one rounding fewer than torchao's eager step
        ("fp8-rowwise", "eager"),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_16_bit_step_equals_torchao_float8_training(dtype, recipe, executor):
    """Biases included: torchao adds them after the product, in the model's dtype."""
    float8 = pytest.importorskip("torchao.float8")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    model = _mlp(dtype)
    out = _step(model, x, {"recipe": recipe, "executor": executor})
    config = float8.Float8LinearConfig.from_recipe_name(recipe.removeprefix("fp8-"))
    config = float8.Float8LinearConfig(**{**config.__dict__, "emulate": True})
    peer = float8.convert_to_float8_training(_mlp(dtype), config=config)
    expected = peer(x)
    expected.float().square().mean().backward()
    assert out.dtype == dtype
    assert torch.equal(out, expected.detach())
    for (name, p), q in zip(model.named_parameters(), peer.parameters(), strict=True):
        assert p.grad.dtype == dtype
        assert torch.equal(p.grad, q.grad), name


class _Products(GridCheck):
    """The dtypes of the float operands of every product that ran, by op."""

    def __init__(self) -> None:
        super().__init__(on_grid=lambda t: t.dtype != torch.float32 or on_scaled_fp8_grid(t))
        self.dtypes: dict[str, set[torch.dtype]] = {}

    def record(self, func, args):
        super().record(func, args)
        if func in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default):
            floats = (a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
            self.dtypes.setdefault(func.overloadpacket.__name__, set()).update(a.dtype for a in floats)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.proj = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(2).transpose(1, 2)  # (batch, 16 positions, 8 channels)
        return torch.einsum("bsd,de->bse", self.proj(h), self.w)


@pytest.mark.parametrize(
    ("recipe", "product_dtype"),
    [
        ("fp8-tensorwise", torch.float32),
        ("nvfp4", torch.float32),
        ("fp8-blockwise", torch.float32),
        # power-of-two factors: the rounded operands are bfloat16 values
        ("fp8-rowwise", torch.bfloat16),
        ("mxfp8", torch.bfloat16),
        ("fp8-e5m2-sr", torch.bfloat16),
    ],
)
@pytest.mark.parametrize("autocast", [False, True], ids=["bfloat16", "autocast"])
def test_products_run_in_fp32_where_the_factors_are_no_powers_of_two(recipe, product_dtype, autocast):
    """A bfloat16 model, or an FP32 one under bfloat16 autocast (which would cast the rounded
    operands to bfloat16): forward and backward products alike."""
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    model = _Block().to(dtype)
    x = torch.randn(2, 3, 4, 4, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        check = grid_step(model, {"x": x}, {"recipe": recipe, "executor": "eager"}, _Products())
    assert set(check.dtypes) >= {"convolution", "bmm"} and check.dtypes.keys() & {"mm", "addmm"}
    assert all(dtypes == {product_dtype} for dtypes in check.dtypes.values()), check.dtypes
    if recipe == "fp8-tensorwise":  # (the others' factors are per row or block)
        assert not check.off_grid
    assert all(p.grad.dtype == dtype and p.grad.isfinite().all() for p in model.parameters())


class _Rounded(torch.autograd.Function):
    """``t`` (FP32) rounded per tensor to ``fmt`` with torch's cast; the gradient passes."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
        return tensorwise_cast(t, fmt)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _RoundedError(torch.autograd.Function):
    """The identity, whose gradient (FP32) is rounded per tensor to E5M2."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return tensorwise_cast(grad, torch.float8_e5m2)


def _linear_under_autocast(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer(x)`` as an FP8 GEMM computes it under bfloat16 autocast: the FP32 weight and
    the input (in its dtype, cast up) rounded, multiplied in FP32, the error rounded on the
    FP32 result, which is then rounded to bfloat16 once; the bias added after, in bfloat16."""
    weight = _Rounded.apply(layer.weight, torch.float8_e4m3fn)
    product = _Rounded.apply(x.float(), torch.float8_e4m3fn) @ weight.T
    return _RoundedError.apply(product).bfloat16() + layer.bias.bfloat16()


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_an_autocast_step_multiplies_in_fp32_and_rounds_each_result_once(executor):
    """An FP32 model under bfloat16 autocast, ``fp8-tensorwise``: autocast would round the
    divided-back operands to bfloat16 a second time, forward and backward (AOT autograd
    traces the backward under the autocast it compiled in). Checked against the step
    written out with torch's casts, run without autocast."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    model, reference = _mlp(torch.float32), _mlp(torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend="lowprec", options={"recipe": "fp8-tensorwise", "executor": executor}
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
    out.float().square().mean().backward()
    expected = _linear_under_autocast(torch.relu(_linear_under_autocast(x_ref, reference[0])), reference[2])
    expected.float().square().mean().backward()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    assert torch.equal(x.grad, x_ref.grad)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad), name


def test_attention_with_a_16_bit_mask_equals_torch_casts_in_fp32():
    """The mask, no product operand, is cast to FP32 with the operands."""
    q, k, v = torch.randn(3, 2, 4, 16, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    mask = torch.randn(16, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def attention(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    torch._dynamo.reset()
    out = torch.compile(attention, backend="lowprec", options={"recipe": "fp8-tensorwise"})(q, k, v, mask)
    rounded = (tensorwise_cast(t, torch.float8_e4m3fn) for t in (q, k, v))
    expected = F.scaled_dot_product_attention(*rounded, attn_mask=mask.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


class _Experts(nn.Module):
    """A weight picked per token (a mixture of experts), read by two products."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.experts = nn.Parameter(torch.randn(4, 16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.experts[torch.arange(x.shape[0]) % 4]
        h = torch.bmm(self.proj(x).unsqueeze(1), w.transpose(1, 2))
        return torch.bmm(h, w).squeeze(1)


def test_a_weight_picked_per_token_is_cast_up_once_for_its_products():
    torch.manual_seed(0)
    model = _Experts().to(torch.bfloat16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    check = grid_step(model, {"x": x}, {"recipe": "fp8-tensorwise", "executor": "eager"}, _Products())
    assert check.dtypes["bmm"] == {torch.float32} and check.products[("bmm.default", True)] == 6
    assert not check.off_grid
    assert all(p.grad.dtype == torch.bfloat16 and p.grad.isfinite().all() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_second_product_of_a_weight_picked_per_token_rounds_its_fp32_values(dtype):
    """The second product rounds the gathered weight, which the first rounded, again, from
    the FP32 values (not from a bfloat16 copy, whose largest magnitude gives another
    factor): the picks cover every expert, so its factor is the first's and its rounding
    changes nothing. Forward and backward matmuls alike."""
    torch.manual_seed(0)
    model = _Experts().to(dtype)
    x = torch.randn(8, 16, dtype=dtype)
    calls = Calls(aten.bmm.default)
    grid_step(model, {"x": x}, {"recipe": "fp8-tensorwise", "executor": "eager"}, calls)
    picked = tensorwise_cast(model.experts.detach(), torch.float8_e4m3fn)[torch.arange(8) % 4]
    weights = [t for _, args, _ in calls.calls for t in args if t.shape == picked.shape]
    assert len(weights) == 4  # the two forward matmuls' and the two input gradients'
    assert all(torch.equal(t, picked) or torch.equal(t, picked.mT) for t in weights)


class _ExpertsNorm(_Experts):
    """Also returns a sum over the picked weights, which is no product."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.experts[torch.arange(x.shape[0]) % 4]
        return torch.bmm(x.unsqueeze(1), w).squeeze(1), w.square().sum((1, 2))


def test_what_else_reads_a_weight_picked_per_token_keeps_the_models_dtype():
    torch.manual_seed(0)
    model = _ExpertsNorm().to(torch.bfloat16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    torch._dynamo.reset()
    options = {"recipe": "fp8-tensorwise", "executor": "eager"}
    out, norms = torch.compile(model, backend="lowprec", options=options)(x)
    assert out.dtype == norms.dtype == torch.bfloat16
    # the sum reads the weight as its product reads it: rounded whole, then cast to bfloat16
    rounded = tensorwise_cast(model.experts.detach(), torch.float8_e4m3fn).to(torch.bfloat16)
    picked = rounded[torch.arange(8) % 4]
    assert torch.equal(norms, picked.square().sum((1, 2)))


def test_grouped_matmuls_keep_their_bfloat16_operands():
    """torch's grouped matmul takes bfloat16 operands only."""

    class Grouped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 16, 8) / 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(x, self.w, offs=torch.tensor([2, 4, 6, 8], dtype=torch.int32))

    torch.manual_seed(0)
    model = Grouped().to(torch.bfloat16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    in_bf16 = GridCheck(on_grid=lambda t: t.dtype == torch.bfloat16)
    check = grid_step(model, {"x": x}, {"recipe": "fp8-tensorwise", "executor": "eager"}, in_bf16)
    assert check.products[("_grouped_mm.default", True)] >= 1 and not check.off_grid
    assert model.w.grad.dtype == torch.bfloat16 and model.w.grad.isfinite().all()


class _AutocastAround(nn.Module):
    """Autocast inside the model, around a checkpoint or a ``torch.cond`` of a linear layer."""

    def __init__(self, body: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = body, nn.Linear(64, 32), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if self.body == "checkpoint":
                return torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False)
            return torch.cond(x.sum() > 0, lambda x: self.a(x), lambda x: self.b(x), (x,))


@pytest.mark.parametrize("body", ["checkpoint", "cond"])
def test_autocast_around_a_body_in_the_model_runs_its_products_in_fp32(body):
    """The body's graph has no autocast of its own: the parent's, around its call, counts."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).abs().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    model, reference = _AutocastAround(body), _AutocastAround(body)
    options = {"recipe": "fp8-tensorwise", "executor": "eager"}
    torch._dynamo.reset()
    out = torch.compile(model, backend="lowprec", options=options)(x)
    out.float().square().mean().backward()
    expected = _linear_under_autocast(x_ref, reference.a)
    expected.float().square().mean().backward()
    assert torch.equal(out, expected)
    assert torch.equal(model.a.weight.grad, reference.a.weight.grad)
    assert torch.equal(x.grad, x_ref.grad)
