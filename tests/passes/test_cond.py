"""``torch.cond``: the quantize pass enters both branches; the branch taken computes with
rounded operands, errors and weight gradients (torch's own casts as the reference)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import float_bits
from grid import SR_EVERYWHERE, on_e5m2_grid
from torch import nn

import lpcompile


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: self.a(x), lambda x: 2 * self.b(x), (x,))


def e5(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float8_e5m2).float()


def run(model: nn.Module, x: torch.Tensor, c: torch.Tensor, options: dict) -> torch.Tensor:
    torch._dynamo.reset()
    y = torch.compile(model, backend="lowprec", options=options)(x)
    (y * c).sum().backward()
    return y


@pytest.mark.parametrize("sign", [1, -1])
def test_the_branch_taken_matches_a_hand_written_reference(sign):
    model = Branches()
    x = (torch.randn(4, 8) + sign).requires_grad_()
    c = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = run(model, x, c, {"recipe": "fp8-e5m2", "executor": "eager"})
    layer, factor = (model.a, 1.0) if sign > 0 else (model.b, 2.0)
    w = layer.weight
    error = e5(factor * c)
    expected = {
        "output": factor * (e5(x) @ e5(w).t() + layer.bias.detach()),
        "input grad": error @ e5(w),
        "weight grad": e5(error.t() @ e5(x)),
    }
    for label, got in (("output", y), ("input grad", x.grad), ("weight grad", w.grad)):
        assert torch.equal(float_bits(got.detach()), float_bits(expected[label])), label
    assert not [w for w in caught if "lowprec" in str(w.message)]
    rows = {row.layer: row for row in lpcompile.coverage(model)}
    assert set(rows) == {"a", "b"} and not any(row.kept for row in rows.values())
    assert set(rows["a"].quantized) == {"activation", "weight", "error", "weight_grad"}


def test_stochastic_rounding_reads_the_seed_in_a_branch():
    """The seed reaches both branches (one operand more): the branch rounds the input
    stochastically, so its output is not the nearest-even one; the weight gradient leaves
    on the grid."""
    model = Branches()
    x, c = (torch.randn(4, 8) + 1).requires_grad_(), torch.randn(4, 8)
    y = run(model, x, c, SR_EVERYWHERE)
    nearest = e5(x) @ e5(model.a.weight).t() + model.a.bias.detach()
    assert not torch.equal(y.detach(), nearest)
    assert on_e5m2_grid(model.a.weight.grad) and not on_e5m2_grid(model.a.bias.grad)
    sites = [row for row in lpcompile.coverage(model) if row.layer == "a"]
    assert len(sites) == 1 and len(sites[0].quantized) == 4


@pytest.mark.parametrize("executor", ["eager", "inductor"])  # inductor: statistics under a cond of its own
def test_branch_layers_get_their_own_adaptive_scale(executor):
    """Each branch's layers take part in adaptive scaling in their place: a fixed power-of-two
    scale, rounded to nearest even, gives the unscaled run's bits exactly (errors scaled on
    the way in, gradients unscaled on the way out), whichever branch runs; the branch taken
    records its layer's statistics, the other records none."""
    grads, telemetry = {}, {}
    for loss_scale in ("none", "adaptive"):
        model, x = Branches(), (torch.randn(4, 8) + 1).requires_grad_()
        options = {"recipe": "fp8-e5m2", "executor": executor, "loss_scale": loss_scale}
        if loss_scale == "adaptive":
            options |= {"loss_scale_rule": "fixed", "loss_scale_init": 2**6, "loss_scale_interval": 1}
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="lowprec", options=options)
        for sign in (1, -1, 1):  # the statistics of a call show after the next one
            compiled(sign * x).square().sum().backward()
        grads[loss_scale] = [x.grad, *(p.grad for p in model.parameters())]
        telemetry = {t.layer: t for t in lpcompile.stats(model)}
    for got, expected in zip(grads["adaptive"], grads["none"], strict=True):
        assert torch.equal(float_bits(got), float_bits(expected))
    assert list(telemetry) == ["a", "b"] and telemetry["a"].cumulative == 2**6, telemetry
    assert math.isnan(telemetry["a"].underflow) and telemetry["b"].underflow == 0.0  # the call before: b


def test_rowwise_scaling_rounds_a_branch_per_tensor():
    """The rounding per matmul runs in the joint graph, which holds a branch as a subgraph:
    a branch's products take the per-tensor counterpart, and coverage says so."""
    model = Branches()
    x = (torch.randn(4, 8) + 1).requires_grad_()
    c = torch.randn(4, 8)
    rowwise = {role: {"scaling": "rowwise"} for role in ("weight", "activation", "error")}
    y = run(model, x, c, {"recipe": "fp8-rowwise", "executor": "eager", **rowwise})
    rows = {row.layer: row.quantized for row in lpcompile.coverage(model)}
    assert rows["a"]["weight"] == rows["b"]["activation"] == "e4m3 nearest saturate tensorwise"
    assert rows["a"]["error"] == "e4m3 nearest inf tensorwise"

    def e4(t: torch.Tensor) -> torch.Tensor:  # torch's cast of the tensor scaled to E4M3's range
        scale = (448 / t.detach().abs().max().double()).float()
        return (t.detach() * scale).to(torch.float8_e4m3fn).float() / scale

    w = model.a.weight
    assert torch.equal(y.detach(), e4(x) @ e4(w).t() + model.a.bias.detach())
    assert torch.equal(x.grad, e4(c) @ e4(w))


def test_per_matmul_options_name_the_branch_layers_they_do_not_reach():
    torch._dynamo.reset()
    model = Branches()
    options = {"recipe": "fp8-rowwise-gw-hp", "executor": "eager"}
    with pytest.warns(UserWarning, match=r"the backward matmuls of \['a', 'b'\] in torch.cond branches"):
        torch.compile(model, backend="lowprec", options=options)(torch.randn(4, 8)).sum().backward()
