"""Option ``saturation``: per forward quantize node, the inputs beyond the format's range
(counted) and the non-finite ones (counted, or raised on), checked against counts
taken by hand from the inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lpcompile
from lpcompile.config import LowPrecConfig

E5M2_MAX = 57344.0


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _input() -> torch.Tensor:
    x = torch.randn(3, 4)
    x[0, 0], x[1, 1], x[2, 2], x[2, 3] = 1e6, float("inf"), float("nan"), -7e4
    return x


def _by_role(model: nn.Module) -> dict[tuple[str, str], tuple[int, int, int]]:
    return {(r.layer, r.role): (r.calls, r.saturated, r.nonfinite) for r in lpcompile.saturation(model)}


@pytest.mark.parametrize("executor", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_counts_what_each_layer_saturates(executor):
    model = _mlp()
    run = torch.compile(
        model, backend="lowprec", options={"recipe": "fp8-e5m2", "saturation": "count", "executor": executor}
    )
    x = _input()
    clean = torch.randn(3, 4)
    run(x).sum().backward()
    with torch.no_grad():
        hidden = torch.relu(model[0](clean))
        run(clean)
    rows = lpcompile.saturation(model)
    beyond = int((x.abs() > E5M2_MAX).sum())  # 1e6, inf and -7e4 (NaN compares false)
    assert (beyond, int((~torch.isfinite(x)).sum())) == (3, 2)
    assert not bool((hidden.abs() > E5M2_MAX).any())
    graphs = sorted({r.graph_id for r in rows})
    assert len(graphs) == 2, "the training graph and the no-grad graph"
    counted = {(r.graph_id, r.layer, r.role): (r.calls, r.saturated, r.nonfinite) for r in rows}
    expected = {
        (g, layer, role): (1, 0, 0) for g in graphs for layer in "02" for role in ("weight", "activation")
    }
    expected[(graphs[0], "0", "activation")] = (1, beyond, 2)
    # the NaN spreads to its row of the hidden layer; the infinity was saturated, so it does not
    expected[(graphs[0], "2", "activation")] = (1, 0, 8 * int(torch.isnan(x).any(1).sum()))
    assert counted == expected


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
