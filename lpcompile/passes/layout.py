"""Layout clean-ups of the AOT graphs before Inductor compiles them.

AOT autograd's partitioner saves a layer's quantized weight for the backward
as ``permute(permute(w_q))``: the transpose that ``linear`` reads, transposed
back. Inductor's own rule for such pairs runs on the joint graph, before the
partitioner makes this one, so the forward graph reaches Inductor with it.
There the pair is a view of a view of an unrealized pointwise node, and the
quantize's kernel writes two weight-sized buffers: one for the matmul, one for
the saved copy. ``remove_permute_pairs`` turns the pair back into ``w_q``, so
both read one buffer.
"""

from __future__ import annotations

import torch
import torch.fx

from lpcompile.passes import CompileContext

PERMUTE = torch.ops.aten.permute.default


def remove_permute_pairs(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Replace ``permute(permute(x, p), q)`` by ``x`` where ``q`` undoes ``p``."""
    for node in list(gm.graph.find_nodes(op="call_function", target=PERMUTE)):
        inner = node.args[0]
        if not (isinstance(inner, torch.fx.Node) and inner.target is PERMUTE):
            continue
        rank = len(node.args[1])
        first = [axis % rank for axis in inner.args[1]]
        if any(first[axis % rank] != i for i, axis in enumerate(node.args[1])):
            continue
        node.replace_all_uses_with(inner.args[0])
        gm.graph.erase_node(node)
        if not inner.users:
            gm.graph.erase_node(inner)
