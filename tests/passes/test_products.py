"""Every product, not only linear/conv/matmul: addmm, baddbmm, addbmm, einsum, bilinear,
mv, dot, addr, torch.sparse's mm and addmm on dense tensors, the method forms and grouped
matmuls, with roles from the graph (a parameter operand is a weight)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from grid import GridCheck, grid_step, on_e5m2_grid, on_scaled_fp8_rows, watched_backend
from models import Records
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import prune

import lpcompile
from lpcompile.passes.dynamo.numpy_products import KEPT
from lpcompile.passes.dynamo.quantize import CDIST, OPAQUE, SOLVE

OPTIONS = {"recipe": "fp8-e5m2-sr", "executor": "eager"}


class Products(nn.Module):
    """HF GPT-2's Conv1D (addmm with the weight as mat2), a slice of a stacked weight, einsum
    with a weight, baddbmm and addbmm of activations, bilinear, mv, dot and addr (an outer
    product whose backward multiplies the error), and method calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.b = nn.Parameter(torch.zeros(8))
        self.v = nn.Parameter(torch.randn(8) / 3)
        self.bilinear = nn.Bilinear(8, 8, 8)
        self.stacked = nn.Parameter(torch.randn(2, 8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.addmm(self.b, x, self.w) @ self.stacked[1, :, :8]
        h = torch.einsum("bi,ij->bj", h, self.w)
        a = h.view(4, 1, 8)
        h = torch.baddbmm(a, a, a.transpose(1, 2) @ a).flatten(1)
        h = h + torch.addbmm(self.b, a.transpose(1, 2), a).sum(0)
        h = self.bilinear(h, x).addmm(x, self.w)
        outer = torch.addr(self.w, h[0], self.v).sum()
        return h.sum() + torch.mv(h, self.v).sum() + torch.dot(self.v, self.v) + h.mv(self.v).sum() + outer


def test_every_product_runs_on_the_grid_forward_and_backward():
    records = Records()
    check = grid_step(Products(), {"x": torch.randn(4, 8)}, OPTIONS)
    assert check.count >= 20, check.products
    assert check.off_grid == {}, check.products
    assert not check.unknown, check.unknown
    roles = {(s.layer, s.role) for s in records.only().sites.values()}
    # the parameter operands are weights (their gradients rounded too), the rest activations
    weights = {("w", "weight"), ("w", "weight_grad"), ("bilinear", "weight"), ("v", "weight")}
    assert weights | {("stacked", "weight"), ("stacked", "weight_grad")} <= roles  # through w[1, :, :8] too


class DenseSparseCalls(nn.Module):
    """``torch.sparse.mm`` and ``torch.sparse.addmm`` of dense tensors (a graph network's
    adjacency kept dense), the weight ``w`` passed by keyword."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.v = nn.Parameter(torch.randn(8, 8) / 3)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.b = nn.Parameter(torch.zeros(6, 8))

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.sparse.mm(adj, x @ self.v)
        return torch.sparse.addmm(self.b, adj, torch.sparse.mm(sparse=h, dense=self.w))


class InPlace(nn.Module):
    """The in-place forms: ``out.addmm_(x, w)`` and its siblings, into a tensor of the graph's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.v = nn.Parameter(torch.randn(8) / 3)
        self.b = nn.Parameter(torch.randn(8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b.expand(x.shape[0], 8).clone()
        out.addmm_(x, self.w)
        batch = out.view(2, 2, 8)
        acc = torch.zeros(2, 2, 2)
        acc.baddbmm_(batch, batch.transpose(1, 2))
        total = torch.zeros(8, 8)
        total.addbmm_(batch.transpose(1, 2), batch)
        vec = torch.zeros(4)
        vec.addmv_(out, self.v)
        total.addr_(self.v, self.b)
        return acc.sum() + total.sum() + vec.sum() + out.sum()


def test_inplace_products_run_on_the_grid_and_compute_as_torch():
    """Each in-place product becomes its product copied into the tensor: rounded like the
    others, and, unrounded, the model's own values."""
    check = grid_step(InPlace(), {"x": torch.randn(4, 8)}, OPTIONS)
    assert check.count == 13 and check.off_grid == {} and not check.unknown, check.products
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    unrounded = {**OPTIONS, "exclude": ["*"]}
    assert torch.equal(torch.compile(InPlace(), backend="lowprec", options=unrounded)(x), InPlace()(x))


# every role scaled per row (the rowwise recipe leaves weight gradients unrounded)
ROWWISE = {
    "recipe": "fp8-rowwise",
    **{role: {"scaling": "rowwise"} for role in ("weight", "activation")},
    "error": {"fmt": "e5m2", "scaling": "rowwise"},
}


@pytest.mark.parametrize(
    ("options", "on_operand"),
    [({"recipe": "fp8-e5m2-sr"}, None), (ROWWISE, on_scaled_fp8_rows)],
    ids=["e5m2", "rowwise"],
)
def test_sparse_namespace_products_of_dense_tensors_run_on_the_grid(options, on_operand):
    """As ``mm`` and ``addmm``, which they compute: rowwise along the summed dimension."""
    records = Records()
    check = GridCheck(on_operand=on_operand) if on_operand else GridCheck()
    inputs = {"adj": torch.rand(6, 6), "x": torch.randn(6, 8)}
    grid_step(DenseSparseCalls(), inputs, {**options, "executor": "eager"}, check)
    assert check.count >= 8 and check.off_grid == {} and not check.unknown, check.products
    roles = {(s.layer, s.role) for s in records.only().sites.values()}
    assert ("w", "weight") in roles and (("w", "weight_grad") in roles) == (options is not ROWWISE)


def test_without_the_quantize_pass_the_products_are_off_grid():
    """The check can fail: the same model with the products left alone."""
    check = grid_step(Products(), {"x": torch.randn(4, 8)}, {**OPTIONS, "exclude": ["*"]})
    assert check.off_grid, check.products


class Experts(nn.Module):
    """A mixture-of-experts layer's grouped matmuls, in bfloat16 (torch's grouped_mm on the
    CPU): rows of the input grouped by expert, each group times its expert's matrix."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Parameter((torch.randn(3, 32, 16) / 4).bfloat16())
        self.down = nn.Parameter((torch.randn(3, 32, 16) / 4).bfloat16())

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        h = F.grouped_mm(x, self.up.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(torch.relu(h), self.down, offs=offs)


def test_grouped_matmuls_of_experts_run_on_the_grid():
    records = Records()
    inputs = {"x": torch.randn(12, 16).bfloat16().requires_grad_(), "offs": torch.tensor([4, 8, 12]).int()}
    check = grid_step(Experts(), inputs, OPTIONS)
    # forward two; backward the input and the weight gradient of each
    assert check.products == {("_grouped_mm.default", True): 6}, check.products
    roles = {(s.layer, s.role) for s in records.only().sites.values()}
    assert {("up", "weight"), ("up", "weight_grad"), ("down", "weight"), ("down", "weight_grad")} <= roles


class PickedExperts(nn.Module):
    """Experts' weights picked per token (HF's ``batched_mm`` experts): ``w[ids]`` and
    ``index_select``, then ``bmm``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, 16, 8) / 4)
        self.v = nn.Parameter(torch.randn(3, 8, 16) / 4)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = torch.bmm(self.w[ids], x.unsqueeze(-1)).squeeze(-1)
        return torch.bmm(torch.relu(h).unsqueeze(1), self.v.index_select(0, ids).transpose(1, 2)).squeeze(1)


def test_weights_picked_per_token_are_weights_rounded_whole():
    """The parameter is quantized before the gather, so its gradient, summed over the
    tokens that picked each expert, leaves the graph rounded."""
    model, records = PickedExperts(), Records()
    check = grid_step(model, {"x": torch.randn(10, 8), "ids": torch.randint(0, 3, (10,))}, OPTIONS)
    assert check.count == 5 and check.off_grid == {}, check.products
    roles = {s.role for s in records.only().sites.values()}
    assert roles == {"activation", "weight", "weight_grad", "error"}
    assert on_e5m2_grid(model.w.grad) and on_e5m2_grid(model.v.grad)
    assert model.w.grad.count_nonzero() > 100  # rows picked by several tokens, summed


class Conv1D(nn.Module):
    """HF GPT-2's Conv1D: ``addmm(bias, x, weight)`` with the weight as (in, out)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(8, 16) / 3)
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, 8), mat2=self.weight).view(*x.shape[:-1], 16)


def test_keyword_operands_and_gpt2_conv1d_layout():
    """``torch.addmm(bias, x, mat2=w)``: the keyword operand moves to its position."""
    records = Records()
    check = grid_step(Conv1D(), {"x": torch.randn(2, 3, 8)}, OPTIONS)
    assert check.off_grid == {} and check.count == 2, check.products  # forward, weight gradient
    assert {s.role for s in records.only().sites.values()} == {"activation", "weight", "weight_grad", "error"}


@pytest.mark.parametrize("equation", ["bi->", "bi->ib"])
def test_einsum_of_one_operand_is_no_product(equation):
    """einsum of one operand is a sum or a permutation: nothing to quantize."""
    records = Records()
    torch.compile(lambda a: torch.einsum(equation, a), backend="lowprec", options=OPTIONS)(
        torch.randn(4, 8, requires_grad=True)
    )
    assert not records.only().sites


def test_adaptive_scaling_reads_conv1d_output_features_from_the_weights_last_dimension():
    """GPT-2's Conv1D weight is (in, out): the approx_range rule needs its output dimension."""
    from lpcompile.backend import REGISTRY

    class ConvThenTransposed(Conv1D):
        def forward(self, x):
            return super().forward(x) @ self.weight.t()

    model = ConvThenTransposed()
    torch._dynamo.reset()
    options = {"recipe": "fp8-e5m2-als", "executor": "eager"}
    torch.compile(model, backend="lowprec", options=options)(torch.randn(4, 8)).sum().backward()
    (state,) = REGISTRY.adaptive_states(model)
    assert state.out_dims == (1, 0)  # addmm(x, W): W's last dim; h @ W.t(): W's first


class Autocast(nn.Module):
    """Products of two dtypes, as autocast runs them: a bfloat16 layer output by an FP32
    tensor (HF Llama's attention under autocast: FP32 queries after the rotary embedding,
    bfloat16 values), around the compiled call or in a region of its own."""

    def __init__(self, inner: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.inner):
            h = self.a(x)
            return (h @ x.T).float() @ x


@pytest.mark.parametrize("inner", [False, True])
def test_products_of_two_dtypes_under_autocast_run_on_the_grid(inner):
    check = GridCheck()
    torch._dynamo.reset()
    run = torch.compile(Autocast(inner), backend=watched_backend(OPTIONS, check))
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not inner):
        out = run(x)
    with check:
        out.float().square().mean().backward()
    assert check.count == 9 and check.off_grid == {}, check.products  # forward 3, backward 6


def _e5m2(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float8_e5m2).to(t.dtype)


def _normed() -> tuple[nn.Module, object]:
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(16, 8, bias=False))
    weights = layer.parametrizations.weight
    return layer, lambda: torch._weight_norm(weights.original1, weights.original0, 0)


def _pruned() -> tuple[nn.Module, object]:
    layer = prune.random_unstructured(nn.Linear(16, 8, bias=False), "weight", amount=0.5)
    return layer, lambda: layer.weight_orig * layer.weight_mask


def _reference_grads(layer, weight, x, round_weight_grad: bool) -> list[torch.Tensor]:
    """Round to nearest by hand: input and weight forward, the error, and (or not) the weight
    gradient before it reaches the parameters it is computed from."""
    layer.zero_grad()
    w = weight()
    if round_weight_grad:
        w.register_hook(_e5m2)
    y = _e5m2(x) @ (w + (_e5m2(w) - w).detach()).T
    y.register_hook(_e5m2)
    y.square().sum().backward()
    return [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("make", [_normed, _pruned], ids=["weight_norm", "pruned"])
def test_a_weight_computed_from_parameters_is_a_weight_its_gradient_rounded(make):
    """``weight_norm``'s weight is computed in the graph from two parameters, a pruned one
    from a parameter and a buffer mask: a weight, whose gradient is rounded before it
    reaches those parameters. Bit for bit against a hand-written round-to-nearest reference
    (torch's float8 cast), and unlike the same reference without that rounding."""
    torch.manual_seed(0)
    layer, weight = make()
    x = torch.randn(32, 16)
    records = Records()
    run = torch.compile(layer, backend="lowprec", options={"recipe": "fp8-e5m2", "executor": "eager"})
    run(x).square().sum().backward()
    got = [p.grad.clone() for p in layer.parameters()]
    roles = {s.role for s in records.only().sites.values()}
    assert roles == {"activation", "weight", "weight_grad", "error"}
    want, unrounded = (_reference_grads(layer, weight, x, rounded) for rounded in (True, False))
    for a, b, c in zip(got, want, unrounded, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
        assert not torch.equal(a, c), "the weight gradient's rounding changes these gradients"


def test_spectral_norm_weight_is_a_weight_after_its_power_iteration_is_rounded():
    """``spectral_norm``'s weight is divided by a norm from a power iteration, whose own
    products come first in the graph and are rounded (reading lowprec's seed input): the
    weight is still found to come from the parameter and the iteration's buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(16, 8)))
    records = Records()
    grid_step(model, {"input": torch.randn(4, 16)}, OPTIONS)
    roles = {s.role for s in records.only().sites.values() if s.layer == "0"}
    assert roles == {"activation", "weight", "weight_grad", "error"}


class EinsumForms(nn.Module):
    """einsum's other spellings: operands as one list (HF Longformer's), and sublists of
    ints with and without an output sublist (A-Z are 0-25, a-z 26-51: the implicit output
    of ``[30, 2], [2, 5]`` is "Fe", the weight's axis first)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 6) / 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            torch.einsum("bi,ij->bj", [x, self.w]),
            torch.einsum("bi,ij->bj", (x, self.w)),
            torch.einsum(x, [0, 1], self.w, [1, 2], [0, 2]),
            torch.einsum(x, [30, 2], self.w, [2, 5]),
        )


def test_einsum_forms_compute_torch_einsum_of_rounded_operands():
    """Each form is a product with the weight a weight (two operands on the grid, forward
    and backward), and computes what torch's einsum computes from the operands rounded to
    nearest (torch's own E5M2 cast)."""
    model, x = EinsumForms(), torch.randn(4, 8)
    records = Records()
    check = GridCheck()
    options = {"recipe": "fp8-e5m2", "executor": "eager"}
    torch._dynamo.reset()
    outs = torch.compile(model, backend=watched_backend(options, check))(x)
    with check:
        sum(out.sum() for out in outs).backward()
    assert check.off_grid == {} and check.count == 4 * 2, check.products  # forward, weight gradient
    roles = [(s.layer, s.role) for s in records.only().sites.values()]
    assert roles.count(("w", "weight")) == 4, roles
    e5m2 = lambda t: t.to(torch.float8_e5m2).float()  # noqa: E731
    want = torch.einsum("bi,ij->bj", e5m2(x), e5m2(model.w.detach()))
    for out in outs[:3]:
        assert torch.equal(out, want)
    assert outs[3].shape == (6, 4) and torch.equal(outs[3], want.T)


@torch.library.custom_op("lowprec_test::fused_mm", mutates_args=())
def fused_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A library's fused product: its matmul runs inside the operator."""
    return torch.relu(x @ w.t())


@fused_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("lowprec_test::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class LibraryOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(double(fused_mm(x, self.w)))


def test_custom_operators_that_may_multiply_warn_and_are_listed():
    """lowprec cannot see inside another library's operator: one of two float tensors, which
    may multiply them, is named in a warning and in coverage; one of one tensor is not."""
    model = LibraryOps()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="lowprec", options=OPTIONS)
    warning = r"custom operators run as they are: lowprec_test::fused_mm in 'w'"  # named after its weight
    with pytest.warns(UserWarning, match=warning) as caught, torch.no_grad():  # (no autograd formulas)
        compiled(torch.randn(4, 8))
    assert not [w for w in caught if "lowprec_test::double" in str(w.message)]
    kept = [(row.layer, row.op, row.kept) for row in lpcompile.coverage(model) if row.kept]
    assert kept == [("w", "lowprec_test::fused_mm", OPAQUE)]


class Distances(nn.Module):
    """Distances of each input row to a learned codebook (vector-quantised models)."""

    def __init__(self, form: str, **kwargs) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.codes = nn.Parameter(torch.randn(40, 8))
        self.form, self.kwargs = form, kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "cdist":
            return torch.cdist(x, self.codes, **self.kwargs)
        c = self.codes
        squared = x.square().sum(-1, keepdim=True) - 2 * x @ c.mT + c.square().sum(-1)
        return squared.clamp_min(0).sqrt()


@pytest.mark.parametrize(
    ("kwargs", "multiplies"),
    [({}, True), ({"compute_mode": "donot_use_mm_for_euclid_dist"}, False), ({"p": 1.0}, False)],
)
def test_cdist_that_multiplies_inside_warns_and_is_listed(kwargs, multiplies):
    """torch.cdist's p=2 distances between more than 25 rows go through a matrix product
    inside the call, unrounded (the check sees it off the grid): a warning and coverage say
    so. Other modes do not multiply."""
    model = Distances("cdist", **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = grid_step(model, {"x": torch.randn(30, 8)}, OPTIONS)
    said = [str(w.message) for w in caught if "torch.cdist in 'cdist'" in str(w.message)]
    kept = [(row.op, row.kept) for row in lpcompile.coverage(model) if row.kept]
    if multiplies:
        assert check.off_grid and len(said) == 1 and "matrix product" in said[0]
        assert kept == [("cdist", CDIST)]
    else:
        assert check.count == 0 and not said and not kept


def test_distances_written_out_as_the_warning_says_run_on_the_grid():
    check = grid_step(Distances("written"), {"x": torch.randn(30, 8)}, OPTIONS)
    assert check.count == 2 and check.off_grid == {}, check.products  # forward, weight gradient


class Inverse(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.eye(8) + torch.randn(8, 8) / 8)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "inv":
            return x @ torch.linalg.inv(self.w)
        return x @ torch.linalg.matrix_power(self.w, {"power": -3, "inverse power": -1}[self.form])


@pytest.mark.parametrize("form", ["inv", "power", "inverse power"])
def test_an_inverse_warns_and_is_listed_and_its_power_is_rounded(form):
    """The inverse multiplies inside its backward, unrounded (the check sees two products
    off the grid there): a warning and coverage say so. A negative matrix power is the
    power of the inverse: its products are rounded."""
    model = Inverse(form)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = grid_step(model, {"x": torch.randn(4, 8)}, OPTIONS)
    said = [str(w.message) for w in caught if "lowprec: linalg_inv in " in str(w.message)]
    assert len(said) == 1 and SOLVE in said[0]
    assert [(row.op, row.kept) for row in lpcompile.coverage(model) if row.kept] == [("linalg_inv", SOLVE)]
    assert check.off_grid == {"mm.default": 2}, check.products  # the inverse's backward
    rounded = {"inv": 2, "power": 8, "inverse power": 2}[form]  # x @ inv(w) and its gradients; a^2, a^3
    assert check.products[("mm.default", True)] == rounded, check.products


class SolveFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.linalg.solve(w, x.T).T

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return torch.linalg.solve(w.T, g.T).T, None


def test_a_solve_inside_a_function_warns():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.eye(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return SolveFunction.apply(x, self.w)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = torch.compile(Net(), backend="lowprec", options=OPTIONS)
        run(torch.randn(4, 8, requires_grad=True)).sum().backward()
    said = [str(w.message) for w in caught if "lowprec: linalg_solve in" in str(w.message)]
    # one warning, naming the forward body's solve and the backward body's
    assert len(said) == 1 and said[0].count("linalg_solve in") == 2 and SOLVE in said[0], said


class NumPyProducts(nn.Module):
    """A layer, then NumPy products of its output and of a second weight's copy (Dynamo runs
    NumPy code on tensors: nothing flows back through it), added to the layer's output."""

    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer(x)
        a, w = h.detach().numpy(), self.w.detach().numpy()
        products = {
            "operator": lambda: a @ w,
            "matmul": lambda: np.matmul(a, w),
            "einsum": lambda: np.einsum("bi,ij->bj", a, w),
            "dot": lambda: np.dot(a, w),
            "dot-3d": lambda: np.dot(a.reshape(2, 2, 8), w).reshape(4, 8),
            "method": lambda: a.dot(w),
            "inner": lambda: np.inner(a, w),
            "tensordot": lambda: np.tensordot(a, w, axes=1),
            "tensordot-pair": lambda: np.tensordot(a, w, axes=(1, 0)),
            "einsum-optimize": lambda: np.einsum("bi,ij->bj", a, w, optimize=True),
            "scalar": lambda: np.dot(a, 2.0),
            "inplace": lambda: _matmul_in_place(a.copy(), w),
            "multi_dot": lambda: np.linalg.multi_dot([a, w, w]),
            "outer": lambda: np.outer(a[0], w[0])[:4],
            "float64": lambda: (a @ w.astype(np.float64)).astype(np.float32),
        }
        return h + torch.from_numpy(products[self.form]())


NUMPY_FORMS = [
    "operator",
    "matmul",
    "einsum",
    "dot",
    "dot-3d",
    "method",
    "inner",
    "tensordot",
    "multi_dot",
    "outer",
    "tensordot-pair",
    "einsum-optimize",
]


def _matmul_in_place(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    a @= w
    return a


@pytest.mark.parametrize("form", NUMPY_FORMS)
def test_numpy_products_run_on_the_grid(form):
    """Dynamo traces NumPy's products as wrappers of ``torch._numpy``; each is written as the
    torch function of the same result, so its operands are rounded (off the grid before,
    without a warning)."""
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = grid_step(NumPyProducts(form), {"x": torch.randn(4, 8)}, OPTIONS)
    assert not [w for w in caught if "numpy" in str(w.message).lower()]
    products = {"multi_dot": 2, "outer": 0}.get(form, 1)  # ATen's outer is a broadcast multiply
    assert check.off_grid == {} and check.count == 2 + products, check.products  # and the layer's two


def test_numpy_products_match_numpy_on_rounded_operands():
    """Under round-to-nearest, each form of one product gives NumPy's own result on operands
    cast by torch (a chain's is rounded between its products, which NumPy's is not)."""
    x = torch.randn(4, 8)
    options = {"recipe": "fp8-e5m2", "executor": "eager"}
    for form in [f for f in NUMPY_FORMS if f != "multi_dot"]:
        torch._dynamo.reset()
        got = torch.compile(NumPyProducts(form), backend="lowprec", options=options)(x)
        reference = NumPyProducts(form)
        with torch.no_grad():
            h = F.linear(_e5m2(x), _e5m2(reference.layer.weight), reference.layer.bias)
            reference.layer = nn.Identity()  # the products take the layer's output, rounded
            reference.w.copy_(_e5m2(reference.w))
            expected = reference(_e5m2(h)) - _e5m2(h) + h
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg=form)


def _e5m2(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float8_e5m2).float()


@pytest.mark.parametrize(("form", "op"), [("float64", "matmul"), ("inplace", "imatmul")])
def test_numpy_products_left_as_they_are_warn_and_are_listed(form, op):
    """NumPy promotes float32 @ float64 to float64, which torch's matmul refuses, and
    ``a @= w`` writes into ``a``: those calls stay NumPy's, unrounded (off the grid), named
    in a warning and in coverage."""
    model = NumPyProducts(form)
    with pytest.warns(UserWarning, match=rf"numpy.{op} in '\w+': a NumPy product that torch"):
        check = grid_step(model, {"x": torch.randn(4, 8)}, OPTIONS)
    assert check.off_grid == {"mm.default": 1}, check.products
    assert [(row.op, row.kept) for row in lpcompile.coverage(model) if row.kept] == [(f"numpy.{op}", KEPT)]


def test_a_numpy_product_with_a_number_is_a_multiplication():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = grid_step(NumPyProducts("scalar"), {"x": torch.randn(4, 8)}, OPTIONS)
    assert not [w for w in caught if "numpy" in str(w.message).lower()]
    assert check.count == 2 and check.off_grid == {}, check.products  # the layer's
