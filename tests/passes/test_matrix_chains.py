"""``linalg.multi_dot``, ``chain_matmul`` and ``linalg.matrix_power`` written out as the
``mm``/``matmul`` calls ATen makes:
unrounded, the result is torch's bit for bit (another order gives other bits), of static
or symbolic sizes; under a recipe every product, partial products included, runs on the
E5M2 grid."""

from __future__ import annotations

import warnings

import pytest
import torch
from grid import grid_step
from torch import nn

import lpcompile

CHAINS = [
    [(5, 7), (7, 3)],  # one mm
    [(2, 9), (9, 4), (4, 6)],  # (AB)C is cheaper
    [(9, 2), (2, 8), (8, 3)],  # A(BC) is cheaper
    [(4, 4), (4, 4), (4, 4)],  # a tie: (AB)C
    [(3, 5), (5, 2), (2, 7), (7, 4)],  # the matrix-chain recurrence
    [(4, 4), (4, 4), (4, 4), (4, 4)],  # every order costs the same: the lowest splits, A(B(CD))
    [(6,), (6, 4), (4, 8), (8, 3), (3, 5), (5,)],  # a row and a column at the ends
    [(5,), (5, 3), (3,)],  # three, with 1-D ends: a scalar
]


def _chain(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(shape, requires_grad=True) for shape in shapes]


@pytest.mark.parametrize("shapes", CHAINS, ids=lambda shapes: "-".join("x".join(map(str, s)) for s in shapes))
def test_an_unrounded_chain_is_torchs_bit_for_bit(shapes):
    tensors = _chain(shapes)
    want = torch.linalg.multi_dot(tensors)
    want.sum().backward()
    want_grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    torch._dynamo.reset()
    options = {"recipe": "fp8-e5m2-sr", "executor": "eager", "exclude": ["*"]}
    got = torch.compile(lambda *ts: torch.linalg.multi_dot(ts), backend="lowprec", options=options)(*tensors)
    got.sum().backward()
    assert got.shape == want.shape and torch.equal(got, want)
    for t, grad in zip(tensors, want_grads, strict=True):
        assert torch.equal(t.grad, grad)


def test_the_other_order_of_three_gives_other_bits():
    """What makes the test above able to fail: the order shows in the bits."""
    for shapes in CHAINS[1:3]:
        a, b, c = (t.detach() for t in _chain(shapes))
        assert not torch.equal((a @ b) @ c, a @ (b @ c))


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.ParameterList(nn.Parameter(torch.randn(size, 4) / 2) for size in (8, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.multi_dot([x, *self.w])


class Deprecated(Chain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.chain_matmul(x, *self.w)


@pytest.mark.parametrize("model", [Chain, Deprecated])
def test_every_product_of_a_chain_runs_on_the_grid(model):
    model = nn.Sequential(model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = grid_step(model, {"input": torch.randn(6, 8)}, {"recipe": "fp8-e5m2-sr", "executor": "eager"})
    assert [str(w.message) for w in caught if "lowprec" in str(w.message)] == []
    # three mm forward, and each one's two gradients but the input's
    assert check.products == {("mm.default", True): 8}, check.products
    rows = lpcompile.coverage(model)
    assert sorted(r.layer for r in rows) == ["0#0", "0#1", "0#2"] and not [r for r in rows if r.kept]


def test_a_chain_of_symbolic_sizes_is_written_out_in_the_order_its_guards_hold():
    """Compiled dynamic, a chain runs ATen's order for each new set of sizes (ATen's
    choice compared the sizes, and the graph guards on the comparisons)."""
    torch._dynamo.reset()
    options = {"recipe": "fp8-e5m2-sr", "executor": "eager", "exclude": ["*"]}
    chain = torch.compile(
        lambda *ts: torch.linalg.multi_dot(ts), backend="lowprec", options=options, dynamic=True
    )
    for rows, inner in [(7, 4), (9, 4), (9, 40), (2, 40)]:
        tensors = [t.detach() for t in _chain([(rows, inner), (inner, 8), (8, 3), (3, 5)])]
        assert torch.equal(chain(*tensors), torch.linalg.multi_dot(tensors))


POWERS = [2, 3, 4, 5, 6, 7, 11, -2, -5]


@pytest.mark.parametrize("power", POWERS)
@pytest.mark.parametrize("form", ["linalg", "torch", "method", "keywords"])
def test_an_unrounded_matrix_power_is_torchs_bit_for_bit(power, form):
    torch.manual_seed(0)
    a = (torch.eye(6) + torch.randn(3, 6, 6) / 4).requires_grad_()  # (invertible)
    raise_to = {
        "linalg": lambda m: torch.linalg.matrix_power(m, power),
        "torch": lambda m: torch.matrix_power(m, power),
        "method": lambda m: m.matrix_power(power),
        "keywords": lambda m: torch.linalg.matrix_power(input=m, n=power),
    }[form]
    want = torch.linalg.matrix_power(a, power)
    (want_grad,) = torch.autograd.grad(want.sum(), a)
    torch._dynamo.reset()
    options = {"recipe": "fp8-e5m2-sr", "executor": "eager", "exclude": ["*"]}
    got = torch.compile(raise_to, backend="lowprec", options=options)(a)
    (grad,) = torch.autograd.grad(got.sum(), a)
    assert torch.equal(got, want) and torch.equal(grad, want_grad)


def test_another_order_of_a_power_gives_other_bits():
    """What makes the test above able to fail: a^5 as a @ a^4, not a^4 @ a."""
    torch.manual_seed(0)
    a = torch.randn(6, 6) / 2
    square = a @ a
    fourth = square @ square
    assert torch.equal(torch.linalg.matrix_power(a, 5), a @ fourth)
    assert not torch.equal(a @ fourth, fourth @ a)


class Power(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.linalg.matrix_power(self.w, 5)


def test_every_product_of_a_matrix_power_runs_on_the_grid():
    model = nn.Sequential(Power())
    check = grid_step(model, {"input": torch.randn(6, 8)}, {"recipe": "fp8-e5m2-sr", "executor": "eager"})
    # a^2, a^4, a @ a^4, x @ a^5 forward; each one's two gradients but the input's
    assert check.products == {("mm.default", True): 11}, check.products
