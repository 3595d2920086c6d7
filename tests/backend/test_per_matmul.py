"""A role rounded another way in one matmul of each layer's backward (options
``weight_for_input_grad``, ``activation_for_weight_grad``, ``error_for_weight_grad``;
recipe ``fp8-rowwise-gw-hp``): training steps against models written by hand with torch's
float8 casts, against torchao's ``rowwise_with_gw_hp`` recipe (its CPU emulation), and in
the reports."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import lpcompile
from lpcompile.config import LowPrecConfig, QuantSpec

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
Cast = Callable[[torch.Tensor], torch.Tensor]


def _unscaled(dtype: torch.dtype) -> Cast:
    return lambda t: t.to(dtype).float()


def _scaled(dtype: torch.dtype, dim: int | None = None) -> Cast:
    """``t`` scaled to ``dtype``'s range (per line along ``dim``, or per tensor), cast with
    torch, scaled back."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        largest = torch.finfo(dtype).max
        amax = t.abs().amax() if dim is None else t.abs().amax(dim, keepdim=True)
        scale = (largest / amax.double().clamp(min=1e-12)).float()
        return (t * scale).clamp(-largest, largest).to(dtype).float() / scale

    return cast


def _unrounded(t: torch.Tensor) -> torch.Tensor:
    return t


class _Linear(torch.autograd.Function):
    """``F.linear`` with each GEMM's operands cast as ``casts`` says, by role and GEMM (the
    bias, if given, added to the product before the error's rounding)."""

    @staticmethod
    def forward(ctx, x, weight, bias, casts):
        ctx.save_for_backward(x, weight)
        ctx.casts, ctx.biased = casts, bias is not None
        y = casts["activation"](x) @ casts["weight"](weight).T
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        casts = ctx.casts
        x2, grad2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        error = casts["error"](grad2)
        grad_x = error @ casts["weight_for_input_grad"](weight)
        grad_w = casts["error_for_weight_grad"](grad2).T @ casts["activation_for_weight_grad"](x2)
        bias_grad = error.sum(0) if ctx.biased else None  # the bias reads the layer's error
        return grad_x.reshape(x.shape), casts["weight_grad"](grad_w), bias_grad, None


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


def _inputs() -> torch.Tensor:
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    x[0, 0, :4] = torch.tensor([1e-3, 2e4, -5.0, 0.0])  # one row far above the others
    return x.requires_grad_()


def _step(model: nn.Module, x: torch.Tensor, forward: Callable | None = None) -> list[torch.Tensor]:
    out = (forward or model)(x)
    out.square().mean().backward()
    return [out.detach(), x.grad, *(p.grad for p in model.parameters())]


def _compiled_step(options: dict) -> list[torch.Tensor]:
    torch._dynamo.reset()
    model = _mlp()
    return _step(model, _inputs(), torch.compile(model, backend="lowprec", options=options))


def _reference_step(casts: dict[str, Cast]) -> list[torch.Tensor]:
    model = _mlp()

    def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        if casts.get("bias_after"):  # a scaled recipe's: after the error's rounding, as torchao adds it
            return _Linear.apply(x, layer.weight, None, casts) + layer.bias
        return _Linear.apply(x, layer.weight, layer.bias, casts)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(torch.relu(linear(x, model[0])), model[2])

    return _step(model, _inputs(), forward)


def _casts(weight: Cast, activation: Cast, error: Cast, weight_grad: Cast, **per_matmul: Cast) -> dict:
    roles = {"weight": weight, "activation": activation, "error": error, "weight_grad": weight_grad}
    return {
        **roles,
        "weight_for_input_grad": weight,
        "activation_for_weight_grad": activation,
        "error_for_weight_grad": error,
        **per_matmul,
    }


E5M2_NEAREST = _casts(*[_unscaled(E5M2)] * 4)
TENSORWISE = {**_casts(_scaled(E4M3), _scaled(E4M3), _scaled(E5M2), _unrounded), "bias_after": True}
CASES = {
    # the weight gradient's operands unrounded; the same graph before lowprec's passes as the
    # one without options (AOT autograd's cache must tell them apart)
    "unscaled": ({"recipe": "fp8-e5m2"}, E5M2_NEAREST),
    "unscaled, weight gradient unrounded": (
        {"recipe": "fp8-e5m2", "activation_for_weight_grad": None, "error_for_weight_grad": None},
        {**E5M2_NEAREST, "activation_for_weight_grad": _unrounded, "error_for_weight_grad": _unrounded},
    ),
    # adaptive loss scaling's graphs (a scale of 1: the numbers are the unscaled ones)
    "adaptive, error unrounded in the weight gradient": (
        {
            "recipe": "fp8-e5m2",
            "loss_scale": "adaptive",
            "loss_scale_rule": "fixed",
            "error_for_weight_grad": None,
        },
        {**E5M2_NEAREST, "error_for_weight_grad": _unrounded},
    ),
    # a tensorwise weight rounded per row of the input gradient's summed dimension
    "tensorwise, weight per row for the input gradient": (
        {"recipe": "fp8-tensorwise", "weight_for_input_grad": {"scaling": "rowwise"}},
        {**TENSORWISE, "weight_for_input_grad": _scaled(E4M3, 0)},
    ),
}


@pytest.mark.parametrize("executor", ["inductor", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_training_step_equals_the_model_written_with_torch_casts(case, executor):
    options, casts = CASES[case]
    got = _compiled_step({**options, "executor": executor})
    for i, (value, expected) in enumerate(zip(got, _reference_step(casts), strict=True)):
        assert torch.equal(value, expected), i


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_outputs_and_gradients_equal_torchao_rowwise_with_gw_hp(executor):
    float8 = pytest.importorskip("torchao.float8")
    out, x_grad, *grads = _compiled_step({"recipe": "fp8-rowwise-gw-hp", "executor": executor})
    config = float8.Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
    config = float8.Float8LinearConfig(**{**config.__dict__, "emulate": True})
    peer = float8.convert_to_float8_training(_mlp(), config=config)
    expected, expected_x_grad, *expected_grads = _step(peer, _inputs())
    assert torch.equal(out, expected)
    assert torch.equal(x_grad, expected_x_grad)
    names = ("0.weight", "0.bias", "2.weight", "2.bias")
    for name, got, want in zip(names, grads, expected_grads, strict=True):
        assert torch.equal(got, want), name


def test_coverage_names_the_per_matmul_roundings_and_the_unrounded_operands():
    torch._dynamo.reset()
    model = _mlp()
    _step(model, _inputs(), torch.compile(model, backend="lowprec", options={"recipe": "fp8-rowwise-gw-hp"}))
    rows = lpcompile.coverage(model)
    rounded = {row.layer: row.quantized for row in rows if row.kept is None}
    kept = {(row.layer, row.op): row.kept for row in rows if row.kept is not None}
    for layer in ("0", "2"):
        assert rounded[layer]["weight"] == "e4m3 nearest saturate rowwise_pow2", rounded
        assert rounded[layer]["weight_for_input_grad"] == "e4m3 nearest saturate tensorwise_pow2", rounded
        assert (
            kept[(layer, "weight_grad matmul")]
            == "activation_for_weight_grad, error_for_weight_grad: unrounded"
        )


class _ConvNet(nn.Module):
    """A 2-D convolution (small enough for the im2col rewrite under Inductor) and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.proj = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.conv(x).flatten(2).transpose(1, 2))


def _conv_step(options: dict, frozen: bool = False, input_grad: bool = True) -> list[str]:
    """The per-matmul options' warnings of a step of :class:`_ConvNet` (with ``frozen``, its
    convolution's weight frozen; without ``input_grad``, its input needing no gradient)."""
    torch._dynamo.reset()
    model = _ConvNet()
    model.conv.weight.requires_grad_(not frozen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="lowprec", options=options)(
            torch.randn(2, 8, 6, 6, requires_grad=input_grad)
        ).sum().backward()
    return [str(w.message) for w in caught if "per-matmul options" in str(w.message)]


def test_a_convolution_the_options_cannot_reach_warns_naming_it_and_them():
    """ATen's convolution computes both gradients in one call; the im2col rewrite's weight
    gradient reads patches gathered from the activation, no view of it (its input gradient
    is an error-weight matmul the options reach)."""
    options = {"recipe": "fp8-rowwise-gw-hp", "executor": "inductor"}
    (said,) = _conv_step({**options, "conv": "aten"})
    assert "'conv' (aten.convolution_backward.default; activation_for_weight_grad, error_for_weight" in said
    assert "weight_for_input_grad" in said and "'proj'" not in said
    (said,) = _conv_step(options)
    assert "'conv' (aten.mm.default; activation_for_weight_grad, error_for_weight_grad)" in said, said
    assert _conv_step({"recipe": "fp8-rowwise", "weight_for_input_grad": {"scaling": "tensorwise"}}) == []


def test_a_frozen_convolution_is_named_for_its_input_gradient_alone():
    """A frozen weight has no weight gradient for the weight-gradient options to miss."""
    options = {"recipe": "fp8-rowwise-gw-hp", "executor": "inductor", "conv": "aten"}
    (said,) = _conv_step(options, frozen=True)
    assert "'conv' (aten.convolution_backward.default; weight_for_input_grad)" in said, said
    assert _conv_step({**options, "weight_for_input_grad": None, "recipe": "fp8-rowwise"}, frozen=True)
    weight_grad_only = {"recipe": "fp8-rowwise", "activation_for_weight_grad": None, "conv": "aten"}
    assert _conv_step(weight_grad_only, frozen=True) == []
    assert _conv_step(weight_grad_only) != []
    # a frozen stem: its backward computes the bias gradient alone
    assert _conv_step(options, frozen=True, input_grad=False) == []


class _TokenExperts(nn.Module):
    """Each token times its expert's weight, as one-row matmuls (transformers'
    ``batched_mm`` experts): their weight gradients are products of elements."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16, 8) / 4)

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x.unsqueeze(1), self.weight[expert]).squeeze(1)


def test_a_weight_gradient_of_element_products_warns_naming_the_layer():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x, expert = _TokenExperts(), torch.randn(12, 16, requires_grad=True), torch.randint(0, 4, (12,))
    with pytest.warns(
        UserWarning, match=r"reach no matmul of 'bmm' \(aten.mul.Tensor; activation_for_weight_grad"
    ):
        compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-rowwise-gw-hp"})
        compiled(x, expert).square().mean().backward()


class _SharedGather(nn.Module):
    """Two matmuls read one gathered weight: the second reads it as an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16, 16) / 4)

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        w = self.weight[expert]
        return torch.bmm(torch.bmm(x, w), w)


def _gather_step(frozen: bool = False, grad: bool = True) -> list[str]:
    """The per-matmul options' warnings of a step of :class:`_SharedGather` (or of a forward
    without ``grad``)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x, expert = _SharedGather(), torch.randn(6, 3, 16, requires_grad=True), torch.randint(0, 4, (6,))
    model.weight.requires_grad_(not frozen)
    compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-rowwise-gw-hp"})
    with warnings.catch_warnings(record=True) as caught, torch.set_grad_enabled(grad):
        warnings.simplefilter("always")
        out = compiled(x, expert)
        if grad:
            out.square().mean().backward()
    return [str(w.message) for w in caught if "per-matmul options" in str(w.message)]


def test_a_gathered_weight_two_matmuls_share_warns_naming_the_second():
    (said,) = _gather_step()
    assert "'bmm_1' (a weight another matmul rounds, read as an activation; activation_for" in said, said
    assert "'bmm' " not in said
    (said,) = _gather_step(frozen=True)  # no weight gradient to miss
    assert "'bmm_1' (a weight another matmul rounds, read as an activation; weight_for_input_grad)" in said
    assert _gather_step(grad=False) == []  # no backward


def test_options_and_their_errors():
    config = LowPrecConfig.from_options({"recipe": "fp8-rowwise-gw-hp"})
    assert config.in_matmul("weight", "input_grad").scaling == "tensorwise_pow2"
    assert not config.in_matmul("error", "weight_grad").enabled
    assert config.in_matmul("error", "input_grad") is None
    # a dict overrides the role's final spec; None leaves the role unrounded in that matmul
    config = LowPrecConfig.from_options(
        {"recipe": "fp8-e5m2", "weight": {"fmt": "e4m3"}, "weight_for_input_grad": {"scaling": "tensorwise"}}
    )
    assert (config.weight_for_input_grad.fmt, config.weight_for_input_grad.scaling) == ("e4m3", "tensorwise")
    refused = [
        (
            {"recipe": "fp8-tensorwise", "weight_for_input_grad": {"fmt": "e5m2"}},
            "may change the weight's scaling",
        ),
        ({"recipe": "fp32", "error_for_weight_grad": {"fmt": "e5m2"}}, "the error, activation, weight role"),
        # the matmul is told apart by the sites of its layer's error and weight
        ({"recipe": "fp8-rowwise", "error": None, "weight_for_input_grad": None}, "the error role"),
        (
            {"recipe": "fp8-e5m2-als", "error_for_weight_grad": {"scaling": "tensorwise"}},
            "loss scale back out",
        ),
        ({"recipe": "nvfp4-2d", "weight_for_input_grad": None}, "'nvfp4_2d' is one rounding"),
        (
            {"recipe": "fp8-rowwise", "wgrad_hadamard": True, "error_for_weight_grad": None},
            "does not go with activation_for_weight_grad",
        ),
    ]
    for options, message in refused:
        with pytest.raises(ValueError, match=message):
            LowPrecConfig.from_options(options)
    # a recipe's per-matmul roundings follow its roles as the options change them, and apply
    # only where the roles telling their matmul apart are rounded
    config = LowPrecConfig.from_options({"recipe": "fp8-rowwise-gw-hp", "weight": {"rounding": "stochastic"}})
    assert config.weight_for_input_grad == QuantSpec("e4m3", "stochastic", scaling="tensorwise_pow2")
    assert LowPrecConfig.from_options({"recipe": "fp8-rowwise-gw-hp", "weight": None}).per_matmul == ()
    config = LowPrecConfig.from_options({"recipe": "fp8-rowwise-gw-hp", "activation": None})
    assert config.per_matmul == ("weight_for_input_grad",)
    # nor where a tiled role or the Hadamard transform rules them out
    config = LowPrecConfig.from_options(
        {"recipe": "fp8-rowwise-gw-hp", "weight": {"scaling": "blockwise_2d"}}
    )
    assert config.per_matmul == ("activation_for_weight_grad", "error_for_weight_grad")
    assert LowPrecConfig.from_options({"recipe": "fp8-rowwise-gw-hp", "wgrad_hadamard": True}).per_matmul == (
        "weight_for_input_grad",
    )
