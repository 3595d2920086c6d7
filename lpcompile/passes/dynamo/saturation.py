"""Counting what the quantize nodes saturate (option ``saturation``).

The forward quantize nodes (weights and activations) of the graph and of the bodies it
calls (activation checkpoints, ``torch.cond`` branches, custom Functions' forwards) are
counted in one more output of the graph (a body returns its rows as one more output of
its own). The quantize nodes autograd puts into the backward for each ``quantize_grad``
site (errors and weight gradients), in the graph and in the activation-checkpoint bodies
and ``torch.cond`` branches it calls, are counted in the gradient of a probe input: a
``lowprec::count_grad`` node right after each ``quantize_grad`` sees the incoming
gradient exactly as that quantize will (after any loss scale), and returns its counts as
its row of the probe's gradient. A custom Function's backward body, whose errors are
rounded by plain quantize nodes, returns their rows as the gradient of the probe,
passed to the Function.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from lpcompile.numerics.quantize import scaling_argument, whole_tensor
from lpcompile.numerics.scale_grad import PROBE_SIZE, count_probe, range_counts
from lpcompile.passes.driver import CompileContext, Site
from lpcompile.passes.dynamo.functions import backward_inputs, function_bodies
from lpcompile.passes.dynamo.quantize import (
    checkpoint_bodies,
    cond_branches,
    graph_input,
    nodes_in_run_order,
)
from lpcompile.passes.graph import FUNCTION_APPLY, has_backward, inline, is_function_call, needs_grad

QUANTIZE = torch.ops.lowprec.quantize.default
QUANTIZE_GRAD = torch.ops.lowprec.quantize_grad.default
COUNT_GRAD = torch.ops.lowprec.count_grad.default
COUNTED = (QUANTIZE, QUANTIZE_GRAD)
# The probe input: per counted gradient site, its range_counts, then backward passes.
SATURATION_INPUT = "lowprec_saturation"


def counts_saturation(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """Option ``saturation`` on, in a graph with quantize nodes (in it or in its bodies)."""
    if ctx.config.saturation == "off":
        return False
    graphs = [module.graph for module in gm.modules() if isinstance(module, torch.fx.GraphModule)]
    return any(graph.find_nodes(op="call_function", target=t) for graph in graphs for t in COUNTED)


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
    bodies it calls lie against the format's range
    (:func:`~lpcompile.numerics.scale_grad.range_counts`, then 1: the call ran the site), in
    an int64 ``(sites, PROBE_SIZE)`` tensor appended to the outputs
    (:attr:`CompileContext.counted` names its sites; the backend's wrapper takes it off; a
    body returns its rows as one more output). With a backward to
    come, count the same of each gradient a ``quantize_grad`` site rounds, and the backward
    passes that reached it, in the gradient of the float64 probe input
    ``lowprec_saturation`` (a row of ``PROBE_SIZE`` per site, those of Functions' backward
    bodies last; :attr:`CompileContext.counted_grads` names its sites)."""
    counted, counts = _forward_counts(gm, ctx)
    if counts is not None:
        ctx.counted = counted
        output = gm.graph.output_node()
        (outputs,) = output.args
        output.args = ((*outputs, counts),)
        gm.recompile()
    if has_backward(gm):
        _count_gradients(gm, ctx)


def _forward_counts(gm: torch.fx.GraphModule, ctx: CompileContext) -> tuple[list[Site], torch.fx.Node | None]:
    """The sites of the forward quantize nodes of ``gm`` and of the checkpoint bodies and
    ``torch.cond`` branches it calls (each call has bodies of its own), in the order they
    run (a cond's true branch first), and a node before ``gm``'s output holding their range
    counts, one row each (None without sites). A branch returns a row for each site of
    both branches, the other's zero."""
    bodies = {call: body for body, call in checkpoint_bodies(gm)}
    branches: dict[torch.fx.Node, list[torch.fx.GraphModule]] = {}
    for branch, call in cond_branches(gm):
        branches.setdefault(call, []).append(branch)
    sites: list[Site] = []
    parts: list[Any] = []  # runs of own quantize nodes (node, range), and bodies' count nodes
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == QUANTIZE:
            site = ctx.sites[node.meta["lowprec"]["offset"]]
            if not parts or not isinstance(parts[-1], list):
                parts.append([])
            parts[-1].append((node.args[0], _spec(site)))
            sites.append(site)
        elif node in bodies:
            body = bodies[node]
            body_sites, body_counts = _forward_counts(body, ctx)
            if body_counts is not None:
                sites += body_sites
                parts.append(_output_of(gm, node, _return_also(body, body_counts), body_counts))
        elif is_function_call(node):
            forward, backward = function_bodies(gm, node)
            body_sites, body_counts = _forward_counts(forward, ctx)
            if body_counts is not None:
                sites += body_sites
                parts.append(_function_output(gm, node, forward, backward, body_counts))
        elif node in branches:
            found = [_forward_counts(branch, ctx) for branch in branches[node]]
            rows = [len(branch_sites) for branch_sites, _ in found]
            if sum(rows):
                # (the device of the rows a branch counts: the other's zero rows go there too)
                device = next(c.meta["example_value"].device for _, c in found if c is not None)
                returned = [
                    _branch_rows(branch, counts, sum(rows[:k]), sum(rows[k + 1 :]), device)
                    for k, (branch, (_, counts)) in enumerate(zip(branches[node], found, strict=True))
                ]
                index = [_return_also(b, r) for b, r in zip(branches[node], returned, strict=True)][0]
                sites += [site for branch_sites, _ in found for site in branch_sites]
                rows_node = _output_of(gm, node, index, returned[0])
                parts.append(inline(gm, gm.graph.output_node(), _as_counts, {"rows": rows_node}))
    if not parts:
        return sites, None

    def count(parts: list[Any]) -> torch.Tensor:
        blocks = [
            torch.stack([_site_row(x, spec) for x, spec in part]) if isinstance(part, list) else part
            for part in parts
        ]
        return torch.cat(blocks) if len(blocks) > 1 else blocks[0]

    return sites, inline(gm, gm.graph.output_node(), count, {"parts": parts})


def _site_row(x: torch.fx.Proxy, spec: tuple[str, str]) -> torch.fx.Proxy:
    """A site's row: :func:`range_counts` of ``x``, of the whole tensor where ``x`` is a
    DTensor (tensor parallelism: DTensor's sums of a split tensor hold each rank's part
    until then, decided when AOT autograd traces the graph), then 1 (the call ran it).
    ``range_counts`` is one call in the graph, which AOT autograd traces where ``x``'s dtype
    (complex or real) is known."""
    counts = x.tracer.create_proxy("call_function", range_counts, (x, *spec), {})
    counts = x.tracer.create_proxy("call_function", whole_tensor, (counts,), {})
    return torch.cat([counts, counts.new_ones(1)])


def _branch_rows(
    branch: torch.fx.GraphModule,
    counts: torch.fx.Node | None,
    before: int,
    after: int,
    device: torch.device,
) -> torch.fx.Node:
    """A node of ``branch`` holding its sites' ``counts`` (None: it has none) between
    ``before`` and ``after`` zero rows, the other branch's sites, in float64 on ``device``:
    both branches of a ``torch.cond`` return tensors of one shape, and torch's cond
    differentiates only float outputs (float64 holds counts exactly up to 2^53)."""
    # a branch with no sites of its own takes the other's operands, which hold its weights
    like = counts
    if like is None:
        inputs = branch.graph.find_nodes(op="placeholder")
        like = next(node for node in inputs if isinstance(node.meta.get("example_value"), torch.Tensor))

    def rows(like: torch.fx.Proxy) -> torch.Tensor:
        zeros = [like.new_zeros((n, PROBE_SIZE), dtype=torch.float64, device=device) for n in (before, after)]
        own = [] if counts is None else [like.to(torch.float64)]
        return torch.cat([zeros[0], *own, zeros[1]])

    return inline(branch, branch.graph.output_node(), rows, {"like": like})


def _as_counts(rows: torch.fx.Proxy) -> torch.Tensor:
    return rows.detach().to(torch.int64)


def _return_also(body: torch.fx.GraphModule, value: torch.fx.Node) -> int:
    """Append ``value`` to the outputs of ``body``; return its index there."""
    output = body.graph.output_node()
    (outputs,) = output.args
    output.args = ((*outputs, value),)
    body.recompile()
    return len(outputs)


def _output_of(
    gm: torch.fx.GraphModule, call: torch.fx.Node, index: int, inner: torch.fx.Node
) -> torch.fx.Node:
    """A node of ``gm`` reading output ``index`` of ``call``, which its body's node
    ``inner`` returns."""
    with gm.graph.inserting_after(call):
        item = gm.graph.call_function(operator.getitem, (call, index))
    value = inner.meta.get("example_value")
    item.meta["example_value"] = value
    example = call.meta.get("example_value")
    if isinstance(example, tuple | list) and len(example) == index:
        call.meta["example_value"] = (*example, value)
    return item


def _function_output(
    gm: torch.fx.GraphModule,
    call: torch.fx.Node,
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule,
    counts: torch.fx.Node,
) -> torch.fx.Node:
    """Return ``counts`` (a node of the Function's forward body) as one more output of the
    Function ``call``, without a gradient (its backward body takes one more, unused,
    gradient input); the node of ``gm`` reading it."""
    output = forward.graph.output_node()
    ((outputs, saved),) = output.args
    index = len(outputs)
    output.args = (((*outputs, counts), saved),)
    forward.recompile()
    grads, _ = backward_inputs(forward, backward)
    with backward.graph.inserting_after(grads[-1]):
        backward.graph.placeholder("lowprec_saturation_counts_grad")
    backward.recompile()
    call.update_kwarg("non_differentiable_idx", [*call.kwargs.get("non_differentiable_idx", ()), index])
    return _output_of(gm, call, index, counts)


def function_gradient_sites(
    gm: torch.fx.GraphModule,
) -> list[tuple[torch.fx.GraphModule, torch.fx.Node, list[torch.fx.Node]]]:
    """The Functions ``gm`` and the bodies it calls run, in the order they run, each with
    its graph and the quantize nodes of its backward body that round a value of the
    backward's own (its errors; not the saved tensors the forward rounded)."""
    found = []
    calls = nodes_in_run_order(gm, lambda g: g.graph.find_nodes(op="call_function", target=FUNCTION_APPLY))
    for graph, call in calls:
        if not any(needs_grad(arg) for arg in call.args[2:]):
            continue  # no backward runs through it (the probe, which needs one, would add one)
        forward, backward = function_bodies(graph, call)
        own = {
            node.meta["lowprec"]["offset"]
            for node in forward.graph.find_nodes(op="call_function", target=QUANTIZE)
        }
        nodes = [
            node
            for node in backward.graph.find_nodes(op="call_function", target=QUANTIZE)
            if node.meta["lowprec"]["offset"] not in own
        ]
        if nodes:
            found.append((graph, call, nodes))
    return found


def _count_in_function(
    graph: torch.fx.GraphModule,
    call: torch.fx.Node,
    nodes: list[torch.fx.Node],
    ctx: CompileContext,
    example: torch.Tensor,
    first: int,
) -> None:
    """Pass the probe to the Function ``call`` of ``graph``, whose backward body returns, as
    the probe's gradient, the rows ``first``, ... of its quantize ``nodes`` (the others zero)."""
    forward, backward = function_bodies(graph, call)
    inner = graph_input(forward, ctx, SATURATION_INPUT, example)
    position = forward.graph.find_nodes(op="placeholder").index(inner)
    specs = [_spec(ctx.sites[node.meta["lowprec"]["offset"]]) for node in nodes]
    after = example.shape[0] - first - len(nodes)

    def rows(xs: list[torch.fx.Proxy]) -> torch.Tensor:
        own = torch.stack([_site_row(x, spec) for x, spec in zip(xs, specs, strict=True)]).to(torch.float64)
        return torch.nn.functional.pad(own, (0, 0, first, after))

    output = backward.graph.output_node()
    value = inline(backward, output, rows, {"xs": [node.args[0] for node in nodes]})
    (gradients,) = output.args
    output.args = ((*gradients[:position], value, *gradients[position + 1 :]),)
    backward.graph.lint()
    backward.recompile()


def _spec(site: Site) -> tuple[str, str]:
    return site.fmt, site.scaling


def _count_gradients(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    found = gradient_sites(gm)
    functions = function_gradient_sites(gm)
    if not found and not functions:
        return
    ctx.counted_grads = [ctx.sites[node.meta["lowprec"]["offset"]] for _, node in found]
    firsts = []
    for _, _, nodes in functions:
        firsts.append(len(ctx.counted_grads))
        ctx.counted_grads += [ctx.sites[node.meta["lowprec"]["offset"]] for node in nodes]
    # (count_grad delivers each site's counts on the probe's device)
    like = found[0][1] if found else functions[0][2][0]
    example = count_probe(len(ctx.counted_grads), like.meta["example_value"].device).detach()
    for (graph, call, nodes), first in zip(functions, firsts, strict=True):
        _count_in_function(graph, call, nodes, ctx, example, first)
    for i, ((graph, node), site) in enumerate(zip(found, ctx.counted_grads[: len(found)], strict=True)):
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
    for graph in {id(g): g for g, *_ in found + functions}.values():
        graph.graph.lint()
        graph.recompile()
