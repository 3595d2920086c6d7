"""``lpcompile.coverage(model)``: per product, the rounded roles with format and rounding,
or why it stays in higher precision, for every recipe (not only adaptive ones)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
