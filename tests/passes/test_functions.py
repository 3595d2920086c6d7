"""Custom ``torch.autograd.Function``s: the quantize pass enters their forward and
backward bodies, rounds what their backward reads from the forward with the forward's
bits, and adaptive loss scaling treats each call as a layer."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import float_bits
from grid import SR_EVERYWHERE, Calls, GridCheck, grid_step, on_e5m2_grid, watched_backend
from models import LinearFunction, LinearFunctionT, Records, lowprec_nodes
from torch import nn
from torch.utils.checkpoint import checkpoint

import lpcompile

aten = torch.ops.aten


class TwoOutputs(torch.autograd.Function):
    """Two outputs whose gradients the backward adds: a non-tensor input (``k``) too."""

    @staticmethod
    def forward(ctx, x, w, k):
        ctx.save_for_backward(x, w)
        ctx.k = k
        h = x @ w
        return h * k, h.sum(-1)

    @staticmethod
    def backward(ctx, g_scaled, g_sum):
        x, w = ctx.saved_tensors
        g = g_scaled * ctx.k + g_sum[:, None]
        return g @ w.t(), x.t() @ g, None


class Custom(nn.Module):
    def __init__(self, function: type[torch.autograd.Function] = LinearFunction) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        self.function = function

    def forward(self, x):
        return self.function.apply(x, self.weight)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fn = Custom()
        self.w2 = nn.Parameter(torch.randn(8, 8) / 3)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        a, b = TwoOutputs.apply(torch.relu(self.fn(x)), self.w2, 0.5)
        return self.head(a + b[:, None])


class CheckpointedModel(Model):
    def forward(self, x):
        return checkpoint(super().forward, x, use_reentrant=False)


def lowprec_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "lowprec" in str(w.message)]


@pytest.mark.parametrize("make", [Model, CheckpointedModel])
def test_function_products_run_on_the_grid_in_forward_and_backward(make):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = grid_step(make(), {"x": torch.randn(4, 8, requires_grad=True)}, SR_EVERYWHERE)
    # each Function: one product forward, two backward; the head: addmm, two mm
    assert check.count >= 9 and not check.off_grid, dict(check.products)
    assert not [m for m in lowprec_warnings(caught) if "higher precision" in m]


def e5(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float8_e5m2).float()


@pytest.mark.parametrize("function", [LinearFunction, LinearFunctionT])
def test_a_function_matches_a_hand_written_reference(function):
    """Round to nearest even: the forward reads E5M2 operands, the backward an E5M2 error
    and the forward's E5M2 operands, and the weight gradient leaves on the grid (torch's
    own casts as the reference)."""
    model = Custom(function)
    x = torch.randn(4, 8, requires_grad=True)
    c = torch.randn(4, 8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2", "executor": "eager"})
    y = compiled(x)
    (y * c).sum().backward()

    w = model.weight.detach()
    expected_y = e5(x.detach()) @ e5(w).t()
    expected_gx = e5(c) @ e5(w)
    expected_gw = e5(e5(c).t() @ e5(x.detach()))
    for got, expected in ((y, expected_y), (x.grad, expected_gx), (model.weight.grad, expected_gw)):
        assert torch.equal(float_bits(got.detach()), float_bits(expected))


ADAPTIVE_SR = {**SR_EVERYWHERE, "recipe": "fp8-e5m2-als"}


@pytest.mark.parametrize("options", [SR_EVERYWHERE, ADAPTIVE_SR], ids=["sr", "adaptive"])
@pytest.mark.parametrize("function", [LinearFunction, LinearFunctionT])
def test_the_backward_reads_saved_tensors_with_the_forwards_bits(function, options):
    """Stochastic rounding: the backward body rounds the saved input and weight with the
    forward's random stream, so its products read the very operands the forward did (the
    forward rounds the weight itself where Dynamo hands it ``w.T`` too, through adaptive
    loss scaling's nodes around the arguments)."""
    model, x = Custom(function), torch.randn(4, 8, requires_grad=True)
    mode = Calls(aten.mm.default)
    torch._dynamo.reset()
    y = torch.compile(model, backend=watched_backend(options, mode))(x)
    with mode:
        (y * torch.randn(4, 8)).sum().backward()
    # x @ w.T; grad @ w; grad.T @ x
    (x_fwd, w_t_fwd), (_, w_bwd), (_, x_bwd) = [args for _, args, _ in mode.calls]
    assert not torch.equal(x_fwd, e5(x.detach())), "the input was rounded to nearest even"
    assert on_e5m2_grid(x_fwd) and on_e5m2_grid(w_bwd)
    assert torch.equal(float_bits(x_bwd), float_bits(x_fwd))
    assert torch.equal(float_bits(w_bwd), float_bits(w_t_fwd.t()))


def test_a_function_compiles_with_adaptive_scaling_at_symbolic_sizes():
    """Dynamo passes a Function the batch size as an input of its own where it is symbolic:
    no gradient reaches a size, so adaptive scaling's inf/NaN probe goes on a tensor. A
    graph whose one layer is a Function keeps its scales under the model's first
    parameter, where ``stats`` finds them."""
    model = Custom(LinearFunctionT)
    options = {"recipe": "fp8-e5m2-als", "executor": "eager"}
    torch._dynamo.reset()
    run = torch.compile(model, backend="lowprec", options=options, dynamic=True)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.01), lpcompile.LossScaler("adaptive")
    for batch in (8, 5, 3):
        opt.zero_grad()
        scaler.scale(run(torch.randn(batch, 8)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
    assert torch.isfinite(model.weight).all()
    rows = lpcompile.stats(model)
    assert rows and {t.layer for t in rows} == {"weight"} and all(t.history for t in rows)


def test_functional_code_of_one_function_keeps_one_adaptive_state():
    """Without a parameter in the graph, the scales belong to no model (not to the input
    batch, new at every call): one state, counting every call."""
    from lpcompile.backend import REGISTRY

    torch._dynamo.reset()
    options = {"recipe": "fp8-e5m2-als", "executor": "eager"}
    run = torch.compile(lambda x, w: LinearFunction.apply(x, w), backend="lowprec", options=options)
    w = torch.randn(8, 8, requires_grad=True)
    states = len(REGISTRY.adaptive_states())
    unowned = REGISTRY.entry(REGISTRY.no_model).adaptive
    kept = dict(unowned)
    try:
        for _ in range(4):
            run(torch.randn(4, 8, requires_grad=True), w).sum().backward()
        # (the states of other tests' models may die meanwhile: counted, not sliced)
        assert len(REGISTRY.adaptive_states()) <= states + 1
        assert [state.calls for graph, state in unowned.items() if graph not in kept] == [4]
    finally:  # (a state of no model lives on, and LossScaler("adaptive") would see it later)
        unowned.clear()
        unowned.update(kept)


def test_a_function_call_is_a_layer_of_adaptive_loss_scaling():
    """Every output's gradient is scaled by the Function's own power of two and its input
    gradients unscaled: round to nearest even then gives the unscaled run's bits exactly
    (the backward adds both outputs' gradients: scaling one of them would not)."""
    grads = {}
    for loss_scale in ("none", "adaptive"):
        model, x = Model(), torch.randn(4, 8, requires_grad=True)
        options = {"recipe": "fp8-e5m2", "executor": "eager", "loss_scale": loss_scale}
        if loss_scale == "adaptive":
            options |= {"loss_scale_rule": "fixed", "loss_scale_init": 2**6}
        torch._dynamo.reset()
        torch.compile(model, backend="lowprec", options=options)(x).square().sum().backward()
        grads[loss_scale] = [x.grad, *(p.grad for p in model.parameters())]
    layers = {t.layer: t.cumulative for t in lpcompile.stats(model)}
    assert layers["fn"] > 1 and layers["w2"] > 1, layers
    for got, expected in zip(grads["adaptive"], grads["none"], strict=True):
        assert torch.equal(float_bits(got), float_bits(expected))


def test_coverage_names_a_functions_products_and_exclude_keeps_them():
    model = Model()
    torch._dynamo.reset()
    options = {"recipe": "fp8-e5m2-sr", "executor": "eager"}
    torch.compile(model, backend="lowprec", options=options)(torch.randn(4, 8)).sum().backward()
    rows = {row.layer: row for row in lpcompile.coverage(model)}
    assert set(rows) == {"fn", "w2", "head"}, rows
    assert set(rows["fn"].quantized) == {"activation", "weight", "error", "weight_grad"}, rows["fn"]
    assert rows["w2"].quantized["weight"].startswith("e5m2"), rows["w2"]

    model = Model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = grid_step(model, {"x": torch.randn(4, 8)}, {**options, "exclude": ["fn"]})
    kept = [row for row in lpcompile.coverage(model) if row.kept]
    assert [(row.layer, row.op, row.kept) for row in kept] == [("fn", "autograd.Function", "exclude")]
    # fn's forward product and its weight gradient's (x needs no gradient)
    assert check.off_grid == {"mm.default": 2}, dict(check.products)
    assert not [m for m in lowprec_warnings(caught) if "match no layer" in m]


def test_the_dump_labels_a_backward_bodys_roundings_by_the_phase_they_run_in():
    records = Records()
    torch._dynamo.reset()
    options = {"recipe": "fp8-e5m2-sr", "executor": "eager"}
    torch.compile(Model(), backend="lowprec", options=options)(torch.randn(4, 8)).sum().backward()
    nodes = lowprec_nodes(records.only().aten_graphs["backward"])
    labels = [n.meta["lowprec"] for n in nodes]
    phases = {(label["layer"], label["role"], label["phase"]) for label in labels}
    # The backward bodies round their errors, and re-round saved operands with the forward's
    # sites: only those label "forward" in the backward (no checkpoint recomputes the forward).
    assert {(layer, "error", "backward") for layer in ("fn", "w2", "head")} <= phases, phases
    assert {role for _, role, phase in phases if phase == "forward"} == {"activation", "weight"}, phases


def test_a_function_compiled_by_inductor_computes_what_the_fx_run_does():
    results = []
    for executor in ("eager", "inductor"):
        model, x = Model(), torch.randn(4, 8, requires_grad=True)
        torch._dynamo.reset()
        options = {"recipe": "fp8-e5m2", "executor": executor}
        y = torch.compile(model, backend="lowprec", options=options)(x)
        y.square().sum().backward()
        results.append([y, x.grad, *(p.grad for p in model.parameters())])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_grid_check_sees_functions_in_fp32_without_lowprec():
    """The check can fail: under the fp32 recipe the same products are off the grid."""
    check: GridCheck = grid_step(Model(), {"x": torch.randn(4, 8)}, {"recipe": "fp32", "executor": "eager"})
    assert check.off_grid.get("mm.default", 0) >= 4, dict(check.products)


class ScaleFunction(torch.autograd.Function):
    """An elementwise Function with a parameter (a fused norm's gain): no product."""

    @staticmethod
    def forward(ctx, x, gain):
        ctx.save_for_backward(x, gain)
        return x * gain

    @staticmethod
    def backward(ctx, grad):
        x, gain = ctx.saved_tensors
        return grad * gain, (grad * x).sum(0)


class Gained(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gain = nn.Parameter(torch.rand(8) + 0.5)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(ScaleFunction.apply(x, self.gain))


def test_a_function_without_products_is_no_layer():
    """Its parameter is no weight: its gradient stays FP32, as a norm's does."""
    model = Gained()
    torch._dynamo.reset()
    options = {"recipe": "fp8-e5m2-als", "executor": "eager"}
    torch.compile(model, backend="lowprec", options=options)(torch.randn(4, 8)).square().sum().backward()
    assert not on_e5m2_grid(model.gain.grad)
    assert {row.layer for row in lpcompile.coverage(model)} == {"head"}
    assert [t.layer for t in lpcompile.stats(model)] == ["head"]
