"""Quantize-node passes (Mellempudi et al. 2019).

``insert_quantize`` runs on the Dynamo graph, where layers are still explicit
calls (``linear``, ``conv2d``, ``matmul``) that carry their module's name.
For each such call it inserts:

* ``lowprec::quantize`` on every input: weights and activations are rounded
  in the forward (straight-through gradient);
* ``lowprec::quantize_grad`` on the weight, before its forward quantize: the
  weight gradient is rounded in the backward;
* ``lowprec::quantize_grad`` on the output: the error (gradient w.r.t. the
  output) is rounded before the layer's backward matmuls read it.

AOT autograd then traces these operators into the ATen forward graph and, for
``quantize_grad``, a ``lowprec::quantize`` node into the backward graph at the
error and weight-gradient positions. ``annotate_lowprec_nodes`` labels those
ATen nodes. Products accumulate in FP32 (the matmul itself is untouched).
"""

from __future__ import annotations

import fnmatch
import operator
import re
import warnings

import torch
import torch.fx
import torch.nn.functional as F

import lpcompile.adaptive_ops  # noqa: F401  (registers lowprec::scale_grad)
from lpcompile.config import QuantSpec, Role
from lpcompile.passes import CompileContext, Site

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


SEED_INPUT = "lowprec_seed"


def _insert(
    gm: torch.fx.GraphModule,
    ctx: CompileContext,
    value: torch.fx.Node,
    role: Role,
    layer: str,
    spec: QuantSpec,
    grad: bool,
    before: torch.fx.Node | None = None,
) -> torch.fx.Node:
    """Insert a quantize (``grad=False``) or quantize_grad node of ``value``.

    It goes right before ``before`` (the layer call that reads it) or, without
    one, right after ``value``.
    """
    site = Site(
        offset=ctx.new_offset(),
        role=role.value,
        layer=layer,
        fmt=spec.fmt,
        rounding=spec.rounding,
        overflow=spec.overflow,
        op="quantize_grad" if grad else "quantize",
    )
    ctx.sites[site.offset] = site
    seed = None
    if spec.rounding == "stochastic":
        seed = ctx.add_input(gm, SEED_INPUT, torch.zeros((), dtype=torch.int64))
    args = (value, spec.fmt, spec.rounding, spec.overflow, seed, site.offset)
    with gm.graph.inserting_before(before) if before is not None else gm.graph.inserting_after(value):
        if grad:
            node = gm.graph.call_function(torch.ops.lowprec.quantize_grad.default, args)
        else:
            node = gm.graph.call_function(torch.ops.lowprec.quantize.default, (*args, None))
    node.meta["lowprec"] = site.meta()
    if "example_value" in value.meta:
        node.meta["example_value"] = value.meta["example_value"]
    return node


def _operand_names(call: torch.fx.Node) -> tuple[str, ...]:
    """The parameter names of a layer call's leading positions."""
    if call.target in LINEAR_TARGETS | CONV_TARGETS | CONV_TRANSPOSE_TARGETS:
        return ("input", "weight", "bias")
    if call.target in (torch.mm, torch.bmm, "mm", "bmm"):
        return ("input", "mat2")
    return ("input", "other")


def _operands_to_args(call: torch.fx.Node) -> None:
    """Move operands passed by keyword (``F.linear(x, weight=w)``) to their positions."""
    args, kwargs = list(call.args), dict(call.kwargs)
    for name in _operand_names(call)[len(args) :]:
        if name not in kwargs:
            break
        args.append(kwargs.pop(name))
    call.args, call.kwargs = tuple(args), kwargs


def kept_layers(gm: torch.fx.GraphModule, ctx: CompileContext) -> list[torch.fx.Node]:
    """The layer calls to quantize, after ``exclude`` and ``keep_first_last``.

    Their operands are in ``call.args`` (input, weight, bias), wherever the user's
    code passed them by keyword.
    """
    calls = [n for n in gm.graph.nodes if is_layer_call(n)]
    for call in calls:
        _operands_to_args(call)
    if ctx.config.keep_first_last:
        calls = calls[1:-1]
    return [n for n in calls if not _excluded(layer_name(n), ctx.config.exclude)]


def _excluded(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def warn_settings_without_effect(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Warn when a layer setting does nothing in this graph: an ``exclude`` pattern that
    matches none of its layers (a typo, or a layer in another graph: each graph break
    or pipeline stage is a graph), or ``keep_first_last`` with no layer between the
    first and the last (then every layer stays in higher precision)."""
    # (stacklevel 1: the user's frame is far up, under torch.compile's)
    names = [layer_name(n) for n in gm.graph.nodes if is_layer_call(n)]
    kept = [layer_name(n) for n in gm.graph.nodes if is_unquantized_product(n)]  # kept anyway
    if unused := [p for p in ctx.config.exclude if not any(fnmatch.fnmatchcase(n, p) for n in names + kept)]:
        message = f"lowprec: exclude patterns {unused} match no layer of a graph with layers {names}"
        warnings.warn(message, stacklevel=1)
    if ctx.config.keep_first_last and 0 < len(names) <= 2:
        message = f"lowprec: keep_first_last leaves every layer of a graph unquantized (its layers: {names})"
        warnings.warn(message, stacklevel=1)


def warn_unquantized_products(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Warn about the products in a graph that the pass leaves in higher precision (but
    those of layers ``exclude`` keeps there anyway)."""
    if not ctx.config.quantizes:
        return
    exclude = ctx.config.exclude
    calls = [n for n in gm.graph.nodes if is_unquantized_product(n) and not _excluded(layer_name(n), exclude)]
    if calls:
        found = ", ".join(f"{getattr(n.target, '__name__', n.target)} in {layer_name(n)!r}" for n in calls)
        message = (
            f"lowprec: products left in higher precision: {found}. The quantize pass knows "
            "linear, conv, conv_transpose, matmul, mm and bmm (attention is quantized when "
            "written with torch.matmul; see docs/known-limitations.md)"
        )
        warnings.warn(message, stacklevel=1)


def insert_quantize(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Quantize the inputs, weight gradients and errors of every matmul/conv (transposed too)."""
    config = ctx.config
    calls = kept_layers(gm, ctx)  # (first: it moves keyword operands, which name some layers)
    warn_settings_without_effect(gm, ctx)
    warn_unquantized_products(gm, ctx)
    for call in calls:
        layer = layer_name(call)
        operands = call.args[:2]
        for index, operand in enumerate(operands):
            if not isinstance(operand, torch.fx.Node):
                continue
            weight = parameter_of(operand) is not None
            value = operand
            if weight and config.weight_grad.enabled:
                value = _insert(gm, ctx, value, Role.WEIGHT_GRAD, layer, config.weight_grad, True, call)
            role = Role.WEIGHT if weight else Role.ACTIVATION
            if config.spec(role).enabled:
                value = _insert(gm, ctx, value, role, layer, config.spec(role), False, call)
            if value is not operand:
                call.update_arg(index, value)
        if config.error.enabled:
            users = list(call.users)
            error = _insert(gm, ctx, call, Role.ERROR, layer, config.error, True)
            for user in users:
                user.replace_input_with(call, error)


def annotate_lowprec_nodes(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Label each lowprec node of an ATen graph with the site it came from."""
    for node in gm.graph.nodes:
        if node.target in LOWPREC_OPS:
            offset = node.args[5]
            site = ctx.sites.get(offset)
            if site is None:
                continue
            meta = site.meta()
            # A quantize_grad site rounds in the backward; its forward node is a copy.
            meta["phase"] = "backward" if LOWPREC_OPS[node.target] != site.op else "forward"
            node.meta["lowprec"] = meta
