"""An ``einsum`` of three or more operands written out as ``einsum`` calls of two, in the
order ATen contracts them (left to right, or along ``opt_einsum``'s path where torch
uses it): unrounded, the result is torch's bit for bit (ATen's own einsum along a given
path as the reference); under a recipe every product, partial products included, runs on
the E5M2 grid."""

from __future__ import annotations

import warnings

import pytest
import torch
from grid import grid_step
from torch import nn

import lpcompile
from lpcompile.passes.dynamo.chains import contract_pairs, einsum_path

EQUATIONS = [
    ("bi,ij,jk->bk", [(5, 7), (7, 9), (9, 3)]),
    ("bi,ij,bj->b", [(5, 7), (7, 9), (5, 9)]),  # a contraction over two operands at once
    ("bi,ij,jk", [(5, 7), (7, 9), (9, 3)]),  # an implicit output
    ("abc,cd,de,ef->abf", [(2, 3, 4), (4, 5), (5, 6), (6, 7)]),
    ("...i,ij,jk->...k", [(2, 3, 7), (7, 9), (9, 3)]),
    ("bhqd,bhkd,bhkv->bhqv", [(2, 3, 4, 8), (2, 3, 5, 8), (2, 3, 5, 6)]),
    ("Ab,bC,Ca", [(3, 4), (4, 5), (5, 3)]),  # upper case: A-Z before a-z
    ("...i,ij,jk->k", [(6, 5, 7), (7, 9), (9, 3)]),  # the ellipsis summed at the first pair
    ("...i,...ij,jk->k", [(5, 7), (6, 5, 7, 9), (9, 3)]),  # broadcast: see PATH_ORDER
    ("ii,ij,jk->k", [(4, 4), (4, 5), (5, 3)]),  # a diagonal
]
PATHS = [[(1, 2), (0, 1)], [(0, 2), (0, 1)], [(0, 1), (0, 1)]]
# Where an ellipsis broadcasts one operand against another, ATen's einsum along a path that
# contracts the two last sums the broadcast dimensions in another order: the same
# products, other FP32 bits.
PATH_ORDER = {("...i,...ij,jk->k", (1, 2))}


def _operands(shapes: list[tuple[int, ...]], grad: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(shape, requires_grad=grad) for shape in shapes]


@pytest.mark.parametrize("equation, shapes", EQUATIONS, ids=[eq for eq, _ in EQUATIONS])
def test_pairs_contract_as_aten_does(equation, shapes):
    """Left to right against torch's einsum without opt_einsum, and along each path of
    three operands against ATen's einsum given that path."""
    operands = _operands(shapes)
    with torch.backends.opt_einsum.flags(enabled=False):
        assert torch.equal(contract_pairs(equation, operands, None), torch.einsum(equation, *operands))
    if len(operands) == 3:
        for path in PATHS:
            want = torch._VF.einsum(equation, operands, path=[i for pair in path for i in pair])
            got = contract_pairs(equation, operands, path)
            if (equation, path[0]) in PATH_ORDER:
                assert torch.allclose(got, want, rtol=1e-5), path
            else:
                assert torch.equal(got, want), path


def test_another_order_gives_other_bits():
    """What makes the tests above and below able to fail: the order shows in the bits."""
    a, b, c = _operands([(5, 7), (7, 9), (9, 3)])
    assert not torch.equal((a @ b) @ c, a @ (b @ c))


@pytest.mark.parametrize("opt_einsum", [False, True])
def test_an_unrounded_chain_is_torchs_bit_for_bit(opt_einsum):
    """Compiled with every layer excluded, the chain equals torch's, with opt_einsum's path
    (here right to left: cheaper) and without it; so do its gradients left to right (along
    opt_einsum's path ATen's backward reads its intermediate in another layout: the same
    products, summed in another order)."""
    if opt_einsum and not torch.backends.opt_einsum.is_available():
        pytest.fail("opt_einsum is a test dependency")
    equation, shapes = "bi,ij,jk->bk", [(64, 2), (2, 64), (64, 8)]
    with torch.backends.opt_einsum.flags(enabled=opt_einsum):
        assert einsum_path(equation, shapes) == ([(1, 2), (0, 1)] if opt_einsum else None)
        operands = _operands(shapes, grad=True)
        want = torch.einsum(equation, *operands)
        want.sum().backward()
        want_grads = [t.grad.clone() for t in operands]
        for t in operands:
            t.grad = None
        torch._dynamo.reset()
        options = {"recipe": "fp8-e5m2-sr", "executor": "eager", "exclude": ["*"]}
        got = torch.compile(lambda *ts: torch.einsum(equation, *ts), backend="lowprec", options=options)(
            *operands
        )
        got.sum().backward()
    assert torch.equal(got, want)
    for t, grad in zip(operands, want_grads, strict=True):
        assert torch.equal(t.grad, grad) if not opt_einsum else torch.allclose(t.grad, grad, rtol=1e-5)


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(8, 6) / 2)
        self.w2 = nn.Parameter(torch.randn(6, 4) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,ij,jk->bk", x, self.w1, self.w2)


def test_every_product_of_a_chain_runs_on_the_grid():
    model = nn.Sequential(Chain())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = grid_step(model, {"input": torch.randn(5, 8)}, {"recipe": "fp8-e5m2-sr", "executor": "eager"})
    assert [str(w.message) for w in caught if "lowprec" in str(w.message)] == []
    # two products forward; the first's weight gradient, the second's two gradients
    assert check.count == 5 and not check.off_grid, check.products
    rows = lpcompile.coverage(model)
    assert sorted(r.layer for r in rows) == ["0#0", "0#1"] and not [r for r in rows if r.kept]
