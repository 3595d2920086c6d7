"""Steering AOT autograd's partitioner on the joint graph, before Inductor compiles.

A ReLU's backward needs its mask. Where the ReLU's output feeds a quantize
rather than the next matmul, nothing else saves a float the mask could be
recomputed from, so the partitioner saves the mask itself, ``le(x, 0)``: a
``bool`` tensor, the cheapest to store in bytes. But Inductor's C++ code
(torch 2.13) writes ``bool`` tensors through a generic 64-lane mask
conversion, many times slower than a float store of the same tensor.
``recompute_bool_masks`` marks such comparisons for recomputation: the
partitioner then saves their float operand instead (4x the bytes) and the
backward recomputes the comparison inside the kernel that reads it.
"""

from __future__ import annotations

import torch
import torch.fx
from torch._functorch.partitioners import _is_tangent as is_tangent
from torch.utils.checkpoint import CheckpointPolicy

from lpcompile.passes.driver import CompileContext

aten = torch.ops.aten
COMPARISONS = frozenset(
    overload
    for op in (aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge)
    for overload in (op.Scalar, op.Tensor)
)


def masks_apply(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """A joint graph (one with a backward to partition) whose tensors are all on the CPU."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    values = [node.meta.get("val") for node in placeholders]
    on_cpu = all(v.device.type == "cpu" for v in values if isinstance(v, torch.Tensor))
    return on_cpu and any(map(is_tangent, placeholders))


def _depending_on(graph: torch.fx.Graph, sources: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """``sources`` and every node computed from one of them (the graph is topological)."""
    found = set(sources)
    for node in graph.nodes:
        if any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def recompute_bool_masks(gm: torch.fx.GraphModule, ctx: CompileContext | None) -> None:
    """Tag forward comparisons the backward reads as ``MUST_RECOMPUTE`` (CPU graphs only).

    A comparison already tagged (``torch.utils.checkpoint`` policies) keeps its tag,
    and one computed from an input the graph mutates in place is left alone: the
    backward would recompute it from the mutated values.
    """
    placeholders = gm.graph.find_nodes(op="placeholder")
    backward = _depending_on(gm.graph, set(filter(is_tangent, placeholders)))
    copies = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default)
    mutated = _depending_on(gm.graph, {c.args[0] for c in copies if c.args[0] in placeholders})
    for target in COMPARISONS:
        for node in gm.graph.find_nodes(op="call_function", target=target):
            if "recompute" in node.meta or node in backward or node in mutated:
                continue
            if any(user in backward for user in node.users):
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
