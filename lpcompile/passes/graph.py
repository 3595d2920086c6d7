"""FX helpers the passes and the pipeline share: which node is a layer (a product:
matmul, convolution, addmm, einsum, attention, ...), which parameter it reads, its
name; and :func:`inline`, which writes a function over FX proxies into a graph."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._dynamo.source import AttrSource, LocalSource
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.node import map_aggregate

import lpcompile.numerics.quantize  # noqa: F401  (defines lowprec::quantize, quantize_grad)
import lpcompile.numerics.scale_grad  # noqa: F401  (defines lowprec::scale_grad)

LINEAR_TARGETS = {torch._C._nn.linear, F.linear}
CONV_TARGETS = {torch.conv1d, torch.conv2d, torch.conv3d, F.conv1d, F.conv2d, F.conv3d}
CONV_TRANSPOSE_TARGETS = {torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d}
MATMUL_TARGETS = {torch.matmul, torch.linalg.matmul, operator.matmul, torch.mm, torch.bmm}
# Mixture-of-experts products: rows of the input grouped by expert, each group times its expert's matrix.
GROUPED_MM_TARGETS = {torch._grouped_mm, F.grouped_mm}
# node.meta key: whether a node lowprec inserted (a cast, the entry of an autocast-free region)
# prepares the product after it, and so belongs to that product's pipeline stage
CAST = "lowprec_cast"
# FlexAttention: one fused call of (query, key, value, score_mod, block mask, ...) that
# returns its output with the logsumexp.
FLEX_ATTENTION = torch.ops.higher_order.flex_attention
WEIGHTED_TARGETS = LINEAR_TARGETS | CONV_TARGETS | CONV_TRANSPOSE_TARGETS  # (input, weight, bias)
# Every product the quantize pass rounds: target -> the positions of its multiplied operands
# in ``node.args`` (where insert_quantize puts operands passed by keyword; see OPERAND_NAMES).
# ``einsum``'s operands are all its arguments after the equation.
PRODUCT_OPERANDS: dict[object, tuple[int, ...]] = {
    **{target: (0, 1) for target in WEIGHTED_TARGETS | MATMUL_TARGETS | GROUPED_MM_TARGETS},
    **{target: (1, 2) for target in (torch.addmm, torch.baddbmm, torch.addbmm, torch.addmv)},
    **{target: (0, 1) for target in (torch.mv, torch.dot, torch.vdot, torch.inner, torch.outer)},
    torch.addr: (1, 2),
    torch.tensordot: (0, 1),
    F.bilinear: (0, 1, 2),
    F.scaled_dot_product_attention: (0, 1, 2),  # option `attention`
    FLEX_ATTENTION: (0, 1, 2),
}
# Products of operators other libraries register, by qualified name -> operand positions:
# transformers' grouped matmul of mixture-of-experts layers, where torch's cannot run
# (under torch.compile with weights other than bfloat16, on old torch).
LIBRARY_PRODUCTS: dict[str, tuple[int, ...]] = {"transformers::grouped_mm_fallback": (0, 1)}
PRODUCT_METHODS: dict[str, tuple[int, ...]] = {
    **{name: (0, 1) for name in ("matmul", "mm", "bmm", "__matmul__", "mv", "dot", "vdot", "inner", "outer")},
    **{name: (1, 2) for name in ("addmm", "baddbmm", "addbmm", "addmv", "addr")},
}
# The parameter names of a product's leading positions, to move keyword operands there.
OPERAND_NAMES: dict[object, tuple[str, ...]] = {
    **{target: ("input", "weight", "bias") for target in WEIGHTED_TARGETS},
    **{target: ("input", "mat2") for target in (torch.mm, torch.bmm, "mm", "bmm")},
    torch.addmm: ("input", "mat1", "mat2"),
    "addmm": ("input", "mat1", "mat2"),
    **{target: ("input", "batch1", "batch2") for target in (torch.baddbmm, torch.addbmm)},
    **{target: ("input", "batch1", "batch2") for target in ("baddbmm", "addbmm")},
    **{target: ("input", "mat", "vec") for target in (torch.addmv, "addmv")},
    **{target: ("input", "vec") for target in (torch.mv, "mv")},
    **{target: ("input", "tensor") for target in (torch.dot, torch.vdot, "dot", "vdot")},
    **{target: ("input", "vec2") for target in (torch.outer, "outer")},
    **{target: ("input", "vec1", "vec2") for target in (torch.addr, "addr")},
    torch.tensordot: ("a", "b", "dims"),
    torch._grouped_mm: ("self", "mat2"),
    F.grouped_mm: ("mat_a", "mat_b"),
    F.bilinear: ("input1", "input2", "weight", "bias"),
    F.scaled_dot_product_attention: ("query", "key", "value"),
}
# Ops through which a parameter is still "the weight" (x @ self.w.t()).
VIEW_METHODS = {"t", "transpose", "permute", "view", "reshape", "contiguous", "T", "mT", "narrow"}
# ``torch.vmap`` over stacked parameters (torch.func ensembles): each member's slice
VMAP_SLICE = torch._functorch.predispatch._add_batch_dim
VIEW_FUNCTIONS = {torch.t, torch.transpose, torch.permute, torch.reshape, torch.narrow, VMAP_SLICE}

# ATen ops that reshape a tensor, or cast an index tensor, without changing its values' order.
RESHAPES = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}
INDEX_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}

CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
# A custom torch.autograd.Function Dynamo traced: (forward body, backward body, *inputs)
FUNCTION_APPLY = torch.ops.higher_order.autograd_function_apply
COND = torch.ops.higher_order.cond  # (predicate, true branch, false branch, operands)
# the positions of the bodies in the calls of the higher-order ops the passes enter
BODIES = {CHECKPOINT: slice(0, 1), FUNCTION_APPLY: slice(0, 2), COND: slice(1, 3)}
LAYER_NAME = "lowprec_layer_name"  # node.meta key: a layer call's name, once its graph is named
# GraphModule.meta key: the FQN, in the compiled model, of the module a graph's frame calls
# ``self``, where that is not the model itself (a frame compiled apart after a graph break)
ROOT_PATH = "lowprec_root_path"
# GraphModule.meta key, true where the module a graph's frame calls ``self`` is a submodule
# of the compiled model (with or without ROOT_PATH): the calls its own ``forward`` makes
# are named after it, as a submodule's calls are in the model's graph
SUBMODULE_FRAME = "lowprec_submodule_frame"
# GraphModule.meta key: the FQN of the compiled model in the module a graph's frame calls
# ``self``, where that frame is a wrapper's around the model (``DistributedDataParallel.forward``
# traced whole, with ``optimize_ddp="python_reducer"``: ``module``)
WRAPPER_PATH = "lowprec_wrapper_path"
# GraphModule.meta key: the local or global of a graph's frame that its model's parameters
# are read from (``L['self']``): a module on a node's module stack reached from another
# (a module a library keeps in a global) is not the model's
FRAME_ROOT = "lowprec_frame_root"
# GraphModule.meta key, where a frame reads its model's parameters from several locals
# (a resume frame after a graph break in ``self.head(self.body(x))``, whose modules come as
# Dynamo's stack temporaries ``___stack0`` ...): each local's FQN in the compiled model,
# found from its parameters; the graph's names start at the model
SOURCE_ROOTS = "lowprec_source_roots"
# GraphModule.meta key: where the modules of a GraphModule that Dynamo traced (an exported
# module) sit in the compiled model, found from their parameters (None: unknown or several)
EXPORTED_ROOT = "lowprec_exported_root"
ATTENTION = "lowprec_attention"  # node.meta key: a product inside attention (option `attention`)
SCALE_GRAD = torch.ops.lowprec.scale_grad.default
LOWPREC_OPS = {
    torch.ops.lowprec.quantize.default: "quantize",
    torch.ops.lowprec.quantize_grad.default: "quantize_grad",
}


def product_operands(node: torch.fx.Node) -> tuple[int, ...] | None:
    """The positions in ``node.args`` of the operands ``node`` multiplies, if it is a
    product the quantize pass rounds (a layer call); else ``None``."""
    if node.op == "call_method":
        return PRODUCT_METHODS.get(node.target)
    if node.op != "call_function":
        return None
    if node.target is torch.einsum:  # a product of two or more operands, not a permutation or a sum
        operands = tuple(range(1, len(node.args)))
        return operands if len(operands) > 1 else None
    if isinstance(node.target, torch._ops.OpOverloadPacket):
        return LIBRARY_PRODUCTS.get(node.target._qualified_op_name)
    if isinstance(node.target, torch._ops.OpOverload):
        return LIBRARY_PRODUCTS.get(node.target.name())
    return PRODUCT_OPERANDS.get(node.target)


def is_attention(node: torch.fx.Node) -> bool:
    """Whether ``node`` is attention's product: SDPA, FlexAttention, or one a pass wrote
    attention with."""
    return node.target in (F.scaled_dot_product_attention, FLEX_ATTENTION) or bool(node.meta.get(ATTENTION))


def product_output(call: torch.fx.Node) -> torch.fx.Node | None:
    """The node holding a product's result, where its error enters the backward: the call,
    or, for FlexAttention, the item of its output (``None`` if nothing reads it)."""
    if call.target is not FLEX_ATTENTION:
        return call
    return next((u for u in call.users if u.target is operator.getitem and u.args[1] == 0), None)


def is_layer_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a product (matmul, convolution, addmm, einsum, ...) the pass quantizes."""
    return product_operands(node) is not None


def is_function_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls a custom ``torch.autograd.Function`` (forward and backward
    bodies of its own)."""
    return node.op == "call_function" and node.target is FUNCTION_APPLY


def is_named_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a layer: a product, or a call of a Function with products (named
    after the call). A Function without products (a fused norm, a straight-through
    estimator) is no layer: its parameters' gradients stay as they are."""
    if not is_function_call(node):
        return is_layer_call(node)
    bodies = (getattr(node.graph.owning_module, body.target) for body in node.args[:2])
    return any(is_layer_call(inner) for body in bodies for inner in body.graph.nodes)


def weight_operand(node: torch.fx.Node) -> torch.fx.Node | None:
    """The product operand of a layer call that reads a parameter (its weight), if any; for a
    Function call, its first input that is a parameter."""
    positions = range(2, len(node.args)) if is_function_call(node) else product_operands(node)
    for index in positions or ():
        operand = node.args[index] if index < len(node.args) else None
        if isinstance(operand, torch.fx.Node) and parameter_of(operand) is not None:
            return operand
    return None


def has_backward(gm: torch.fx.GraphModule) -> bool:
    """Whether a backward may run through ``gm``: compiled under grad mode (Dynamo guards on
    it), or under ``no_grad`` with an output its autograd graph computes, as its example
    says (an ``enable_grad`` block inside the frame; not a view of a parameter, which
    requires grad under ``no_grad`` too)."""
    if torch.is_grad_enabled():
        return True
    outputs = torch.utils._pytree.tree_leaves(gm.graph.output_node().args)
    return any(
        isinstance(o, torch.fx.Node)
        and isinstance(example := o.meta.get("example_value"), torch.Tensor)
        and example.grad_fn is not None
        for o in outputs
    )


def needs_grad(value: object) -> bool:
    """Whether the graph value ``value`` gets a gradient (as far as its example says: a
    frozen weight, an input batch, a symbolic size and anything under ``no_grad`` do not)."""
    if not isinstance(value, torch.fx.Node):
        return False
    value = base_of(value)  # a view's (a vmapped slice's example may not say)
    if value.op == "get_attr":  # a parameter, or a subgraph or constant of the graph's own
        return (parameter := parameter_of(value)) is not None and parameter.requires_grad
    example = value.meta.get("example_value")
    if isinstance(example, torch.SymInt | torch.SymFloat | torch.SymBool | int | float):
        return False
    return example is None or bool(getattr(example, "requires_grad", True))


def _unwrapped(source: str) -> str:
    """``source`` with its ``getattr(x, 'name')`` spelled ``x.name``."""
    while (unwrapped := re.sub(r"getattr\(([^()]*), '([^']*)'\)", r"\1.\2", source)) != source:
        source = unwrapped  # the innermost first
    return source


def source_fqn(source: str) -> str:
    """``L['self']._modules['0']._parameters['w']`` -> ``0.w``.

    The root module is the frame's ``self``, or, where a decorator wraps ``forward``
    (``def wrapper(*args, **kwargs)``, as transformers does), ``args[0]``, or the module of
    a bound method torch.compile was given (``L['fn'].__self__``). A module
    reached through a ``__getattr__`` of its own (PEFT's wrappers) is read from
    ``__dict__['_modules']``; one whose name is no identifier (``torch.func.functional_call``
    of a ``Sequential``) as ``getattr(L['self'].base, '0')``.
    """
    source = _unwrapped(source)
    bound = r"(?:\.__self__(?!\w))?"  # (a bound method's module)
    path = re.sub(rf"^L\['(?:args|kwargs)'\]\[(?:\d+|'[^']*')\]{bound}|^L\['[^']*'\]{bound}", "", source)
    path = re.sub(r"\.(?:__dict__\[')?_(?:modules|parameters)(?:'\])?\['([^']*)'\]", r".\1", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).strip(".")


def layer_name(node: torch.fx.Node) -> str:
    """The FQN of the module that made ``node``.

    A module that makes several layer calls in a graph (an attention block's ``q @ k.T``
    and ``p @ v``, a module called twice) numbers them in graph order: ``attn#0``,
    ``attn#1``. A call in the compiled model's own ``forward`` is named after its weight's
    FQN (``F.linear(x, self.w)``: ``w``), or, without a parameter, after the node. A call in
    the ``forward`` of a submodule whose frame Dynamo compiled apart (:data:`SUBMODULE_FRAME`)
    is that submodule's: named after it (``""`` in a graph named relative to it).
    """
    if (name := node.meta.get(LAYER_NAME)) is not None:
        return name
    path = module_path(node)
    if (path or _submodule_frame(node.graph)) and is_named_call(node):
        _name_module_layers(node.graph)
        return node.meta[LAYER_NAME]
    if not path and is_named_call(node) and (weight := weight_operand(node)) is not None:
        path = state_name(base_of(weight))
    return path or node.name


def module_path(node: torch.fx.Node) -> str:
    """The path of the innermost module of the model that made ``node`` (``""``: the frame's
    module): a module the model calls but does not hold (one a library keeps in a global, as
    transformers' kernel functions) is not the model's, and its calls are the caller's."""
    stack = [source for source, _ in (node.meta.get("nn_module_stack") or {}).values()]
    if not stack:
        return ""
    if not _is_source(stack[-1]):
        return _exported_path(node, stack[-1])
    meta = node.graph.owning_module.meta if node.graph.owning_module is not None else {}
    root = meta.get(FRAME_ROOT) or source_root(stack[0])  # a frame without parameters: the outermost's
    inside = [source for source in stack if source_root(source) == root]
    return _in_model(node.graph, _placed_fqn(node.graph, inside[-1])) if inside else ""


def _placed_fqn(graph: torch.fx.Graph, source: str) -> str:
    """:func:`source_fqn` of ``source``, from the compiled model where its local is one of the
    frame's :data:`SOURCE_ROOTS`."""
    meta = graph.owning_module.meta if graph.owning_module is not None else {}
    prefix = (meta.get(SOURCE_ROOTS) or {}).get(source_root(source))
    return source_fqn(source) if prefix is None else qualified_name(prefix, source_fqn(source))


def _is_source(entry: str) -> bool:
    """Whether a module stack entry is a Dynamo source (``L['self'].a``,
    ``dict.__getitem__(L['self'].heads, 'a')``), not the FQN that a traced module's own graph
    recorded (``a``): Dynamo keeps the module stacks of a ``GraphModule`` it traces (a
    ``torch.export`` module), relative to that module."""
    return re.fullmatch(r"[\w.]*", entry) is None


def _exported_root(node: torch.fx.Node) -> str | None:
    """Where the ``GraphModule`` whose module stack ``node`` keeps (see :func:`_is_source`)
    sits in the compiled model, from a parameter the node reads (``enc.blocks.0.a.weight``,
    read in ``blocks.0.a``: ``enc``); None where it reads none of its module's."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    inner = stack[-1][0] if stack else ""
    if not inner or _is_source(inner):
        return None
    for operand in node.all_input_nodes:
        if parameter_of(operand) is not None:
            name = "." + state_name(base_of(operand))
            if (at := name.rfind(f".{inner}.")) >= 0:
                return name[1 : at + 1].strip(".")
    return None


def mark_exported_root(gm: torch.fx.GraphModule, above: str | None = None) -> None:
    """Mark a graph and its bodies with where the modules of a ``GraphModule`` that Dynamo
    traced (an exported module) sit in the compiled model, where its calls that read
    parameters place it in one place (:data:`EXPORTED_ROOT`; ``above``: the calling
    graph's, for a body that places none): its calls without one are named from there. A
    checkpoint body's inputs are marked with the parameters its call passes first."""
    roots = {root for node in gm.graph.nodes if (root := _exported_root(node)) is not None}
    gm.meta[EXPORTED_ROOT] = next(iter(roots)) if len(roots) == 1 else None if roots else above
    for call in gm.graph.nodes:
        if call.op == "call_function" and call.target in BODIES:
            for holder in call.args[BODIES[call.target]]:
                body = getattr(gm, holder.target)
                if call.target is CHECKPOINT:
                    mark_parameters(zip(body.graph.find_nodes(op="placeholder"), call.args[1:], strict=False))
                mark_exported_root(body, gm.meta[EXPORTED_ROOT])


def _exported_path(node: torch.fx.Node, path: str) -> str:
    """``path``, the FQN of a module within a ``GraphModule`` that Dynamo traced (see
    :func:`_is_source`), from the compiled model: placed by a parameter ``node`` reads, or
    by :data:`EXPORTED_ROOT`, else from the frame's module."""
    meta = node.graph.owning_module.meta if node.graph.owning_module is not None else {}
    root = _exported_root(node)
    root = meta.get(EXPORTED_ROOT) if root is None else root
    return _in_model(node.graph, path) if root is None else qualified_name(root, path)


def source_root(source: str) -> str:
    """The local or global of a frame that a Dynamo ``source`` starts from: ``L['self']``,
    ``L['args'][0]``, ``L['kwargs']['model']``, ``G['model']``; the module of a bound method
    torch.compile was given (``torch.compile(model.forward)``): ``L['fn'].__self__``."""
    found = re.match(r"[A-Z]\['[^']*'\](?:\[(?:\d+|'[^']*')\])?(?:\.__self__(?!\w))?", _unwrapped(source))
    return found.group(0) if found else source


def _in_model(graph: torch.fx.Graph, path: str) -> str:
    """``path``, from the module the graph's frame calls ``self``, from the compiled model:
    a frame Dynamo compiled apart (after a graph break) starts lower (:data:`ROOT_PATH`), a
    wrapper's frame higher (:data:`WRAPPER_PATH`)."""
    meta = graph.owning_module.meta if graph.owning_module is not None else {}
    if (above := meta.get(WRAPPER_PATH)) and (path == above or path.startswith(above + ".")):
        path = path.removeprefix(above).removeprefix(".")
    return qualified_name(meta.get(ROOT_PATH) or "", path)


def relative_state_name(node: torch.fx.Node) -> str | None:
    """The FQN of the parameter or buffer a Dynamo graph input holds, from the module the
    graph's frame calls ``self``; None for another input."""
    source = getattr(node, "_dynamo_source", None)
    return _placed_fqn(node.graph, source.name) if source is not None else None


def _submodule_frame(graph: torch.fx.Graph) -> bool:
    """Whether ``graph`` is (a body of) a submodule's frame: :data:`SUBMODULE_FRAME`."""
    return graph.owning_module is not None and bool(graph.owning_module.meta.get(SUBMODULE_FRAME))


def _name_module_layers(graph: torch.fx.Graph) -> None:
    """Name every layer call (and Function call) of ``graph`` made by a submodule (numbered
    where one makes several): the frame's own calls too where its module is a submodule."""
    own = _in_model(graph, "") if _submodule_frame(graph) else None
    calls: dict[str, list[torch.fx.Node]] = {}
    for node in filter(is_named_call, graph.nodes):
        if (path := module_path(node) or own) is not None:
            calls.setdefault(path, []).append(node)
    for path, nodes in calls.items():
        nodes = [n for n in nodes if LAYER_NAME not in n.meta]  # named by the pass that made them
        for i, node in enumerate(nodes):
            node.meta[LAYER_NAME] = path if len(nodes) == 1 else qualified_name(path, f"#{i}")


def shown_name(name: str) -> str:
    """A layer name for a message: a submodule's own call in a graph named relative to the
    submodule (``""``, ``"#i"``) spelled out."""
    if name and not name.startswith("#"):
        return name
    return f"(the submodule itself{f', call {name}' if name else ''})"


def qualified_name(path: str, name: str) -> str:
    """The name of ``name`` (a submodule, a layer; ``#i``: the module's i-th call; ``""``:
    the module itself) of the module at ``path`` (``""``: the root)."""
    if not path or not name:
        return path or name
    return path + name if name.startswith("#") else f"{path}.{name}"


def with_bodies(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """``gm`` and the bodies it calls (activation checkpoints, Functions' forward and
    backward, ``torch.cond``'s branches), theirs too: a pass that rewrites calls enters them
    (each call is one opaque node of ``gm``)."""
    graphs = [gm]
    for call in gm.graph.nodes:
        if call.op == "call_function" and call.target in BODIES:
            for body in call.args[BODIES[call.target]]:
                graphs += with_bodies(getattr(gm, body.target))
    return graphs


def find_calls(gm: torch.fx.GraphModule, targets: Any) -> list[tuple[torch.fx.GraphModule, torch.fx.Node]]:
    """The calls of ``targets`` in ``gm`` and its bodies, each with its graph."""
    return [
        (graph, node)
        for graph in with_bodies(gm)
        for node in graph.graph.nodes
        if node.op == "call_function" and node.target in targets
    ]


def recompile_bodies(gm: torch.fx.GraphModule) -> None:
    """Check and regenerate the code of ``gm``'s bodies after a rewrite (the driver does
    ``gm``'s own)."""
    for body in with_bodies(gm)[1:]:
        body.graph.lint()
        body.recompile()


def state_name(node: torch.fx.Node) -> str:
    """The FQN of the parameter or buffer a Dynamo graph input holds (``0.weight``), else the
    node's name."""
    path = relative_state_name(node)
    return _in_model(node.graph, path) if path is not None else node.name


def base_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node ``node`` reads through views and scale_grad nodes."""
    while True:
        if node.op == "call_method" and node.target in VIEW_METHODS:
            node = node.args[0]
        elif node.op == "call_function" and node.target in VIEW_FUNCTIONS | {SCALE_GRAD}:
            node = node.args[0]
        elif node.op == "call_function" and node.target is getattr and node.args[1] in VIEW_METHODS:
            node = node.args[0]
        elif _indexing(node) == "view":
            node = node.args[0]
        else:
            return node


def _indexing(node: torch.fx.Node) -> str | None:
    """For ``tensor[index]``: ``"view"`` (integers, slices, ``None``, ``...``) or ``"gather"``
    (an index tensor or list among them); else ``None``."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return None
    if not isinstance(_example_of(node.args[0]), torch.Tensor):
        return None  # an element of a tuple
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    gathers = any(isinstance(_example_of(i), torch.Tensor | list) for i in index)
    return "gather" if gathers else "view"


def gather_of_parameter(node: torch.fx.Node) -> torch.fx.Node | None:
    """The gather through which ``node`` reads picked slices of a parameter (``w[index]``
    with an index tensor, ``index_select``), possibly through views: a mixture-of-experts
    layer's weights picked per token. Else ``None``."""
    node = base_of(node)
    picks = (
        _indexing(node) == "gather"
        or (node.op == "call_function" and node.target is torch.index_select)
        or (node.op == "call_method" and node.target == "index_select")
    )
    return node if picks and parameter_of(node.args[0]) is not None else None


def parameter_of(node: torch.fx.Node) -> torch.nn.Parameter | None:
    """The parameter ``node`` reads, possibly through views and scale_grad nodes."""
    node = base_of(node)
    if node.op == "placeholder":
        grapharg = node.meta.get("grapharg")
        example = grapharg.example if grapharg is not None else None
    elif node.op == "get_attr":  # a parameter, or a subgraph, a constant (flex attention's mask)
        try:
            example = node.graph.owning_module.get_parameter(node.target)
        except AttributeError:
            example = None
    else:
        example = None
    return example if isinstance(example, torch.nn.Parameter) else None


# Dynamo's source of a tensor in a module's parameter slot
PARAMETER_SLOT = re.compile(r"\._parameters\['[^']*'\]$")


def weight_of(node: torch.fx.Node) -> torch.Tensor | None:
    """The weight ``node`` reads, possibly through views: a parameter; a tensor in a module's
    parameter slot (``torch.func.functional_call``'s fast weights); or a leaf tensor that
    requires grad :func:`held` by an object, a global or a closure
    (``self.w = torch.randn(..., requires_grad=True)``)."""
    if (parameter := parameter_of(node)) is not None:
        return parameter
    node = base_of(node)
    grapharg = node.meta.get("grapharg") if node.op == "placeholder" else None
    example, source = getattr(grapharg, "example", None), getattr(grapharg, "source", None)
    if not isinstance(example, torch.Tensor) or isinstance(example, FakeTensor) or source is None:
        return None
    slot = PARAMETER_SLOT.search(source.name) is not None
    trained = example.is_leaf and example.requires_grad and held(source)
    return example if slot or trained else None


def held(source: Any) -> bool:
    """Whether Dynamo's ``source`` reaches its value through an attribute of an object, a
    global or a closure cell, not as an argument of the compiled frame or an item of one
    (the input batch, in a tuple, a dict or ``*args``)."""
    while (base := getattr(source, "base", None)) is not None:
        if isinstance(source, AttrSource):
            return True
        source = base
    return not (isinstance(source, LocalSource) and source.is_input)


def append_input(gm: torch.fx.GraphModule, name: str, like: torch.fx.Node) -> torch.fx.Node:
    """A new last input of ``gm`` named ``name``, with the example value of ``like``."""
    with gm.graph.inserting_after(gm.graph.find_nodes(op="placeholder")[-1]):
        node = gm.graph.placeholder(name)
    node.meta["example_value"] = like.meta.get("example_value")
    return node


def mark_parameters(pairs: Iterable[tuple[torch.fx.Node, Any]]) -> None:
    """Give each input of a body (a subgraph another graph calls) that reads a weight, in
    ``pairs`` of (the body's input, what its caller passes it), the weight's Dynamo record,
    so that :func:`parameter_of` and :func:`weight_of` find it there too."""
    for inner, outer in pairs:
        if isinstance(outer, torch.fx.Node) and weight_of(outer) is not None:
            source = base_of(outer)
            inner.meta["grapharg"] = source.meta.get("grapharg")
            if hasattr(source, "_dynamo_source"):
                inner._dynamo_source = source._dynamo_source


def computed_from_parameters(node: torch.fx.Node, budget: int = 32) -> bool:
    """Whether ``node`` is computed in the graph from parameters, with buffers and constants
    at most: a parametrized weight (``weight_norm``), a masked one (``prune``). A path
    longer than ``budget`` nodes counts as data (an activation's reaches the batch)."""
    if parameter_of(node) is not None:
        return False  # the parameter itself
    stack, seen, found = [node], set(), False
    while stack:
        current = base_of(stack.pop())
        if current in seen:
            continue
        seen.add(current)
        if len(seen) > budget:
            return False
        if parameter_of(current) is not None:
            found = True
        elif current.op in ("placeholder", "get_attr"):
            if not _is_buffer(current):
                return False
        elif current.op in ("call_function", "call_method"):
            stack.extend(current.all_input_nodes)
        else:
            return False
    return found


def _is_buffer(node: torch.fx.Node) -> bool:
    """Whether the graph input or attribute ``node`` holds one of the model's buffers."""
    if node.op == "get_attr":
        return node.target in dict(node.graph.owning_module.named_buffers())
    source = getattr(node, "_dynamo_source", None)
    return source is not None and "_buffers" in source.name


def dropout_at(x, p):
    """Dropout of ``x`` (a proxy, in training) at rate ``p``: a number, or a graph input (a
    float Dynamo made symbolic, as ``dynamic=True`` does), which no Python branch can read
    (``torch.dropout`` draws nothing at rate 0)."""
    if isinstance(p, torch.fx.Proxy):
        return torch.dropout(x, p, True)
    return F.dropout(x, p=p) if p > 0.0 else x


def inline(
    gm: torch.fx.GraphModule, node: torch.fx.Node, fn: Callable[..., Any], args: dict[str, Any]
) -> Any:
    """Run ``fn(**args)`` on FX proxies of ``args``' nodes: its torch calls become nodes
    before ``node``, with ``node``'s module stack and example values. Returns what ``fn``
    returned, with nodes in place of proxies."""
    tracer = torch.fx.proxy.GraphAppendingTracer(gm.graph)
    before = set(gm.graph.nodes)
    with gm.graph.inserting_before(node):
        proxies = map_aggregate(
            args, lambda a: torch.fx.Proxy(a, tracer) if isinstance(a, torch.fx.Node) else a
        )
        out = fn(**proxies)
    out = map_aggregate(out, lambda a: a.node if isinstance(a, torch.fx.Proxy) else a)
    new = [n for n in gm.graph.nodes if n not in before]
    fake_mode = _fake_mode(node)
    for made in new:
        place_in_module(made, node)
        if fake_mode is not None:
            with fake_mode:
                made.meta["example_value"] = _example(made)
    return out


def place_in_module(made: torch.fx.Node, node: torch.fx.Node) -> None:
    """Give the new node ``made`` ``node``'s module stack and stack trace (reports and
    pipeline stages place it with ``node``'s layer)."""
    made.meta["nn_module_stack"] = dict(node.meta.get("nn_module_stack") or {})
    made.meta["stack_trace"] = node.meta.get("stack_trace")


def _fake_mode(node: torch.fx.Node) -> Any:
    """The fake mode of ``node``'s inputs' example values (a DTensor's: its local tensor's;
    the graph's copy may carry another in its context), or ``None``."""
    values = [a.meta.get("example_value") for a in node.all_input_nodes]
    values = [getattr(v, "_local_tensor", v) for v in values]
    return next((v.fake_mode for v in values if isinstance(v, FakeTensor)), None)


def refresh_example(node: torch.fx.Node) -> None:
    """Compute ``node``'s example value again from its inputs' (its arguments changed)."""
    if (fake_mode := _fake_mode(node)) is not None:
        with fake_mode:
            node.meta["example_value"] = _example(node)


def cast_to(
    value: torch.fx.Node, dtype: torch.dtype, layer_call: torch.fx.Node, before: torch.fx.Node | None = None
) -> torch.fx.Node:
    """``value.to(dtype)``, right before ``before`` (else right after ``value``), a node of
    ``layer_call``'s module with its example value; marked (:data:`CAST`) if it goes right
    before ``layer_call``, whose operand it prepares."""
    graph = value.graph
    with graph.inserting_before(before) if before is not None else graph.inserting_after(value):
        node = graph.call_method("to", (value, dtype))
    place_in_module(node, layer_call)
    node.meta[CAST] = before is layer_call
    refresh_example(node)
    return node


def _example(node: torch.fx.Node) -> Any:
    """``node``'s value on its inputs' example values."""
    args, kwargs = map_aggregate((node.args, node.kwargs), _example_of)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def _example_of(value: Any) -> Any:
    return value.meta.get("example_value") if isinstance(value, torch.fx.Node) else value


def replace_with(node: torch.fx.Node, outputs: tuple[Any, ...] | Any) -> None:
    """Point ``node``'s users at ``outputs`` (a tuple: each ``getitem`` user at its element)."""
    if not isinstance(outputs, tuple):
        node.replace_all_uses_with(outputs)
    else:
        for user in list(node.users):
            index = user.args[1] if user.target is operator.getitem else None
            if index is None or not isinstance(outputs[index], torch.fx.Node):
                raise RuntimeError(f"lowprec: cannot replace {user.format_node()} of {node.name}")
            user.replace_all_uses_with(outputs[index])
            user.graph.erase_node(user)
    node.graph.erase_node(node)


def name_canonically(gm: torch.fx.GraphModule) -> None:
    """Rename ``gm``'s nodes from their graph alone: each name's numeric suffix renumbered
    in graph order, placeholders kept. Two equal graphs traced along different histories
    (the adaptive variants' forwards) then print the same code, which Inductor's cache
    keys on."""
    graph = torch.fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    graph._codegen = gm.graph._codegen
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            node.name = re.sub(r"_\d+$", "", node.name)  # a candidate: the new graph numbers it
        env[node] = graph.node_copy(node, env.__getitem__)
    gm.graph = graph
    gm.recompile()
