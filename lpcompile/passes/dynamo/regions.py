"""``torch.compiler.nested_compile_region`` calls, written out in place.

Dynamo traces a region (a block's ``forward``, decorated) once and calls its body with
``invoke_subgraph`` wherever the block runs again, so that Inductor compiles the body
once. One body shared by every block would round every block's products with one random
stream and name them after the block traced first: lowprec writes each call out as a copy
of its body, with the module names of the block it runs. Each block is then rounded and
named as an undecorated one; Inductor compiles the graph whole (the region's saving in
compile time is given up).
"""

from __future__ import annotations

import copy

import torch
import torch.fx

from lpcompile.passes.driver import CompileContext
from lpcompile.passes.graph import find_calls, recompile_bodies, replace_with

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def inline_nested_regions(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Write each ``invoke_subgraph`` call as its body's nodes, named after the calling block
    (a region inside a region too)."""
    write_out_regions(gm)


def has_regions(gm: torch.fx.GraphModule) -> bool:
    return bool(find_calls(gm, {INVOKE_SUBGRAPH}))


def write_out_regions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with its regions written out (:func:`inline_nested_regions`)."""
    while calls := find_calls(gm, {INVOKE_SUBGRAPH}):
        for graph, call in calls:
            _inline(graph, call)
    recompile_bodies(gm)
    gm.recompile()
    return gm


def _inline(gm: torch.fx.GraphModule, call: torch.fx.Node) -> None:
    """Write the region ``call`` of ``gm`` as a copy of its body."""
    holder = call.args[0]
    body = getattr(gm, holder.target)
    copies = dict(zip(body.graph.find_nodes(op="placeholder"), call.args[2:], strict=True))
    graphs = []
    with gm.graph.inserting_before(call):
        for node in body.graph.find_nodes(op="get_attr"):  # the body's own subgraphs (checkpoints)
            sub = copy.deepcopy(getattr(body, node.target))  # a copy per call, which passes change
            name = f"{call.name}_{node.target}"
            setattr(gm, name, sub)
            copies[node] = gm.graph.get_attr(name)
            graphs += [m.graph for m in sub.modules() if isinstance(m, torch.fx.GraphModule)]
        outputs = gm.graph.graph_copy(body.graph, copies)
    made = [copies[node] for node in body.graph.nodes if node.op in ("call_function", "call_method")]
    for node in made + [node for graph in graphs for node in graph.nodes]:
        if node.op in ("call_function", "call_method"):
            node.meta["nn_module_stack"] = _rebased(node.meta.get("nn_module_stack"), call)
    replace_with(call, tuple(outputs))
    if not holder.users:
        gm.graph.erase_node(holder)
    if not any(node.target == holder.target for node in gm.graph.find_nodes(op="get_attr")):
        delattr(gm, holder.target)


def _rebased(stack: dict | None, call: torch.fx.Node) -> dict:
    """A body node's module stack, from the block that ``call`` runs: the body's outermost
    module (the block traced first) becomes the caller's innermost."""
    caller = dict(call.meta.get("nn_module_stack") or {})
    if not stack or not caller:
        return dict(stack or caller)
    (root, _), (block, _) = next(iter(stack.values())), list(caller.values())[-1]
    rebased = dict(list(caller.items())[:-1])
    for key, (path, kind) in stack.items():  # a module held outside the block keeps its source
        rebased[f"{key}@{call.name}"] = (block + path[len(root) :] if path.startswith(root) else path, kind)
    return rebased
