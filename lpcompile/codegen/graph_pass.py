"""``fuse_lowprec_kernels``: replace each fusion group of an ATen graph by one kernel call.

For each group (``fusion.grow_group``, in graph order) the pass generates the
kernel (``kernel.generate_kernel``), loads it (``launcher.FusedKernel``) and
rewrites the graph: one ``call_function`` to the launcher taking the tensors
the kernel reads, ``getitem`` nodes for what it writes (members used outside
the group, then the reductions), alias nodes (``detach``, dtype views)
recreated on those outputs, and the fused nodes erased. Every node keeps a
correct ``meta["val"]``; the call node is marked ``meta["lowprec"]["kind"] =
"fused_kernel"`` for ``lowprec dump``. What was fused is appended to
``ctx.kernels`` as :class:`KernelRecord` s.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from lpcompile.codegen.fusion import FusionGroup, grow_group, is_seed
from lpcompile.codegen.kernel import KernelSpec, generate_kernel, input_nodes
from lpcompile.codegen.launcher import FusedKernel, check_device
from lpcompile.codegen.triton_ops import OPS


@dataclass
class KernelRecord:
    """One generated kernel of a compiled graph, as ``lowprec dump`` lists it."""

    name: str  # unique in the compiled graph: "<graph>.k<i>"
    graph: str  # "forward", "backward", "backward[stats]", ...
    function: str  # the Triton function (shared by identical groups)
    key: str  # hash of the kernel's code
    nodes: list[str]  # FX nodes fused
    inputs: list[str]
    outputs: list[str]
    reductions: list[str]
    exact: bool  # bit-identical to the reference ops (no transcendental op inside)
    source: str


def _outputs_and_views(group: FusionGroup) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """Members the kernel writes, and alias members to recreate outside (both in graph order)."""
    members = group.members
    writes: set[torch.fx.Node] = set()
    views: set[torch.fx.Node] = set()

    def materialize(node: torch.fx.Node) -> None:
        if node not in members:
            return
        if OPS[node.target].kind == "view":
            views.add(node)
            materialize(node.args[0])
        else:
            writes.add(node)

    for node in group.nodes:
        if any(u not in members for u in node.users):
            materialize(node)
    order = {n: i for i, n in enumerate(group.nodes)}
    return sorted(writes, key=order.__getitem__), sorted(views, key=order.__getitem__)


def _stable_toposort(graph: torch.fx.Graph) -> None:
    """Reorder ``graph``'s nodes in place: dependencies first, else the current order."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    indeg = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(index[n], n) for n in nodes if indeg[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for user in node.users:
            indeg[user] -= 1
            if indeg[user] == 0:
                heapq.heappush(ready, (index[user], user))
    if len(order) != len(nodes):
        raise RuntimeError("fuse_lowprec_kernels made a cycle (a fusion group was not convex)")
    for prev, node in zip(order[:-1], order[1:], strict=True):
        if prev.next is not node:
            prev.append(node)


def _rewrite(
    gm: torch.fx.GraphModule,
    group: FusionGroup,
    spec: KernelSpec,
    kernel: FusedKernel,
    writes: list[torch.fx.Node],
    views: list[torch.fx.Node],
) -> torch.fx.Node:
    graph = gm.graph
    members = group.members
    position = {n: i for i, n in enumerate(graph.nodes)}
    last = max(members, key=position.__getitem__)
    results = [*writes, *(r.node for r in group.reductions)]
    with graph.inserting_after(last):
        call = graph.call_function(kernel, tuple(input_nodes(spec, graph)))
    call.meta["val"] = tuple(n.meta["val"] for n in results)
    for key in ("stage", "custom"):  # pipeline stage tags (all members share the seed's stage)
        if key in group.nodes[0].meta:
            call.meta[key] = group.nodes[0].meta[key]
    call.meta["lowprec"] = {
        "kind": "fused_kernel",
        "kernel": spec.name,
        "fused": list(spec.nodes),
        "graph": spec.graph,
    }
    replacement: dict[torch.fx.Node, torch.fx.Node] = {}
    cursor = call
    for i, node in enumerate(results):
        with graph.inserting_after(cursor):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta.update({k: v for k, v in node.meta.items() if k != "lowprec"})
        replacement[node] = cursor = item
    for node in views:  # in graph order, so a view's input is ready before it
        source = node.args[0]
        with graph.inserting_after(cursor):
            new = graph.call_function(
                node.target, (replacement.get(source, source), *node.args[1:]), node.kwargs
            )
        new.meta.update(node.meta)
        replacement[node] = cursor = new
    for node, new in replacement.items():
        for user in list(node.users):
            if user not in members:
                user.replace_input_with(node, new)
    for node in sorted(members, key=position.__getitem__, reverse=True):
        graph.erase_node(node)
    _stable_toposort(graph)
    return call


def fuse_lowprec_kernels(gm: torch.fx.GraphModule, ctx: Any) -> None:
    """Replace each fusion group of ``gm`` (an AOT ATen graph) by a generated Triton kernel."""
    label = gm.meta.get("lowprec_graph", "graph")
    kernels = getattr(ctx, "kernels", None)
    count = 0
    done: set[torch.fx.Node] = set()
    while True:
        group = None
        for node in gm.graph.nodes:
            if node in done or not is_seed(node):
                continue
            done.add(node)
            group = grow_group(node)
            if group is not None:
                break
        if group is None:
            break
        check_device(group.nodes[0].meta["val"].device)
        writes, views = _outputs_and_views(group)
        spec = generate_kernel(group, label, writes, views)
        kernel = FusedKernel(spec)
        _rewrite(gm, group, spec, kernel, writes, views)
        if kernels is not None:
            kernels.append(
                KernelRecord(
                    name=f"{label}.k{count}",
                    graph=label,
                    function=spec.name,
                    key=spec.key,
                    nodes=list(spec.nodes),
                    inputs=[s.name for s in spec.inputs],
                    outputs=[s.name for s in spec.outputs],
                    reductions=[s.name for s in spec.reductions],
                    exact=spec.exact,
                    source=spec.source.replace(f"# {spec.name}:", f"# {spec.name} ({label}.k{count}):", 1),
                )
            )
        count += 1
    gm.graph.lint()
    gm.recompile()
