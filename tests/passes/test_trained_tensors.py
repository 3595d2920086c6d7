"""Weights that are no ``nn.Parameter``: ``torch.func.functional_call``'s fast weights
(first-order MAML, Reptile) and leaf tensors that require grad held by a module or a
global are weights, their gradients rounded; an argument of the compiled function that
requires grad is its input batch (adversarial training), its gradient left as it is."""

from __future__ import annotations

import warnings

import pytest
import torch
from grid import on_e5m2_grid
from torch import nn
from torch.func import functional_call

import lpcompile

OPTIONS = {"recipe": "fp8-e5m2-sr"}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def lowprec_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "lowprec" in str(w.message)]


@pytest.mark.parametrize("executor, leaf", [("eager", True), ("inductor", True), ("eager", False)])
def test_functional_call_fast_weights_are_weights(executor, leaf):
    """Fast weights in the modules' parameter slots: leaves (first-order MAML), or computed
    from tensors of their own (an inner step's result)."""
    model = mlp()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="lowprec", options={**OPTIONS, "executor": executor})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the coverage watch checks the second call
            bases = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
            fast = bases if leaf else {name: base * 1.0 for name, base in bases.items()}
            out = functional_call(compiled, fast, (torch.randn(5, 8),))
            grads = dict(
                zip(bases, torch.autograd.grad(out.square().sum(), list(bases.values())), strict=True)
            )
    assert on_e5m2_grid(grads["0.weight"]) and on_e5m2_grid(grads["2.weight"])
    # the products ran rounded on the fast weights: no module went unread
    assert not lowprec_warnings(caught)


W = (torch.randn(8, 4) / 3).requires_grad_()


class HeldTensors(nn.Module):
    """A weight as a plain tensor attribute, another as a global."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.w = (torch.randn(8, 8) / 3).requires_grad_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.a(x) @ self.w) @ W


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_leaf_tensors_a_module_or_a_global_holds_are_weights(executor):
    model = HeldTensors()
    W.grad = None
    x = torch.randn(5, 8, requires_grad=True)  # an input batch that requires grad
    torch._dynamo.reset()
    torch.compile(model, backend="lowprec", options={**OPTIONS, "executor": executor})(
        x
    ).square().sum().backward()
    assert on_e5m2_grid(model.w.grad) and on_e5m2_grid(W.grad) and on_e5m2_grid(model.a.weight.grad)
    assert not on_e5m2_grid(x.grad)  # an input gradient, left as it is
    rows = {row.layer: row.quantized for row in lpcompile.coverage(model)}
    assert "weight_grad" in rows["matmul"] and "weight_grad" in rows["matmul_1"]


def test_a_closure_cell_is_a_weight():
    w = (torch.randn(8, 4) / 3).requires_grad_()
    torch._dynamo.reset()
    f = torch.compile(lambda x: x @ w, backend="lowprec", options={**OPTIONS, "executor": "eager"})
    f(torch.randn(5, 8)).square().sum().backward()
    assert on_e5m2_grid(w.grad)


def test_arguments_that_require_grad_are_activations():
    """Directly, in a dict, or in ``*args``: the input batch (an adversarial example)."""
    x, y, z = ((torch.randn(8, 4) / 3).requires_grad_() for _ in range(3))
    torch._dynamo.reset()
    options = {**OPTIONS, "executor": "eager"}
    f = torch.compile(
        lambda a, x, batch, *rest: a @ x + a @ batch["y"] + a @ rest[0], backend="lowprec", options=options
    )
    f(torch.randn(5, 8), x, {"y": y}, z).square().sum().backward()
    assert not any(on_e5m2_grid(t.grad) for t in (x, y, z))
