"""``lpcompile.coverage(model)``: per product, the rounded roles with format and rounding,
or why it stays in higher precision, for every recipe (not only adaptive ones)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from grid import SR_EVERYWHERE, GridCheck, on_e5m2_grid, watched_backend
from models import LinearFunction
from torch import nn

import lpcompile


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.kept = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.kept(self.first(x))
        q = h.view(2, 2, 1, 4)
        return F.scaled_dot_product_attention(q, q, q).sum()


def test_coverage_lists_rounded_roles_and_the_reason_for_each_kept_product():
    model = Mixed()
    options = {"recipe": "fp8-e5m2-sr", "executor": "eager", "exclude": ["kept"], "attention": "off"}
    torch._dynamo.reset()
    torch.compile(model, backend="lowprec", options=options)(torch.randn(2, 8)).backward()
    rows = {row.layer: row for row in lpcompile.coverage(model)}
    assert rows["first"].quantized == {
        "activation": "e5m2 nearest saturate",
        "weight": "e5m2 nearest saturate",
        "weight_grad": "e5m2 stochastic inf",
        "error": "e5m2 stochastic inf",
    }
    assert (rows["kept"].kept, rows["kept"].op) == ("exclude", "linear")
    kept = {row.op: row.kept for row in rows.values() if row.kept}
    assert kept["scaled_dot_product_attention"] == "attention='off'"
    assert lpcompile.coverage(nn.Linear(2, 2)) == []  # a model never compiled


def test_a_graph_compiled_under_no_grad_lists_no_backward_roles():
    """Its products have no backward: no error or weight gradient is listed as rounded."""
    model = Mixed()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr", "executor": "eager"})
    with torch.no_grad():
        compiled(torch.randn(2, 8))
    rows = {row.layer: row.quantized for row in lpcompile.coverage(model)}
    assert rows["first"] == {"activation": "e5m2 nearest saturate", "weight": "e5m2 nearest saturate"}, rows


def test_frozen_layers_list_the_backward_roles_their_backward_computes():
    """A frozen first layer, whose input needs no gradient, has no backward product: neither
    its error nor its weight gradient is listed (its error was). A frozen last layer still
    passes the error on, rounded, as the dispatch check sees it run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    model[4].requires_grad_(False)
    check = GridCheck()
    torch._dynamo.reset()
    loss = torch.compile(model, backend=watched_backend(SR_EVERYWHERE, check))(torch.randn(4, 8)).sum()
    with check:
        loss.backward()
    rows = {row.layer: set(row.quantized) for row in lpcompile.coverage(model)}
    assert rows == {
        "0": {"activation", "weight"},
        "2": {"activation", "weight", "error", "weight_grad"},
        "4": {"activation", "weight", "error"},
    }
    # the forward's three, and the backward's: layer 4's error times its weight, layer 2's
    # weight gradient
    assert check.count == 5 and not check.off_grid


class Teacher(nn.Module):
    """A layer run under ``torch.no_grad()`` inside a training ``forward`` (a teacher's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher, self.student, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(x)
        return self.head(torch.relu(self.student(x)) + target)


def test_a_layer_under_no_grad_in_a_training_forward_lists_no_backward_roles():
    """Its weight gets no gradient (listed as rounded, it was), and its output no error."""
    model = Teacher()
    check = GridCheck()
    torch._dynamo.reset()
    loss = torch.compile(model, backend=watched_backend(SR_EVERYWHERE, check))(torch.randn(4, 8)).sum()
    with check:
        loss.backward()
    assert model.teacher.weight.grad is None
    rows = {row.layer: set(row.quantized) for row in lpcompile.coverage(model)}
    assert rows["teacher"] == {"activation", "weight"}
    assert rows["student"] == {"activation", "weight", "error", "weight_grad"}
    assert check.count == 3 + 3 and not check.off_grid  # the head's two and the student's one


class Guided(nn.Module):
    """A layer under ``torch.enable_grad()`` inside a ``forward`` called under ``no_grad``
    (classifier guidance in a sampling loop): its product has a backward. ``function``: the
    product a custom ``torch.autograd.Function``'s."""

    def __init__(self, function: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer, self.function = nn.Linear(8, 8, bias=False), function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return LinearFunction.apply(x, self.layer.weight) if self.function else self.layer(x)


@pytest.mark.parametrize("function", [False, True], ids=["linear", "function"])
def test_a_layer_under_enable_grad_in_a_no_grad_call_rounds_its_backward(function):
    """The graph compiles under no_grad, but the layer's output gets a gradient: its error
    and weight gradient are rounded and counted (they were not, and its backward ran off
    the grid)."""
    model = Guided(function)
    check = GridCheck()
    torch._dynamo.reset()
    options = {**SR_EVERYWHERE, "saturation": "count"}
    run = torch.compile(model, backend=watched_backend(options, check))
    with torch.no_grad():
        out = run(torch.randn(4, 8))
    with check:
        out.square().sum().backward()
    assert check.count >= 2 and not check.off_grid, dict(check.products)  # the backward's too
    assert on_e5m2_grid(model.layer.weight.grad)
    counted = {row.role for row in lpcompile.saturation(model) if row.calls}
    assert {"error", "weight_grad"} <= counted or function, counted  # (a Function's counts none)
    if not function:
        rows = {row.layer: set(row.quantized) for row in lpcompile.coverage(model)}
        assert rows["layer"] == {"activation", "weight", "error", "weight_grad"}
