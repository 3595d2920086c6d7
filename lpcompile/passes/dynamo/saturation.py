"""Counting what the quantize nodes saturate (option ``saturation``).

The forward quantize nodes of the graph (weights and activations) are counted in one
more output of the graph. The quantize nodes autograd puts into the backward for each
``quantize_grad`` site (errors and weight gradients), in the graph and in the
activation-checkpoint bodies and ``torch.cond`` branches it calls, are counted in the
gradient of a probe input: a ``lowprec::count_grad`` node right after each
``quantize_grad`` sees the incoming gradient exactly as that quantize will (after any
loss scale), and returns its counts as its row of the probe's gradient.
"""

from __future__ import annotations

import torch
import torch.fx

from lpcompile.numerics.formats import parse_format
from lpcompile.numerics.scale_grad import PROBE_SIZE, range_counts
from lpcompile.passes.driver import CompileContext
from lpcompile.passes.dynamo.quantize import checkpoint_bodies, cond_branches, graph_input
from lpcompile.passes.graph import inline

QUANTIZE = torch.ops.lowprec.quantize.default
QUANTIZE_GRAD = torch.ops.lowprec.quantize_grad.default
COUNT_GRAD = torch.ops.lowprec.count_grad.default
# The probe input: per counted gradient site, its range_counts, then backward passes.
SATURATION_INPUT = "lowprec_saturation"


def counts_saturation(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """Option ``saturation`` on, in a graph with forward quantize nodes, or with
    ``quantize_grad`` sites (of its own or its bodies') and a backward to come."""
    if ctx.config.saturation == "off":
        return False
    forward = gm.graph.find_nodes(op="call_function", target=QUANTIZE)
    return bool(forward) or (torch.is_grad_enabled() and bool(gradient_sites(gm)))


def gradient_sites(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.GraphModule, torch.fx.Node]]:
    """The ``quantize_grad`` nodes of ``gm`` and of the checkpoint bodies and ``torch.cond``
    branches it calls, each with its graph, in the order they run."""
    bodies: dict[torch.fx.Node, list[torch.fx.GraphModule]] = {}
    for body, call in checkpoint_bodies(gm) + cond_branches(gm):
        bodies.setdefault(call, []).append(body)
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == QUANTIZE_GRAD:
            found.append((gm, node))
        for body in bodies.get(node, ()):
            found += gradient_sites(body)
    return found


def insert_saturation_counts(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Count, per call, where the inputs of each forward quantize node of ``gm`` lie against
    the format's range (:func:`~lpcompile.numerics.scale_grad.range_counts`), in an int64
    ``(sites, 4)`` tensor appended to the outputs (:attr:`CompileContext.counted` names its
    sites; the backend's wrapper takes it off). With a backward to come, count the same of
    each gradient a ``quantize_grad`` site rounds, and the backward passes that reached it,
    in the gradient of the float64 probe input ``lowprec_saturation``
    (``(sites, PROBE_SIZE)``; :attr:`CompileContext.counted_grads` names its sites)."""
    nodes = gm.graph.find_nodes(op="call_function", target=QUANTIZE)
    if nodes:
        _count_outputs(gm, ctx, nodes)
    if torch.is_grad_enabled():
        _count_gradients(gm, ctx)


def _range(fmt: str) -> tuple[float, float]:
    """The largest finite and the smallest positive value of ``fmt``."""
    target = parse_format(fmt)
    return target.max, target.min_subnormal


def _count_outputs(gm: torch.fx.GraphModule, ctx: CompileContext, nodes: list[torch.fx.Node]) -> None:
    ctx.counted = [ctx.sites[node.meta["lowprec"]["offset"]] for node in nodes]
    ranges = [_range(site.fmt) for site in ctx.counted]

    def count(values: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([range_counts(x, *limits) for x, limits in zip(values, ranges, strict=True)])

    output = gm.graph.output_node()
    counts = inline(gm, output, count, {"values": [node.args[0] for node in nodes]})
    (outputs,) = output.args
    output.args = ((*outputs, counts),)
    gm.recompile()


def _count_gradients(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    found = gradient_sites(gm)
    if not found:
        return
    ctx.counted_grads = [ctx.sites[node.meta["lowprec"]["offset"]] for _, node in found]
    device = found[0][1].meta["example_value"].device
    example = torch.zeros(len(found), PROBE_SIZE, dtype=torch.float64, device=device)
    for i, ((graph, node), site) in enumerate(zip(found, ctx.counted_grads, strict=True)):
        probe = graph_input(graph, ctx, SATURATION_INPUT, example)
        users = list(node.users)
        with graph.graph.inserting_after(node):
            row = graph.graph.call_function(torch.select, (probe, 0, i))
        with graph.graph.inserting_after(row):
            counted = graph.graph.call_function(COUNT_GRAD, (node, row, *_range(site.fmt)))
        row.meta["example_value"] = example[i]
        counted.meta["example_value"] = node.meta.get("example_value")
        counted.meta["lowprec"] = {"role": "saturation_count", "layer": site.layer}
        for user in users:
            user.replace_input_with(node, counted)
    for graph in {id(g): g for g, _ in found}.values():
        graph.graph.lint()
        graph.recompile()
