"""Products under ``torch.vmap`` (ensembles of models stacked with ``torch.func``): each
member is rounded as the model it stands for, and draws stochastic-rounding bits of its
own. Torch's fallback for an operator without a vmap rule rounds slice by slice, every
slice with the same random bits, so identical members stayed identical. Differentiating
with ``torch.func`` is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from grid import SR_EVERYWHERE, grid_step
from models import Records
from torch import nn
from torch.func import functional_call, stack_module_state

MEMBERS = 3


def _member() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class Ensemble(nn.Module):
    """Members' parameters stacked, the members run by ``torch.vmap`` (torch.func's recipe)."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        params, _ = stack_module_state(members)
        self.names = list(params)
        self.stacked = nn.ParameterList([nn.Parameter(params[name].detach().clone()) for name in self.names])
        self.base = copy.deepcopy(members[0]).to("meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def member(*params):
            return functional_call(self.base, dict(zip(self.names, params, strict=True)), (x,))

        return torch.vmap(member)(*self.stacked)


class Loop(nn.Module):
    """The same members, called one by one."""

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(copy.deepcopy(members))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.members])


def _members(same: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    members = [_member() for _ in range(MEMBERS)]
    if same:
        for m in members[1:]:
            m.load_state_dict(members[0].state_dict())
    return members


def _step(model: nn.Module, x: torch.Tensor, options: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch._dynamo.reset()
    out = torch.compile(model, backend="lowprec", options=options)(x)
    out.square().sum().backward()
    return out, [p.grad for p in model.parameters() if p.grad is not None]


POW2 = {"scaling": "tensorwise_pow2"}
# round to nearest; factors of two, so that FP32 sums of the rounded products are exact
# whatever order a batched matmul adds them in
RECIPES = {
    "fp8-e5m2": {"recipe": "fp8-e5m2"},
    "tensorwise": {"recipe": "fp8-tensorwise", "weight": POW2, "activation": POW2, "error": POW2},
    "fp8-rowwise": {"recipe": "fp8-rowwise"},
    "mxfp8": {"recipe": "mxfp8"},
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_vmapped_members_are_rounded_as_the_members_called_one_by_one(recipe):
    """Round to nearest: no random bits, so the vmapped ensemble equals the loop bit for bit,
    outputs and gradients, with scales per member (tensorwise), per row and per block."""
    members = _members()
    x = torch.randn(5, 8) * 3
    options = {**RECIPES[recipe], "executor": "eager"}
    out, grads = _step(Ensemble(members), x, options)
    want, want_grads = _step(Loop(members), x, options)
    assert torch.equal(out, want)
    # the loop's gradients per member, stacked as the ensemble's parameters are
    stacked = [torch.stack(want_grads[i :: len(grads)]) for i in range(len(grads))]
    for got, expected in zip(grads, stacked, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_identical_members_draw_stochastic_rounding_bits_of_their_own(executor):
    """Members with the same weights, on the same input: their weights and activations are
    rounded with other bits, so outputs and gradients differ."""
    members = _members(same=True)
    out, grads = _step(Ensemble(members), torch.randn(5, 8), {**SR_EVERYWHERE, "executor": executor})
    for member in range(1, MEMBERS):
        assert not torch.equal(out[0], out[member])
        assert all(not torch.equal(g[0], g[member]) for g in grads)


def test_vmapped_products_run_on_the_grid():
    """On the grid forward and backward; the stacked parameters are weights (their
    gradients rounded too), and the layers are named as ``named_modules()`` names them."""
    records = Records()
    model = Ensemble(_members())
    check = grid_step(model, {"x": torch.randn(5, 8)}, SR_EVERYWHERE)
    assert check.count >= 5 and check.off_grid == {}, check.products
    roles = {(s.layer, s.role) for s in records.only().sites.values()}
    assert {(layer, role) for layer in ("base.0", "base.2") for role in ("weight", "weight_grad")} <= roles
    assert {layer for layer, _ in roles} <= dict(model.named_modules()).keys()


def test_differentiating_with_torch_func_is_refused_by_name():
    """torch.func.grad cannot run lowprec's rounding operators' autograd formulas (a torch
    bug, pytorch/pytorch#170834): the compile stops with an error that says so and what to
    use instead, rather than torch's about autograd.Function's setup_context."""
    model = _member()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def per_sample_grads(params, x):
        def loss(params, sample):
            return functional_call(model, params, (sample[None],)).square().sum()

        return torch.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)

    torch._dynamo.reset()
    compiled = torch.compile(per_sample_grads, backend="lowprec", options=SR_EVERYWHERE)
    refused = r"torch.func.grad.*pytorch/pytorch#170834"
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=refused):
        compiled(params, torch.randn(4, 8))
