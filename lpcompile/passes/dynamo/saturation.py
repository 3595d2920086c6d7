"""Counting what the forward quantize nodes saturate (option ``saturation``)."""

from __future__ import annotations

import torch
import torch.fx

from lpcompile.numerics.formats import parse_format
from lpcompile.passes.driver import CompileContext
from lpcompile.passes.graph import inline


def counts_saturation(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """Option ``saturation`` on, in a graph with forward quantize nodes."""
    quantizes = gm.graph.find_nodes(op="call_function", target=torch.ops.lowprec.quantize.default)
    return ctx.config.saturation != "off" and bool(quantizes)


def insert_saturation_counts(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Append to ``gm``'s outputs an int64 tensor of shape ``(sites, 2)``: per forward
    quantize node of ``gm`` (in graph order; :attr:`CompileContext.counted` names their
    sites), how many of its inputs lie beyond the format's largest finite value
    (infinities included) and how many are inf or NaN. The backend's wrapper takes it
    off the outputs (``lpcompile.backend.runtime``)."""
    nodes = gm.graph.find_nodes(op="call_function", target=torch.ops.lowprec.quantize.default)
    ctx.counted = [ctx.sites[node.meta["lowprec"]["offset"]] for node in nodes]
    limits = [parse_format(site.fmt).max for site in ctx.counted]

    def count(values: list[torch.Tensor]) -> torch.Tensor:
        rows = [
            torch.stack([(x.abs() > limit).sum(), torch.isfinite(x).logical_not().sum()])
            for x, limit in zip(values, limits, strict=True)
        ]
        return torch.stack(rows)

    output = gm.graph.output_node()
    counts = inline(gm, output, count, {"values": [node.args[0] for node in nodes]})
    (outputs,) = output.args
    output.args = ((*outputs, counts),)
    gm.recompile()
