"""Counting what the quantize nodes saturate (option ``saturation``).

The forward quantize nodes (weights and activations) of the graph and of the
activation-checkpoint bodies it calls are counted in one more output of the graph (a
body returns its rows as one more output of its own). The quantize nodes autograd puts
into the backward for each ``quantize_grad`` site (errors and weight gradients), in the
graph and in the activation-checkpoint bodies and ``torch.cond`` branches it calls, are
counted in the gradient of a probe input: a ``lowprec::count_grad`` node right after
each ``quantize_grad`` sees the incoming gradient exactly as that quantize will (after
any loss scale), and returns its counts as its row of the probe's gradient.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from lpcompile.numerics.quantize import scaling_argument, whole_tensor
from lpcompile.numerics.scale_grad import count_probe, range_counts
from lpcompile.passes.driver import CompileContext, Site
from lpcompile.passes.dynamo.quantize import checkpoint_bodies, graph_input, nodes_in_run_order
from lpcompile.passes.graph import inline, needs_grad

QUANTIZE = torch.ops.lowprec.quantize.default
QUANTIZE_GRAD = torch.ops.lowprec.quantize_grad.default
COUNT_GRAD = torch.ops.lowprec.count_grad.default
# The probe input: per counted gradient site, its range_counts, then backward passes.
SATURATION_INPUT = "lowprec_saturation"


def counts_saturation(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """Option ``saturation`` on, in a graph with quantize nodes (in it or in its bodies)."""
    if ctx.config.saturation == "off":
        return False
    graphs = [module.graph for module in gm.modules() if isinstance(module, torch.fx.GraphModule)]
    targets = (QUANTIZE, QUANTIZE_GRAD)
    return any(graph.find_nodes(op="call_function", target=t) for graph in graphs for t in targets)


def gradient_sites(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.GraphModule, torch.fx.Node]]:
    """The ``quantize_grad`` nodes whose values get a gradient, of ``gm`` and of the
    checkpoint bodies and ``torch.cond`` branches it calls, in the order they run (a
    frozen layer's error gets none: counting it would make the backward reach it)."""

    def picked(graph: torch.fx.GraphModule) -> list[torch.fx.Node]:
        nodes = graph.graph.find_nodes(op="call_function", target=QUANTIZE_GRAD)
        return [node for node in nodes if needs_grad(node)]

    return nodes_in_run_order(gm, picked)


def insert_saturation_counts(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Count, per call, where the inputs of each forward quantize node of ``gm`` and of the
    checkpoint bodies it calls lie against the format's range
    (:func:`~lpcompile.numerics.scale_grad.range_counts`), in an int64 ``(sites, 4)`` tensor
    appended to the outputs (:attr:`CompileContext.counted` names its sites; the backend's
    wrapper takes it off; a body returns its rows as one more output). With a backward to
    come, count the same of each gradient a ``quantize_grad`` site rounds, and the backward
    passes that reached it, in the gradient of the float64 probe input
    ``lowprec_saturation`` (a row of ``PROBE_SIZE`` per site;
    :attr:`CompileContext.counted_grads` names its sites)."""
    counted, counts = _forward_counts(gm, ctx)
    if counts is not None:
        ctx.counted = counted
        output = gm.graph.output_node()
        (outputs,) = output.args
        output.args = ((*outputs, counts),)
        gm.recompile()
    if torch.is_grad_enabled():
        _count_gradients(gm, ctx)


def _forward_counts(gm: torch.fx.GraphModule, ctx: CompileContext) -> tuple[list[Site], torch.fx.Node | None]:
    """The sites of the forward quantize nodes of ``gm`` and of the checkpoint bodies it
    calls (each call has a body of its own), in the order they run, and a node before
    ``gm``'s output holding their range counts, one row each (None without sites)."""
    bodies = {call: body for body, call in checkpoint_bodies(gm)}
    sites: list[Site] = []
    parts: list[Any] = []  # runs of own quantize nodes (node, range), and bodies' count nodes
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == QUANTIZE:
            site = ctx.sites[node.meta["lowprec"]["offset"]]
            if not parts or not isinstance(parts[-1], list):
                parts.append([])
            parts[-1].append((node.args[0], (site.fmt, site.scaling)))
            sites.append(site)
        elif node in bodies:
            body = bodies[node]
            body_sites, body_counts = _forward_counts(body, ctx)
            if body_counts is not None:
                sites += body_sites
                parts.append(_output_of(gm, node, _return_also(body, body_counts), body))
    if not parts:
        return sites, None

    def count(parts: list[Any]) -> torch.Tensor:
        blocks = [
            torch.stack([_whole_counts(x, spec) for x, spec in part]) if isinstance(part, list) else part
            for part in parts
        ]
        return torch.cat(blocks) if len(blocks) > 1 else blocks[0]

    return sites, inline(gm, gm.graph.output_node(), count, {"parts": parts})


def _whole_counts(x: torch.fx.Proxy, spec: tuple[str, str]) -> torch.fx.Proxy:
    """:func:`range_counts` of ``x``, of the whole tensor where ``x`` is a DTensor (tensor
    parallelism: DTensor's sums of a split tensor hold each rank's part until then),
    decided when AOT autograd traces the graph."""
    return x.tracer.create_proxy("call_function", whole_tensor, (range_counts(x, *spec),), {})


def _return_also(body: torch.fx.GraphModule, value: torch.fx.Node) -> int:
    """Append ``value`` to the outputs of ``body``; return its index there."""
    output = body.graph.output_node()
    (outputs,) = output.args
    output.args = ((*outputs, value),)
    body.recompile()
    return len(outputs)


def _output_of(
    gm: torch.fx.GraphModule, call: torch.fx.Node, index: int, body: torch.fx.GraphModule
) -> torch.fx.Node:
    """A node of ``gm`` reading output ``index`` of ``call``, which calls ``body``."""
    with gm.graph.inserting_after(call):
        item = gm.graph.call_function(operator.getitem, (call, index))
    value = body.graph.output_node().args[0][index].meta.get("example_value")
    item.meta["example_value"] = value
    example = call.meta.get("example_value")
    if isinstance(example, tuple | list) and len(example) == index:
        call.meta["example_value"] = (*example, value)
    return item


def _count_gradients(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    found = gradient_sites(gm)
    if not found:
        return
    ctx.counted_grads = [ctx.sites[node.meta["lowprec"]["offset"]] for _, node in found]
    # (count_grad delivers each site's counts on the probe's device)
    example = count_probe(len(found), found[0][1].meta["example_value"].device).detach()
    for i, ((graph, node), site) in enumerate(zip(found, ctx.counted_grads, strict=True)):
        probe = graph_input(graph, ctx, SATURATION_INPUT, example)
        users = list(node.users)
        with graph.graph.inserting_after(node):
            row = graph.graph.call_function(torch.select, (probe, 0, i))
        with graph.graph.inserting_after(row):
            scaling = scaling_argument(site.scaling)
            counted = graph.graph.call_function(COUNT_GRAD, (node, row, site.fmt, *scaling))
        row.meta["example_value"] = example[i]
        counted.meta["example_value"] = node.meta.get("example_value")
        counted.meta["lowprec"] = {"role": "saturation_count", "layer": site.layer}
        for user in users:
            user.replace_input_with(node, counted)
    for graph in {id(g): g for g, _ in found}.values():
        graph.graph.lint()
        graph.recompile()
