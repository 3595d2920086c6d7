"""Tensorwise scaling in compiled training steps (recipe ``fp8-tensorwise``, option
``scaling``), against a model written by hand with torch's float8 casts, against torchao's
float8 training (its CPU emulation), and in the reports."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lpcompile
from lpcompile.config import LowPrecConfig
from tests.grid import tensorwise_cast

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _forward_cast(t: torch.Tensor) -> torch.Tensor:
    """E4M3 in the forward, the gradient straight through."""
    return t + (tensorwise_cast(t.detach(), E4M3) - t).detach()


class _ErrorCast(torch.autograd.Function):
    """The identity, whose backward casts the error to E5M2."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return tensorwise_cast(grad, E5M2)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


def _by_hand(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """``fp8-tensorwise`` written out: E4M3 operands, E5M2 errors, FP32 weight gradients."""
    h = x
    for layer in (model[0], model[2]):
        # the bias added after the error's rounding, as torchao adds it
        h = _ErrorCast.apply(nn.functional.linear(_forward_cast(h), _forward_cast(layer.weight))) + layer.bias
        if layer is model[0]:
            h = torch.relu(h)
    return h


def _inputs() -> torch.Tensor:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    x[0, :4] = torch.tensor([1e-3, 2e4, -5.0, 0.0])  # a wide range, as unscaled E4M3 cannot hold
    return x


def _compiled_step(options: dict, x: torch.Tensor) -> tuple[nn.Module, torch.Tensor]:
    torch._dynamo.reset()
    model = _mlp()
    out = torch.compile(model, backend="lowprec", options=options)(x)
    out.square().mean().backward()
    return model, out.detach()


@pytest.mark.parametrize("executor", ["inductor", "eager"])
def test_a_training_step_equals_the_model_written_with_torch_casts(executor):
    x = _inputs()
    model, out = _compiled_step({"recipe": "fp8-tensorwise", "executor": executor}, x)
    reference = _mlp()
    expected = _by_hand(reference, x)
    expected.square().mean().backward()
    assert torch.equal(out, expected.detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    # without scaling the same formats give other numbers (so the comparison can fail)
    unscaled, out = _compiled_step({"recipe": "fp8-hybrid", "executor": executor}, x)
    assert not torch.equal(out, expected.detach())


def test_outputs_and_weight_gradients_equal_torchao_float8_training():
    float8 = pytest.importorskip("torchao.float8")
    x = _inputs()
    model, out = _compiled_step({"recipe": "fp8-tensorwise"}, x)
    peer = float8.convert_to_float8_training(_mlp(), config=float8.Float8LinearConfig(emulate=True))
    expected = peer(x)
    expected.square().mean().backward()
    assert torch.equal(out, expected.detach())
    for (name, p), q in zip(model.named_parameters(), peer.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_coverage_and_saturation_counts_say_the_tensors_were_scaled():
    x = _inputs()
    model, _ = _compiled_step({"recipe": "fp8-tensorwise", "executor": "eager", "saturation": "count"}, x)
    rows = {row.layer: row.quantized for row in lpcompile.coverage(model)}
    assert rows["0"] == {
        "weight": "e4m3 nearest saturate tensorwise",
        "activation": "e4m3 nearest saturate tensorwise",
        "error": "e5m2 nearest inf tensorwise",
    }
    counts = {(c.layer, c.role): c for c in lpcompile.saturation(model)}
    assert all(c.saturated == 0 and c.nonfinite == 0 for c in counts.values())
    # the input of the first layer: values 2^-9 of its largest magnitude and below underflow E4M3
    scaled = x * (448 / x.abs().max())
    expected = int(((scaled != 0) & (scaled.abs() < 2.0**-9)).sum())
    assert counts[("0", "activation")].underflow == expected > 0
    assert counts[("0", "activation")].nonzero == int((x != 0).sum())


def test_options_set_scaling_per_role_and_refuse_what_cannot_work():
    config = LowPrecConfig.from_options({"recipe": "fp8-e5m2-sr", "error": {"scaling": "tensorwise_pow2"}})
    assert config.error.scaling == "tensorwise_pow2" and config.weight.scaling == "none"
    assert config.error.rounding == "stochastic"
    with pytest.raises(ValueError, match="scaling must be one of"):
        LowPrecConfig.from_options({"recipe": "fp8-hybrid", "weight": {"scaling": "channelwise"}})
    with pytest.raises(ValueError, match="divides each layer's loss scale back out"):
        LowPrecConfig.from_options({"recipe": "fp8-e5m2-als", "error": {"scaling": "tensorwise"}})
    # scaled weights and activations go with adaptive scaling of the (unscaled) errors
    LowPrecConfig.from_options({"recipe": "fp8-e5m2-als", "weight": {"scaling": "tensorwise"}})
