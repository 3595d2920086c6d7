"""Option ``saturation``: per quantize site, where its inputs lie against the format's
range (beyond it, inf or NaN, non-zero, non-zero below its smallest value: counted; inf
or NaN in the forward: raised on), checked against counts taken by hand from the inputs,
and for errors and weight gradients from gradients computed by hand with torch's own
float8 casts."""

from __future__ import annotations

import warnings

import pytest
import torch
from grid import torchao_nvfp4
from models import LinearFunction
from torch import nn

import lpcompile
from lpcompile.backend.state import SaturationCount
from lpcompile.config import LowPrecConfig

E5M2_MAX = 57344.0
E5M2_SMALLEST = 2.0**-16
FORWARD_ROLES = ("weight", "activation")


def _counts(x: torch.Tensor) -> tuple[int, int, int, int]:
    """Beyond E5M2's range, inf or NaN, non-zero, non-zero below its smallest value."""
    x = x.detach()
    small = (x != 0) & (x.abs() < E5M2_SMALLEST)
    return tuple(int(n.sum()) for n in (x.abs() > E5M2_MAX, ~torch.isfinite(x), x != 0, small))


def _rounded(t: torch.Tensor) -> torch.Tensor:
    """Nearest even, overflowing to inf: the error and weight-gradient rounding of fp8-e5m2."""
    return t.to(torch.float8_e5m2).float()


def _saturated(t: torch.Tensor) -> torch.Tensor:
    """Nearest even, saturating: the weight and activation rounding of fp8-e5m2."""
    return _rounded(t.clamp(-E5M2_MAX, E5M2_MAX))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _input() -> torch.Tensor:
    x = torch.randn(3, 4)
    x[0, 0], x[1, 1], x[2, 2], x[2, 3] = 1e6, float("inf"), float("nan"), -7e4
    x[1, 0] = 1e-9
    return x


def _hidden(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The input of the second layer, as its quantize receives it."""
    with torch.no_grad():
        return torch.relu(_saturated(x) @ _saturated(model[0].weight).T + model[0].bias)


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.net, x, use_reentrant=False)


def _model(checkpointed: bool) -> tuple[nn.Module, nn.Sequential, str]:
    """The MLP, or a module that runs it under activation checkpointing; the MLP; the
    prefix of its layers' names."""
    if checkpointed:
        model = Checkpointed()
        return model, model.net, "net."
    model = _mlp()
    return model, model, ""


EXECUTORS_AND_CHECKPOINTING = pytest.mark.parametrize(
    "executor, checkpointed",
    [
        ("eager", False),
        ("eager", True),
        pytest.param("inductor", False, marks=pytest.mark.slow),
        pytest.param("inductor", True, marks=pytest.mark.slow),
    ],
)


def _row(r: SaturationCount) -> tuple[int, int, int, int, int]:
    return r.calls, r.saturated, r.nonfinite, r.nonzero, r.underflow


def _by_role(model: nn.Module) -> dict[tuple[str, str], tuple[int, int, int]]:
    return {(r.layer, r.role): (r.calls, r.saturated, r.nonfinite) for r in lpcompile.saturation(model)}


@EXECUTORS_AND_CHECKPOINTING
def test_counts_what_each_layer_saturates(executor, checkpointed):
    model, net, prefix = _model(checkpointed)
    run = torch.compile(
        model, backend="lowprec", options={"recipe": "fp8-e5m2", "saturation": "count", "executor": executor}
    )
    x = _input()
    clean = torch.randn(3, 4)
    run(x).sum().backward()
    with torch.no_grad():
        run(clean)
    rows = lpcompile.saturation(model)
    # 1e6, inf and -7e4 beyond (NaN compares false); inf and NaN; all non-zero; 1e-9 below
    assert _counts(x) == (3, 2, 12, 1)
    graphs = sorted({r.graph_id for r in rows})
    assert len(graphs) == 2, "the training graph and the no-grad graph"
    forward = [r for r in rows if r.role in FORWARD_ROLES]
    assert {r.graph_id for r in rows if r.role not in FORWARD_ROLES} == {graphs[0]}, "no backward: no rows"
    counted = {(r.graph_id, r.layer.removeprefix(prefix), r.role): _row(r) for r in forward}
    expected = {}
    for graph, inputs in zip(graphs, (x, clean), strict=True):
        expected[(graph, "0", "activation")] = (1, *_counts(inputs))
        expected[(graph, "0", "weight")] = (1, *_counts(net[0].weight))
        expected[(graph, "2", "activation")] = (1, *_counts(_hidden(net, inputs)))
        expected[(graph, "2", "weight")] = (1, *_counts(net[2].weight))
    # the NaN spreads to its row of the hidden layer; the infinity was saturated, so it does not
    assert expected[(graphs[0], "2", "activation")][1:3] == (0, 8 * int(torch.isnan(x).any(1).sum()))
    assert counted == expected


class Branches(nn.Module):
    """A layer in each branch of a ``torch.cond``, then one after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        with torch.no_grad():
            self.b.weight[0, 0] = 1e5

    def forward(self, x: torch.Tensor, take_a: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cond(take_a, lambda x: self.a(x), lambda x: self.b(x), (x,)))


@pytest.mark.parametrize("executor", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_counts_the_branch_each_call_took(executor):
    """A ``torch.cond`` branch's weights and activations are counted on the calls that take
    it; the branch not taken adds nothing, its call count included."""
    model = Branches()
    options = {"recipe": "fp8-e5m2", "saturation": "count", "executor": executor}
    run = torch.compile(model, backend="lowprec", options=options)
    inputs = [(_input(), True), (torch.randn(3, 4), False), (torch.randn(3, 4) * 1e5, True)]
    for x, take_a in inputs:
        run(x, torch.tensor(take_a)).sum().backward()
    rows = {(r.layer, r.role): _row(r) for r in lpcompile.saturation(model) if r.role in FORWARD_ROLES}

    def total(xs: list[torch.Tensor]) -> tuple[int, ...]:
        return (len(xs), *(sum(n) for n in zip(*map(_counts, xs), strict=True)))

    taken = {name: [x for x, take_a in inputs if take_a == (name == "a")] for name in ("a", "b")}
    for name in ("a", "b"):
        layer = getattr(model, name)
        assert rows[(name, "activation")] == total(taken[name])
        assert rows[(name, "weight")] == total([layer.weight] * len(taken[name]))
    assert rows[("b", "weight")][1] == 1, "b's saturated weight, counted on the one call that took b"
    assert rows[("head", "weight")][0] == 3
    backward = {
        (r.layer, r.role): r.calls for r in lpcompile.saturation(model) if r.role not in FORWARD_ROLES
    }
    assert backward[("a", "error")] == 2 and backward[("b", "error")] == 1


class FunctionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(2, 4))
        with torch.no_grad():
            self.w[1, 2] = 1e5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LinearFunction.apply(x, self.w)


class CheckpointedFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = FunctionNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.net, x, use_reentrant=False)


@EXECUTORS_AND_CHECKPOINTING
def test_counts_the_roundings_of_a_functions_bodies(executor, checkpointed):
    """A custom Function's forward body counts its weight and activation into the graph's
    rows, its backward body its error into the probe's gradient; the weight gradient it
    returns is rounded, and counted, outside it. The saved tensors its backward reads
    again are the forward's roundings: not counted twice."""
    model = CheckpointedFunction() if checkpointed else FunctionNet()
    net, layer = (model.net, "net") if checkpointed else (model, "w")  # (named after its call)
    options = {"recipe": "fp8-e5m2", "saturation": "count", "executor": executor}
    run = torch.compile(model, backend="lowprec", options=options)
    x, g = _input(), _large_error()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (run(x) * g).sum().backward()
    assert not [w for w in caught if "lowprec" in str(w.message)]
    rows = {(r.layer, r.role): _row(r) for r in lpcompile.saturation(model)}
    assert rows == {
        (layer, "activation"): (1, *_counts(x)),
        (layer, "weight"): (1, *_counts(net.w)),
        (layer, "error"): (1, *_counts(g)),
        (layer, "weight_grad"): (1, *_counts(_rounded(g).t() @ _saturated(x))),
    }
    assert rows[(layer, "weight")][1] == 1 and rows[(layer, "error")][1:3] == (3, 2)


def test_a_frozen_function_is_not_counted_into_the_backward():
    """A Function no gradient flows through (a frozen weight, an input batch) keeps its
    backward from running: the probe is not passed to it."""
    model = nn.Sequential(FunctionNet(), nn.Linear(2, 2))
    model[0].w.requires_grad_(False)
    options = {"recipe": "fp8-e5m2", "saturation": "count", "executor": "eager"}
    run = torch.compile(model, backend="lowprec", options=options)
    run(torch.randn(3, 4)).sum().backward()
    roles = {(r.layer, r.role) for r in lpcompile.saturation(model)}
    assert ("0", "weight") in roles and ("1", "error") in roles
    assert ("0", "error") not in roles


def test_counts_add_up_over_calls_and_name_a_saturated_weight():
    model = _mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = 1e5
    run = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2", "saturation": "count"})
    for _ in range(3):
        run(torch.randn(2, 4))
    counts = _by_role(model)
    assert counts[("2", "weight")] == (3, 3, 0)
    assert counts[("0", "activation")] == (3, 0, 0)


def test_raise_names_the_layer_a_non_finite_value_entered():
    model = _mlp()
    run = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr", "saturation": "raise"})
    run(torch.randn(3, 4)).sum().backward()  # finite: runs
    x = torch.randn(3, 4)
    x[1, 2] = float("inf")
    with pytest.raises(FloatingPointError, match=r"quantize of 0 \(activation to e5m2: 1 value\(s\)\)"):
        run(x)
    x[1, 2] = 1e9  # saturates, but finite: counted only
    run(x)
    assert _by_role(model)[("0", "activation")] == (3, 2, 1), "the raising call counts too"


def test_off_adds_no_output_and_counts_nothing():
    model = _mlp()
    run = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2", "executor": "eager"})
    out = run(_input())
    assert out.shape == (3, 2)
    assert lpcompile.saturation(model) == []


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"saturation must be one of \('off', 'count', 'raise'\)"):
        LowPrecConfig.from_options({"saturation": True})
    with pytest.raises(ValueError, match="count in the stages instead"):
        LowPrecConfig.from_options({"recipe": "fp8-e5m2", "saturation": "count", "pipeline": {"stages": 2}})


def _gradient_counts(model: nn.Sequential, x: torch.Tensor, g: torch.Tensor) -> dict:
    """What the error and weight-gradient quantizes of ``fp8-e5m2`` receive when the loss
    is ``(model(x) * g).sum()``, by hand: torch's float8 casts, plain matmuls."""
    first, last = model[0], model[2]
    with torch.no_grad():
        qx = _saturated(x)
        pre = qx @ _saturated(first.weight).T + first.bias
        qh = _saturated(torch.relu(pre))
        error = _rounded(g)
        hidden_error = torch.where(pre > 0, error @ _saturated(last.weight), 0.0)
        return {
            ("2", "error"): _counts(g),
            ("2", "weight_grad"): _counts(error.T @ qh),
            ("0", "error"): _counts(hidden_error),
            ("0", "weight_grad"): _counts(_rounded(hidden_error).T @ qx),
        }


def _gradient_rows(model: nn.Module, prefix: str = "") -> dict:
    return {
        (r.layer.removeprefix(prefix), r.role): _row(r)
        for r in lpcompile.saturation(model)
        if r.role not in FORWARD_ROLES
    }


def _large_error() -> torch.Tensor:
    g = torch.linspace(-1.0, 1.0, 6).reshape(3, 2)
    g[0, 0], g[1, 1], g[2, 0], g[2, 1] = 1e6, float("inf"), -7e4, float("nan")
    g[0, 1] = 1e-6
    return g


@EXECUTORS_AND_CHECKPOINTING
def test_counts_what_each_gradient_saturates(executor, checkpointed):
    model, net, prefix = _model(checkpointed)
    options = {"recipe": "fp8-e5m2", "saturation": "count", "executor": executor}
    run = torch.compile(model, backend="lowprec", options=options)
    x, g = torch.randn(3, 4), _large_error()
    expected = _gradient_counts(net, x, g)
    assert expected[("2", "error")] == (3, 2, 6, 1) and expected[("0", "weight_grad")][1] > 0
    (run(x) * g).sum().backward()
    assert _gradient_rows(model, prefix) == {key: (1, *n) for key, n in expected.items()}
    (last_error,) = [r for r in lpcompile.saturation(model) if r.layer == f"{prefix}2" and r.role == "error"]
    assert last_error.underflow_fraction == 1 / 6
    run(x).sum().backward()  # errors of 1: nothing beyond the range
    clean = _gradient_counts(net, x, torch.ones(3, 2))
    assert all(n[:2] == (0, 0) for n in clean.values())
    run(x)  # a forward without a backward: its call counts only for the forward sites
    totals = {key: (2, *(a + b for a, b in zip(n, clean[key], strict=True))) for key, n in expected.items()}
    assert _gradient_rows(model, prefix) == totals
    assert {r.calls for r in lpcompile.saturation(model) if r.role in FORWARD_ROLES} == {3}


def test_an_error_is_counted_as_its_loss_scale_left_it():
    """Adaptive loss scaling multiplies the error by the layer's scale before its quantize:
    errors that fit the format unscaled overflow scaled, and are counted."""
    torch._dynamo.reset()  # (a fresh recompile budget for nn.Sequential's forward)
    model = _mlp()
    options = {
        "recipe": "fp8-e5m2-als",
        "saturation": "count",
        "executor": "eager",
        "loss_scale_rule": "fixed",
        "loss_scale_init": 2.0**8,
    }
    run = torch.compile(model, backend="lowprec", options=options)
    g = torch.full((3, 2), 300.0)
    g[0] = 100.0  # 2**8 x 100 fits E5M2, 2**8 x 300 does not
    (run(torch.randn(3, 4)) * g).sum().backward()
    assert _counts(g)[:2] == (0, 0)
    assert _gradient_rows(model)[("2", "error")] == (1, *_counts(g * 2.0**8))
    assert _counts(g * 2.0**8)[:2] == (4, 0)


def test_frozen_layers_are_not_counted_into_the_backward():
    """Counting a frozen layer's error would tie it to the probe, so that the backward
    reaches it (a frozen model's output would need a gradient): frozen sites are left out."""
    torch._dynamo.reset()  # (a fresh recompile budget for nn.Sequential's forward)
    options = {"recipe": "fp8-e5m2", "saturation": "count", "executor": "eager"}
    model = _mlp()
    model[0].requires_grad_(False)
    torch.compile(model, backend="lowprec", options=options)(torch.randn(3, 4)).sum().backward()
    rows = {(r.layer, r.role) for r in lpcompile.saturation(model)}
    assert {("2", "error"), ("2", "weight_grad"), ("0", "weight")} <= rows
    assert not {("0", "error"), ("0", "weight_grad")} & rows
    frozen = _mlp().requires_grad_(False)
    out = torch.compile(frozen, backend="lowprec", options=options)(torch.randn(3, 4))
    assert not out.requires_grad


def _blocks_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 8))  # rows of 40 and 24
    x = torch.randn(6, 40)
    x[:, 32:] *= 1e-6  # the last block of each row far below the others (MX's last, short, block)
    return model, x


def _block_counts(recipe: str, executor: str) -> dict[tuple[str, str], tuple[int, int, int, int, int]]:
    torch._dynamo.reset()
    model, x = _blocks_model()
    options = {"recipe": recipe, "executor": executor, "saturation": "count"}
    torch.compile(model, backend="lowprec", options=options)(x).square().mean().backward()
    return {(r.layer, r.role): _row(r) for r in lpcompile.saturation(model)}


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8-blockwise"])
def test_block_scaled_recipes_count_each_block_at_its_scale(recipe):
    """The counts of a layer whose rows end in a short block (the forward's counts, written
    into the graph, failed to trace the blocks' factors): the input's underflow is that of
    each block at its own scale: none for MX (a power of two per block keeps E4M3's range),
    with DeepSeek's blocks of 128 the values below E4M3's smallest subnormal at each
    block's factor (torchao's), and with NVFP4 the values E2M1's 0.5 loses at the E4M3
    block scale of torchao's nvfp4_quantize."""
    calls, saturated, nonfinite, nonzero, underflow = _block_counts(recipe, "eager")[("0", "activation")]
    assert (calls, saturated, nonfinite, nonzero) == (1, 0, 0, 240)
    if recipe == "mxfp8":
        assert underflow == 0
        return
    if recipe == "fp8-blockwise":  # a block per row of 40: torchao's factor, 448 over its amax
        _, x = _blocks_model()
        scaled = x * (448.0 / x.abs().amax(-1, keepdim=True).double()).float()
        assert underflow == int(((scaled != 0) & (scaled.abs() < 2.0**-9)).sum()) > 0
        return
    _, x = _blocks_model()
    scaled = x * torchao_nvfp4(x)[1]
    assert underflow == int(((scaled != 0) & (scaled.abs() < 0.5)).sum()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", "fp8-blockwise"])
def test_block_scaled_counts_under_inductor_equal_the_eager_executors(recipe):
    assert _block_counts(recipe, "inductor") == _block_counts(recipe, "eager")
