"""FX helpers the passes and the pipeline share: which node is a layer (a
matmul or convolution), which parameter it reads, and its name."""

from __future__ import annotations

import operator
import re

import torch
import torch.fx
import torch.nn.functional as F

import lpcompile.numerics.quantize  # noqa: F401  (defines lowprec::quantize, quantize_grad)
import lpcompile.numerics.scale_grad  # noqa: F401  (defines lowprec::scale_grad)

LINEAR_TARGETS = {torch._C._nn.linear, F.linear}
CONV_TARGETS = {torch.conv1d, torch.conv2d, torch.conv3d, F.conv1d, F.conv2d, F.conv3d}
CONV_TRANSPOSE_TARGETS = {torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d}
MATMUL_TARGETS = {torch.matmul, torch.linalg.matmul, operator.matmul, torch.mm, torch.bmm}
MATMUL_METHODS = {"matmul", "mm", "bmm", "__matmul__"}
# Products the pass leaves in higher precision, with a warning: their operands sit
# elsewhere than (input, weight), or the products are inside one opaque call.
UNQUANTIZED_TARGETS = {
    torch.einsum,
    torch.addmm,
    torch.baddbmm,
    torch.addbmm,
    torch.addmv,
    torch.mv,
    torch.tensordot,
    torch.dot,
    torch.vdot,
    torch.inner,
    torch.outer,
    torch.linalg.multi_dot,
    torch.chain_matmul,
    F.bilinear,
    F.scaled_dot_product_attention,
    F.multi_head_attention_forward,
}
UNQUANTIZED_METHODS = {"addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "inner", "outer"}
# Ops through which a parameter is still "the weight" (x @ self.w.t()).
VIEW_METHODS = {"t", "transpose", "permute", "view", "reshape", "contiguous", "T", "mT"}
VIEW_FUNCTIONS = {torch.t, torch.transpose, torch.permute, torch.reshape}

# ATen ops that reshape a tensor, or cast an index tensor, without changing its values' order.
RESHAPES = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}
INDEX_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}

LAYER_NAME = "lowprec_layer_name"  # node.meta key: a layer call's name, once its graph is named
SCALE_GRAD = torch.ops.lowprec.scale_grad.default
LOWPREC_OPS = {
    torch.ops.lowprec.quantize.default: "quantize",
    torch.ops.lowprec.quantize_grad.default: "quantize_grad",
}


def is_layer_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a matmul or convolution the pass quantizes."""
    if node.op == "call_function":
        return node.target in LINEAR_TARGETS | CONV_TARGETS | CONV_TRANSPOSE_TARGETS | MATMUL_TARGETS
    return node.op == "call_method" and node.target in MATMUL_METHODS


def is_unquantized_product(node: torch.fx.Node) -> bool:
    """Whether ``node`` multiplies tensors in a way the pass does not quantize."""
    if node.op == "call_function" and node.target is torch.einsum:  # not a permutation or a sum
        return len(node.all_input_nodes) > 1
    if node.op == "call_function":
        return node.target in UNQUANTIZED_TARGETS
    return node.op == "call_method" and node.target in UNQUANTIZED_METHODS


def _fqn(source: str) -> str:
    """``L['self']._modules['0']._parameters['w']`` -> ``0.w``."""
    path = re.sub(r"^L\['[^']*'\]", "", source)
    path = re.sub(r"\._(?:modules|parameters)\['([^']*)'\]", r".\1", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).strip(".")


def layer_name(node: torch.fx.Node) -> str:
    """The FQN of the module that made ``node``.

    A module that makes several layer calls in a graph (an attention block's ``q @ k.T``
    and ``p @ v``, a module called twice) numbers them in graph order: ``attn#0``,
    ``attn#1``. A call in the root module's own ``forward`` is named after its weight's
    FQN (``F.linear(x, self.w)``: ``w``), or, without a parameter, after the node.
    """
    if (name := node.meta.get(LAYER_NAME)) is not None:
        return name
    path = _module_path(node)
    if path and is_layer_call(node):
        _name_module_layers(node.graph)
        return node.meta[LAYER_NAME]
    if not path and len(node.args) > 1 and isinstance(node.args[1], torch.fx.Node):
        if parameter_of(node.args[1]) is not None:
            path = state_name(base_of(node.args[1]))
    return path or node.name


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return _fqn(list(stack.values())[-1][0]) if stack else ""


def _name_module_layers(graph: torch.fx.Graph) -> None:
    """Name every layer call of ``graph`` made by a submodule (numbered where one makes several)."""
    calls: dict[str, list[torch.fx.Node]] = {}
    for node in filter(is_layer_call, graph.nodes):
        if path := _module_path(node):
            calls.setdefault(path, []).append(node)
    for path, nodes in calls.items():
        for i, node in enumerate(nodes):
            node.meta[LAYER_NAME] = path if len(nodes) == 1 else f"{path}#{i}"


def state_name(node: torch.fx.Node) -> str:
    """The FQN of the parameter or buffer a Dynamo graph input holds (``0.weight``), else the
    node's name."""
    source = getattr(node, "_dynamo_source", None)
    return _fqn(source.name) if source is not None else node.name


def base_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node ``node`` reads through views and scale_grad nodes."""
    while True:
        if node.op == "call_method" and node.target in VIEW_METHODS:
            node = node.args[0]
        elif node.op == "call_function" and node.target in VIEW_FUNCTIONS | {SCALE_GRAD}:
            node = node.args[0]
        elif node.op == "call_function" and node.target is getattr and node.args[1] in VIEW_METHODS:
            node = node.args[0]
        else:
            return node


def parameter_of(node: torch.fx.Node) -> torch.nn.Parameter | None:
    """The parameter ``node`` reads, possibly through views and scale_grad nodes."""
    node = base_of(node)
    if node.op == "placeholder":
        grapharg = node.meta.get("grapharg")
        example = grapharg.example if grapharg is not None else None
    elif node.op == "get_attr":
        example = node.graph.owning_module.get_parameter(node.target)
    else:
        example = None
    return example if isinstance(example, torch.nn.Parameter) else None
