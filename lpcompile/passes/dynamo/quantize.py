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
error and weight-gradient positions. ``annotate_lowprec_nodes``
(:mod:`lpcompile.passes.aot.annotate`) labels those ATen nodes. Products
accumulate in FP32 (the matmul itself is untouched).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import operator
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from lpcompile.config import ROLES, LowPrecConfig, QuantSpec, Role
from lpcompile.numerics.quantize import (
    FLOAT_DTYPES,
    divides_back_exactly,
    is_rowwise,
    is_tiled,
    part_dtype,
    per_tensor,
    scaling_argument,
)
from lpcompile.passes.driver import CompileContext, KeptProduct, Site
from lpcompile.passes.dynamo.functions import (
    BACKWARD,
    FUNCTION_BODY,
    backward_inputs,
    from_gradients,
    function_bodies,
    pass_to_backward,
    pass_to_forward,
    saved_values,
)
from lpcompile.passes.graph import (
    BODIES,
    CAST,
    CHECKPOINT,
    COND,
    CONV_TARGETS,
    CONV_TRANSPOSE_TARGETS,
    FLEX_ATTENTION,
    FUNCTION_APPLY,
    GROUPED_MM_TARGETS,
    LIBRARY_PRODUCTS,
    LINEAR_TARGETS,
    LOWPREC_OPS,
    OPERAND_NAMES,
    SCALE_GRAD,
    append_input,
    base_of,
    cast_to,
    computed_from_parameters,
    find_calls,
    gather_of_parameter,
    has_backward,
    is_attention,
    is_function_call,
    is_layer_call,
    is_named_call,
    layer_name,
    mark_parameters,
    needs_grad,
    parameter_of,
    place_in_module,
    product_operands,
    product_output,
    recompile_bodies,
    refresh_example,
    shown_name,
    state_name,
    weight_of,
    weight_operand,
    with_bodies,
)

SEED_INPUT = "lowprec_seed"
FLEX_FULL = "does not write FlexAttention out"
FLOAT64_TABLE = "the model computes it in float64, and no gradient flows through it"
CHECKPOINT_PARENT = "lowprec_checkpoint_parent"  # GraphModule.meta key of a body: (parent, call)
COND_PARENT = "lowprec_cond_parent"  # GraphModule.meta key of a torch.cond branch: (parent, call)
BODY_INPUTS = "lowprec_body_inputs"  # GraphModule.meta key of a body: {name: its input of lowprec's own}


def _insert(
    gm: torch.fx.GraphModule,
    ctx: CompileContext,
    value: torch.fx.Node,
    role: Role,
    layer: str,
    spec: QuantSpec,
    grad: bool,
    before: torch.fx.Node | None = None,
    site: Site | None = None,
) -> torch.fx.Node:
    """Insert a quantize (``grad=False``) or quantize_grad node of ``value``.

    It goes right before ``before`` (the layer call that reads it) or, without
    one, right after ``value``. Given a ``site``, it rounds with that site's random
    stream: the same tensor then gets the same bits.
    """
    if site is None:
        site = Site(
            offset=ctx.new_offset(),
            role=role.value,
            layer=layer,
            fmt=spec.fmt,
            rounding=spec.rounding,
            overflow=spec.overflow,
            scaling=spec.scaling,
            op="quantize_grad" if grad else "quantize",
        )
        ctx.sites[site.offset] = site
    seed = (
        graph_input(gm, ctx, SEED_INPUT, torch.zeros((), dtype=torch.int64))
        if spec.rounding == "stochastic"
        else None
    )
    args = (value, spec.fmt, spec.rounding, spec.overflow, seed, site.offset)
    scaling = scaling_argument(spec.scaling)
    with gm.graph.inserting_before(before) if before is not None else gm.graph.inserting_after(value):
        if grad:
            node = gm.graph.call_function(torch.ops.lowprec.quantize_grad.default, (*args, *scaling))
        else:
            node = gm.graph.call_function(torch.ops.lowprec.quantize.default, (*args, None, *scaling))
    node.meta["lowprec"] = site.meta()
    if "example_value" in value.meta:
        node.meta["example_value"] = value.meta["example_value"]
    return node


def graph_input(
    gm: torch.fx.GraphModule, ctx: CompileContext, name: str, example: torch.Tensor
) -> torch.fx.Node:
    """Lowprec's own input ``name`` (the step's seed, the adaptive scales) in ``gm``: the
    Dynamo graph's (``ctx.add_input``), or, in a body, an input its call passes it to: an
    activation-checkpoint body's (so the recomputation in the backward reads the same seed,
    and rounds with the same bits, as the forward), both ``torch.cond`` branches' (one more
    operand), a Function's forward body's, or one its forward body saves for its backward
    body."""
    checkpoint, cond, function = (gm.meta.get(k) for k in (CHECKPOINT_PARENT, COND_PARENT, FUNCTION_BODY))
    if checkpoint is None and cond is None and function is None:
        return ctx.add_input(gm, name, example)
    inputs = gm.meta.setdefault(BODY_INPUTS, {})
    if name in inputs:
        return inputs[name]
    if checkpoint is not None:
        parent_gm, call = checkpoint
        outer = graph_input(parent_gm, ctx, name, example)
        inputs[name] = append_input(gm, name, outer)
        call.args = (*call.args, outer)
    elif cond is not None:
        parent_gm, call = cond
        outer = graph_input(parent_gm, ctx, name, example)
        call.update_arg(3, (*call.args[3], outer))
        for holder in call.args[1:3]:
            branch = getattr(parent_gm, holder.target)
            branch.meta.setdefault(BODY_INPUTS, {})[name] = append_input(branch, name, outer)
    else:
        parent_gm, call, phase = function
        forward = getattr(parent_gm, call.args[0].target)
        if phase == BACKWARD:
            inputs[name] = pass_to_backward(forward, gm, graph_input(forward, ctx, name, example))
        else:
            inputs[name] = pass_to_forward(forward, call, graph_input(parent_gm, ctx, name, example))
    return inputs[name]


def outermost(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node:
    """The node of the Dynamo graph that ``node`` of ``gm`` (a checkpoint body, a
    ``torch.cond`` branch, or the graph itself) reads, through bodies' inputs and views."""
    node = base_of(node)
    while node.op == "placeholder":
        index = gm.graph.find_nodes(op="placeholder").index(node)
        if (parent := gm.meta.get(CHECKPOINT_PARENT)) is not None:
            gm, call = parent
            node = base_of(call.args[1 + index])
        elif (parent := gm.meta.get(COND_PARENT)) is not None:
            gm, call = parent
            node = base_of(call.args[3][index])
        else:
            break
    return node


def nodes_in_run_order(
    gm: torch.fx.GraphModule,
    pick: Callable[[torch.fx.GraphModule], Iterable[torch.fx.Node]],
    branches: bool = True,
) -> list[tuple[torch.fx.GraphModule, torch.fx.Node]]:
    """The nodes ``pick`` chooses in ``gm`` and in the checkpoint bodies (and, with
    ``branches``, the ``torch.cond`` branches, the true branch's first) it calls, each with
    its graph, in the order they run."""
    picked = set(pick(gm))
    bodies: dict[torch.fx.Node, list[torch.fx.GraphModule]] = {}
    for body, call in checkpoint_bodies(gm) + (cond_branches(gm) if branches else []):
        bodies.setdefault(call, []).append(body)
    found = []
    for node in gm.graph.nodes:
        if node in picked:
            found.append((gm, node))
        for body in bodies.get(node, ()):
            found += nodes_in_run_order(body, pick, branches)
    return found


def layers_in_order(
    gm: torch.fx.GraphModule, ctx: CompileContext
) -> list[tuple[torch.fx.GraphModule, torch.fx.Node]]:
    """The layer calls to quantize (:func:`kept_layers`) of ``gm`` and of the checkpoint
    bodies and ``torch.cond`` branches it calls, each with its graph, in the order they run."""
    return nodes_in_run_order(gm, lambda graph: kept_layers(graph, ctx))


def checkpoint_bodies(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.GraphModule, torch.fx.Node]]:
    """The activation-checkpoint bodies ``gm`` calls, with their calls, each marked with its
    parent and its inputs' parameters (a body reads the parent's parameters as inputs)."""
    found = []
    for call in gm.graph.find_nodes(op="call_function", target=CHECKPOINT):
        body = getattr(gm, call.args[0].target)
        body.meta[CHECKPOINT_PARENT] = (gm, call)
        mark_parameters(zip(body.graph.find_nodes(op="placeholder"), call.args[1:], strict=False))
        found.append((body, call))
    return found


def cond_branches(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.GraphModule, torch.fx.Node]]:
    """The ``torch.cond`` branches ``gm`` calls, with their calls, each marked with its parent
    and its inputs' parameters (Dynamo gives each branch a module of its own)."""
    found = []
    for call in gm.graph.find_nodes(op="call_function", target=COND):
        for holder in call.args[1:3]:
            branch = getattr(gm, holder.target)
            branch.meta[COND_PARENT] = (gm, call)
            mark_parameters(zip(branch.graph.find_nodes(op="placeholder"), call.args[3], strict=False))
            found.append((branch, call))
    return found


def has_bodies(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """Whether ``gm`` calls activation-checkpoint, Function or ``torch.cond`` bodies."""
    return any(gm.graph.find_nodes(op="call_function", target=target) for target in BODIES)


def forget_body_parents(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Take off the bodies the marks :func:`checkpoint_bodies`, :func:`cond_branches`,
    :func:`function_bodies` and :func:`graph_input` left.

    They point back into the parent graph, and AOT autograd keys its cache on a pickle of
    every submodule's ``meta``: with a cycle there it logged a pickling error and compiled
    the graph again in every process.
    """
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            module.meta.pop(CHECKPOINT_PARENT, None)
            module.meta.pop(COND_PARENT, None)
            module.meta.pop(FUNCTION_BODY, None)
            module.meta.pop(BODY_INPUTS, None)


def _operands_to_args(call: torch.fx.Node) -> None:
    """Move operands passed by keyword (``F.linear(x, weight=w)``) to their positions."""
    args, kwargs = list(call.args), dict(call.kwargs)
    for name in OPERAND_NAMES.get(call.target, ("input", "other"))[len(args) :]:
        if name not in kwargs:
            break
        args.append(kwargs.pop(name))
    call.args, call.kwargs = tuple(args), kwargs


def flatten_einsum_operands(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Write each ``einsum`` as ``einsum(equation, *operands)``, the form the other passes
    read: its operands may come as one list (``einsum("bi,ij->bj", [x, w])``, as HF
    Longformer writes it) or interleaved with sublists of ints (``einsum(x, [0, 1], w,
    [1, 2])``), which torch reads as the equation these letters spell."""
    for _, call in find_calls(gm, {torch.einsum}):
        args = call.args
        if isinstance(args[0], str):
            if len(args) == 2 and isinstance(args[1], (list, tuple)):
                call.args = (args[0], *args[1])
            continue
        operands, sublists = args[0::2], args[1::2]
        output = f"->{_subscripts(args[-1])}" if len(args) % 2 else ""
        equation = ",".join(map(_subscripts, sublists)) + output
        call.args = (equation, *operands[: len(sublists)])
    recompile_bodies(gm)


# torch.sparse's products, which a graph holds with dense operands only (Dynamo does not
# trace sparse tensors): the products they compute, and their keywords' names there
SPARSE_PRODUCTS = {
    torch.sparse.mm: (torch.mm, {"sparse": "input", "dense": "mat2"}),
    torch.sparse.addmm: (torch.addmm, {}),
}


def write_dense_sparse_products(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Write ``torch.sparse.mm``/``addmm`` of dense tensors as ``torch.mm``/``addmm``, the
    products they compute, which every pass knows (``reduce`` needs a sparse operand)."""
    for _, call in find_calls(gm, SPARSE_PRODUCTS.keys()):
        call.target, names = SPARSE_PRODUCTS[call.target]
        call.kwargs = {names.get(key, key): value for key, value in call.kwargs.items()}
    recompile_bodies(gm)


# In-place products, each the method of its out-of-place product
INPLACE_PRODUCTS = {f"{name}_": name for name in ("addmm", "baddbmm", "addbmm", "addmv", "addr")}


def write_inplace_products(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Write each in-place product (``out.addmm_(x, w)``) as its product into a copy
    (``out.copy_(out.addmm(x, w))``), which the quantize pass rounds like any other."""
    for graph in with_bodies(gm):
        for call in [n for n in graph.graph.nodes if n.op == "call_method" and n.target in INPLACE_PRODUCTS]:
            call.target = INPLACE_PRODUCTS[call.target]
            users = list(call.users)
            with graph.graph.inserting_after(call):
                copy = graph.graph.call_method("copy_", (call.args[0], call))
            copy.meta = dict(call.meta)
            for user in users:
                user.replace_input_with(call, copy)
    recompile_bodies(gm)


aten = torch.ops.aten
RECURRENT_NAMES = ("lstm", "gru", "rnn_tanh", "rnn_relu")
# ATen operators a graph may call directly (a module torch.export wrote, as
# torch.distributed.pipelining's ``pipeline()`` stages are), each the torch function of
# the same arguments that the passes know: products, recurrent layers, and the views
# through which a product reads its weight
ATEN_FUNCTIONS: dict[object, object] = {
    aten.linear.default: F.linear,
    **{getattr(aten, name).default: getattr(torch, name) for name in ("mm", "bmm", "matmul", "mv", "dot")},
    **{getattr(aten, name).default: getattr(torch, name) for name in ("vdot", "inner", "outer")},
    **{getattr(aten, name).default: getattr(torch, name) for name in INPLACE_PRODUCTS.values()},
    **{getattr(aten, f"conv{d}d").default: getattr(torch, f"conv{d}d") for d in (1, 2, 3)},
    **{getattr(aten, f"conv{d}d").padding: getattr(torch, f"conv{d}d") for d in (1, 2, 3)},
    aten.conv_transpose1d.default: torch.conv_transpose1d,
    aten.conv_transpose2d.input: torch.conv_transpose2d,
    aten.conv_transpose3d.input: torch.conv_transpose3d,
    aten.einsum.default: torch.einsum,  # (equation, [operands])
    aten.tensordot.default: torch.tensordot,  # (a, b, dims of a, dims of b)
    aten.bilinear.default: F.bilinear,
    aten._grouped_mm.default: torch._grouped_mm,
    aten.scaled_dot_product_attention.default: F.scaled_dot_product_attention,
    **{getattr(aten, name).input: getattr(torch, name) for name in RECURRENT_NAMES},
    **{getattr(aten, f"{name}_cell").default: getattr(torch, f"{name}_cell") for name in RECURRENT_NAMES},
    **{getattr(aten, name).default: getattr(torch, name) for name in ("t", "permute", "reshape", "narrow")},
    aten.transpose.int: torch.transpose,
}
ATEN_METHODS = {aten.view.default: "view", aten.contiguous.default: "contiguous"}


def aten_overload(node: torch.fx.Node) -> torch._ops.OpOverload | None:
    """The overload in :data:`ATEN_FUNCTIONS` or :data:`ATEN_METHODS` that ``node`` calls
    (by overload, ``aten.mm.default``, or by packet, ``aten.mm``), if any."""
    if node.op != "call_function":
        return None
    if node.target in ATEN_FUNCTIONS or node.target in ATEN_METHODS:
        return node.target
    if isinstance(node.target, torch._ops.OpOverloadPacket):  # the overloads of one map to one function
        known = (getattr(node.target, name) for name in node.target.overloads())
        return next((o for o in known if o in ATEN_FUNCTIONS or o in ATEN_METHODS), None)
    return None


def write_aten_calls(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Write each call of an ATen operator in :data:`ATEN_FUNCTIONS` (or :data:`ATEN_METHODS`)
    as the torch function (method) every pass knows, of the same arguments: ``einsum``
    without its contraction ``path``, ``tensordot``'s dimensions as one pair."""
    for graph in with_bodies(gm):
        for call in list(graph.graph.nodes):
            if (overload := aten_overload(call)) is None:
                continue
            call.target = overload
            args, kwargs = list(call.args), dict(call.kwargs)
            positional = [a.name for a in call.target._schema.arguments if not a.kwarg_only]
            for name in positional[len(args) :]:  # arguments given by keyword, in their places
                if name not in kwargs:
                    break
                args.append(kwargs.pop(name))
            call.args = tuple(args)
            if call.target is aten.einsum.default:
                kwargs.pop("path", None)
            if call.target is aten.tensordot.default:
                call.args = (*call.args[:2], (call.args[2], call.args[3]))
            if call.target in ATEN_METHODS:
                call.op, call.target = "call_method", ATEN_METHODS[call.target]
            else:
                call.target = ATEN_FUNCTIONS[call.target]
            call.kwargs = kwargs
    recompile_bodies(gm)


def _subscripts(sublist: list) -> str:
    """The equation letters of an einsum sublist, as torch spells them: 0-25 are A-Z, 26-51
    a-z (an implicit output orders its letters A-Z, then a-z)."""
    return "".join(
        "..." if i is Ellipsis else chr(ord("A") + i) if i < 26 else chr(ord("a") + i - 26) for i in sublist
    )


def kept_layers(gm: torch.fx.GraphModule, ctx: CompileContext) -> list[torch.fx.Node]:
    """The layer calls (products and Function calls) to quantize, after ``exclude`` and
    ``keep_first_last``.

    Their operands are in ``call.args`` (input, weight, bias), wherever the user's
    code passed them by keyword.
    """
    calls = [n for n in gm.graph.nodes if is_named_call(n)]
    for call in filter(is_layer_call, calls):
        _operands_to_args(call)
    calls = [n for n in calls if not is_constant_beyond_fp32(n)]
    if ctx.config.attention == "off":
        calls = [n for n in calls if not is_attention(n)]
    if ctx.config.keep_first_last:
        calls = calls[1:-1]
    return [n for n in calls if not _excluded(layer_name(n), ctx.config.exclude)]


def is_constant_beyond_fp32(call: torch.fx.Node) -> bool:
    """Whether ``call`` multiplies float64 (or complex128) tensors that are no parameters and get no
    gradient: a table the model's code computes in float64 on purpose (the rotary-embedding
    angles of diffusers' Flux), which stays as written. A float64 product of a layer's
    weight or in the trained path is refused instead (:func:`check_operand_dtypes`)."""
    operands = [call.args[i] for i in product_operands(call) or () if i < len(call.args)]
    operands = [o for o in operands if isinstance(o, torch.fx.Node)]
    values = [o.meta.get("example_value") for o in operands]
    beyond = any(isinstance(v, torch.Tensor) and part_dtype(v.dtype) == torch.float64 for v in values)
    trained = any(needs_grad(o) or parameter_of(o) is not None for o in operands)
    return beyond and not trained


def _excluded(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def warn_settings_without_effect(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Warn when a layer setting does nothing in this graph, or not what it says:
    ``keep_first_last`` in a graph that is a piece of the model (it keeps the piece's first
    and last layers) or with no layer between the first and the last (then every layer
    stays in higher precision), or ``attention="full"`` with FlexAttention calls, which
    stay whole. Keep the ``exclude`` patterns that match none of its layers for the
    backend, which warns about those no graph of the model matches (a typo, or names a
    block's graph cannot see): another graph (after a graph break) may hold the layer."""
    # (stacklevel 1: the user's frame is far up, under torch.compile's)
    names = [layer_name(n) for n in gm.graph.nodes if is_named_call(n)]
    # a block compiled on its own: its graph may run for every identical block
    apart = (
        "; to treat one of identical blocks apart, compile it with options of its own"
        " (block.compile(backend='lowprec', options={..., 'exclude': [...]})): Dynamo keeps a"
        " graph per options"
    )
    if ctx.config.exclude:
        unused = [p for p in ctx.config.exclude if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        graph = f"a graph with layers {[shown_name(name) for name in names]}"
        if ctx.piece:
            graph += f" (this graph is {ctx.piece}: its layer names start there)"
        if ctx.piece.startswith("submodule"):
            graph += apart
        ctx.unmatched_excludes = (unused, graph)
    flex = [layer_name(n) for n in gm.graph.find_nodes(op="call_function", target=FLEX_ATTENTION)]
    if ctx.config.attention == "full" and flex:
        message = (
            f"lowprec: attention='full' {FLEX_FULL} (in {flex}): their Q, K, V and error are rounded,"
            " their probabilities are not (score_mod and the block mask run inside the fused call)"
        )
        warnings.warn(message, stacklevel=1)
    if ctx.config.keep_first_last and ctx.piece and names:
        message = (
            f"lowprec: keep_first_last keeps the first and last layer of each graph, and this graph is"
            f" {ctx.piece}: its first and last layers ({shown_name(names[0])}, {shown_name(names[-1])})"
            " stay in higher precision, not the model's"
        )
        if ctx.piece.startswith("submodule"):
            message += apart
        else:
            message += "; name the model's first and last layers in exclude=[...] instead"
        warnings.warn(message, stacklevel=1)
    if ctx.config.keep_first_last and 0 < len(names) <= 2:
        shown = [shown_name(name) for name in names]
        message = f"lowprec: keep_first_last leaves every layer of a graph unquantized (its layers: {shown})"
        warnings.warn(message, stacklevel=1)


def op_name(node: torch.fx.Node) -> str:
    if is_function_call(node):
        return "autograd.Function"
    return str(getattr(node.target, "__name__", node.target))


def record_kept_products(gm: torch.fx.GraphModule, ctx: CompileContext, calls: list[torch.fx.Node]) -> None:
    """Note in ``ctx.kept`` each product of ``gm`` that stays in higher precision, and why."""
    config = ctx.config
    quantized = set(calls)
    for node in gm.graph.nodes:
        if not is_named_call(node) or node in quantized:
            continue
        elif is_constant_beyond_fp32(node):
            reason = FLOAT64_TABLE
        elif config.attention == "off" and is_attention(node):
            reason = "attention='off'"
        elif _excluded(layer_name(node), config.exclude):
            reason = "exclude"
        else:
            reason = "keep_first_last"
        ctx.kept.append(KeptProduct(layer_name(node), op_name(node), reason))
    if config.attention == "full":  # FlexAttention stays one call: its probabilities are not rounded
        for node in quantized & set(gm.graph.find_nodes(op="call_function", target=FLEX_ATTENTION)):
            ctx.kept.append(KeptProduct(layer_name(node), "flex_attention probabilities", FLEX_FULL))


def warn_float64_tables(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Warn about the float64 tables a graph computes as written (but those of layers
    ``exclude`` keeps in higher precision anyway)."""
    if not ctx.config.quantizes:
        return
    exclude = ctx.config.exclude
    layers = (n for n in gm.graph.nodes if is_layer_call(n) and not _excluded(layer_name(n), exclude))
    tables = [n for n in layers if is_constant_beyond_fp32(n)]
    if tables:
        found = ", ".join(f"{op_name(n)} in {layer_name(n)!r}" for n in tables)
        warnings.warn(f"lowprec: products left in float64: {found}: {FLOAT64_TABLE}", stacklevel=1)


def insert_quantize(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Quantize the operands, weight gradients and errors of every product (linear, conv,
    conv_transpose, matmul, mm, bmm, addmm, baddbmm, einsum, bilinear, attention, ...),
    in the graph and in the activation-checkpoint bodies it calls."""
    refuse_differentiating_transforms(gm, ctx)
    calls = kept_layers(gm, ctx)  # (first: it moves keyword operands, which name some layers)
    warn_settings_without_effect(gm, ctx)
    warn_float64_tables(gm, ctx)
    if ctx.config.quantizes:
        record_kept_products(gm, ctx, calls)
    warn_untransformed_library_products(ctx, calls)
    warn_per_matmul_in_complex_products(ctx, calls)
    _quantize_calls(gm, ctx, [call for call in calls if is_layer_call(call)])
    for call in filter(is_function_call, calls):
        _quantize_function(gm, ctx, call)
    branches = cond_branches(gm)
    for body, _ in checkpoint_bodies(gm):
        insert_quantize(body, ctx)
    known = set(ctx.sites)
    for body, _ in branches:
        insert_quantize(body, ctx)
    warn_per_matmul_in_branches(ctx, [site for offset, site in ctx.sites.items() if offset not in known])
    for body, _ in checkpoint_bodies(gm) + branches:  # (a branch may get its sibling's inputs)
        body.graph.lint()
        body.recompile()
    warn_unentered_subgraphs(gm, ctx)
    warn_opaque_operators(gm, ctx)
    warn_matmul_distances(gm, ctx)
    warn_linear_algebra(gm, ctx)


def warn_per_matmul_in_branches(ctx: CompileContext, sites: list[Site]) -> None:
    """With a per-matmul option, warn naming the layers with a weight among ``sites`` (those
    of ``torch.cond`` branches): the per-matmul roundings do not enter branches."""
    layers = sorted({site.layer for site in sites if site.role == "weight"})
    if ctx.config.per_matmul and layers:
        warnings.warn(
            f"lowprec: {', '.join(ctx.config.per_matmul)}: the backward matmuls of {layers} in"
            " torch.cond branches read each operand rounded as its role is (the per-matmul"
            " roundings do not enter branches)",
            stacklevel=1,
        )


def warn_per_matmul_in_complex_products(ctx: CompileContext, calls: list[torch.fx.Node]) -> None:
    """With a per-matmul option, warn naming the layers of complex products among ``calls``:
    the per-matmul roundings do not follow the conjugate transposes of their backward."""
    layers = sorted({shown_name(layer_name(call)) for call in calls if _is_complex_product(call)})
    if ctx.config.per_matmul and layers:
        warnings.warn(
            f"lowprec: {', '.join(ctx.config.per_matmul)}: the backward matmuls of the complex"
            f" products of {layers} read each operand rounded as its role is (the per-matmul"
            " roundings do not follow a complex product's conjugate transposes)",
            stacklevel=1,
        )


# torch.func's differentiating transforms (grad, vjp, jacrev; jvp, jacfwd) in a Dynamo graph
DIFFERENTIATING_TRANSFORMS = {
    torch._C._functorch._grad_increment_nesting: "torch.func.grad, vjp or jacrev",
    torch._functorch.predispatch._jvp_increment_nesting: "torch.func.jvp or jacfwd",
    torch._C._functorch._jvp_increment_nesting: "torch.func.jvp or jacfwd",
}


def refuse_differentiating_transforms(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Refuse a graph that differentiates with torch.func: torch (2.13) runs no custom
    operator's autograd formula under those transforms (the Function it generates for one
    has no ``setup_context``: pytorch/pytorch#170834), and jvp has no forward formula for
    the rounding, so the compile would fail deep in AOT autograd."""
    if not ctx.config.quantizes:
        return
    for node in gm.graph.nodes:
        if node.op == "call_function" and (transform := DIFFERENTIATING_TRANSFORMS.get(node.target)):
            raise NotImplementedError(
                f"lowprec: this graph differentiates with {transform}, which torch cannot run "
                "through lowprec's rounding operators (their autograd formulas are not callable "
                "under torch.func's transforms: pytorch/pytorch#170834). Differentiate with "
                "torch.autograd (loss.backward(), torch.autograd.grad) instead, or compile the "
                "transformed function with another backend"
            )


# Operator namespaces of torch's own ops, lowprec's, and the collectives DDP and FSDP2 add
TORCH_NAMESPACES = {
    *("aten", "prims", "lowprec", "inductor", "profiler", "streams"),
    *("c10d", "c10d_functional", "_c10d_functional", "_dtensor", "fsdp"),
}
OPAQUE = "a custom operator: any product inside it, forward or backward, runs unrounded"
ATEN_OPAQUE = "an ATen operator called directly, which lowprec does not write as a torch function: unrounded"


def _library_operator(node: torch.fx.Node) -> str | None:
    """The qualified name of the operator ``node`` calls (``aten::mm``), if it calls one."""
    if node.op != "call_function":
        return None
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target.name()
    if isinstance(node.target, torch._ops.OpOverloadPacket):
        return node.target._qualified_op_name
    return None


# Words in the names of ATen's products (``_scaled_dot_product_flash_attention``,
# ``convolution``, ``addmm``, ``lstm``): one called directly that no pass writes as a
# torch function (:data:`ATEN_FUNCTIONS`) runs unrounded
ATEN_PRODUCT_WORDS = {
    *("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "addr", "outer", "inner"),
    *("matmul", "einsum", "bilinear", "trilinear", "tensordot", "attention", "convolution", "conv"),
    *("conv1d", "conv2d", "conv3d", "tbc", "linear", *RECURRENT_NAMES, "rnn"),
}
# ATen products of one operand, and operators whose names hold those words but multiply nothing
ATEN_POWERS = {"matrix_power", "linalg_matrix_power"}
ATEN_NO_PRODUCTS = {"_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "_cudnn_rnn_flatten_weight"}


def _is_aten_product(name: str) -> bool:
    """Whether the ATen operator ``name`` (``aten::_scaled_mm``) multiplies tensors."""
    namespace, _, op = name.partition("::")
    packet = op.split(".")[0]
    if namespace != "aten" or packet in ATEN_NO_PRODUCTS:
        return False
    return packet in ATEN_POWERS or not ATEN_PRODUCT_WORDS.isdisjoint(packet.split("_"))


def _opaque_name(node: torch.fx.Node) -> str:
    """The layer name of an operator call lowprec leaves alone: its module's, or, in the
    compiled model's own ``forward``, its first parameter's (as a layer's weight names it)."""
    name = layer_name(node)
    weights = [n for n in node.all_input_nodes if parameter_of(n) is not None]
    return state_name(base_of(weights[0])) if name == node.name and weights else name


def warn_opaque_operators(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Warn about calls of other libraries' operators (``torch.library``), and of ATen
    products called directly that lowprec does not write as torch functions, that take two
    or more float tensors (an ATen matrix power: one): whatever they multiply runs inside
    them, unrounded."""
    if not ctx.config.quantizes:
        return
    found: dict[bool, list[str]] = {False: [], True: []}  # custom operators, ATen's
    for node in gm.graph.nodes:
        name = _library_operator(node)
        if name is None or is_layer_call(node):
            continue
        power = name.startswith("aten::") and name[6:].split(".")[0] in ATEN_POWERS  # of one operand
        if len([n for n in node.all_input_nodes if _is_float(n)]) < (1 if power else 2):
            continue
        if (ours := name.split("::")[0] in TORCH_NAMESPACES) and not _is_aten_product(name):
            continue
        layer = _opaque_name(node)
        found[ours].append(f"{name} in {layer!r}")
        ctx.kept.append(KeptProduct(layer, name, ATEN_OPAQUE if ours else OPAQUE))
    if found[False]:
        warnings.warn(
            f"lowprec: custom operators run as they are: {', '.join(found[False])}; lowprec cannot"
            " see inside them, so any product they compute, forward or backward, is not rounded"
            " (written with torch ops, in a module or a torch.autograd.Function, it would be)",
            stacklevel=1,
        )
    if found[True]:
        warnings.warn(
            f"lowprec: ATen products called directly run as they are: {', '.join(found[True])};"
            " lowprec rounds the operands of the torch functions (F.linear, torch.matmul,"
            " F.conv2d, F.scaled_dot_product_attention, ...) and of their ATen operators"
            " (aten.linear, aten.mm, ...), not of these, forward or backward",
            stacklevel=1,
        )


def warn_untransformed_library_products(ctx: CompileContext, calls: list[torch.fx.Node]) -> None:
    """With ``wgrad_hadamard``, warn about the layers among ``calls`` (those rounded, before
    their rounding) whose weight gradient another library's operator computes inside
    (transformers' grouped matmul of experts): its operands are rounded per tensor, without
    the Hadamard transform."""
    if not ctx.config.wgrad_hadamard:
        return
    found = [
        f"{layer_name(call)!r} (inside {name}, another library's operator)"
        for call in calls
        if (name := _library_operator(call)) in LIBRARY_PRODUCTS and weight_operand(call) is not None
    ]
    if found:
        warnings.warn(
            f"lowprec: wgrad_hadamard: the operands of the weight gradients of {', '.join(found)}"
            " are rounded without the Hadamard transform",
            stacklevel=1,
        )


CDIST = (
    "its Euclidean distances go through a matrix product, which runs unrounded (written out, "
    "(x1.square().sum(-1, keepdim=True) - 2 * x1 @ x2.mT + x2.square().sum(-1)).clamp_min(0).sqrt(), "
    "the product is rounded)"
)
# torch.cdist's compute modes: the default multiplies where either input has more rows
MM_IF_NECESSARY = "use_mm_for_euclid_dist_if_necessary"
MM_ALWAYS = "use_mm_for_euclid_dist"
MM_NEVER = "donot_use_mm_for_euclid_dist"
CDIST_ROWS = 25


def _cdist_multiplies(node: torch.fx.Node) -> bool:
    """Whether a ``torch.cdist`` call may compute its distances with a matrix product."""
    args = dict(zip(("x1", "x2", "p", "compute_mode"), node.args, strict=False)) | node.kwargs
    mode = args.get("compute_mode") or MM_IF_NECESSARY
    if args.get("p", 2.0) != 2.0 or mode == MM_NEVER:
        return False
    inputs = [n for n in (args["x1"], args["x2"]) if isinstance(n, torch.fx.Node)]
    rows = [n.meta["example_value"].shape[-2] for n in inputs]
    return mode == MM_ALWAYS or any(not isinstance(r, int) or r > CDIST_ROWS for r in rows)


def _with_function_bodies(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """``gm`` and the forward and backward bodies of the custom Functions it calls (those
    with products or without)."""
    calls = gm.graph.find_nodes(op="call_function", target=FUNCTION_APPLY)
    return [gm, *(getattr(gm, body.target) for call in calls for body in call.args[:2])]


def warn_matmul_distances(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Warn about ``torch.cdist`` calls (in ``gm`` and its Functions' bodies) that multiply
    inside (p=2, more than 25 rows or ``compute_mode="use_mm_for_euclid_dist"``): that
    product runs unrounded."""
    if not ctx.config.quantizes:
        return
    found = [
        node
        for graph in _with_function_bodies(gm)
        for node in graph.graph.find_nodes(op="call_function", target=torch.cdist)
        if _cdist_multiplies(node)
    ]
    for node in found:
        ctx.kept.append(KeptProduct(layer_name(node), "cdist", CDIST))
    if found:
        layers = ", ".join(repr(layer_name(node)) for node in found)
        warnings.warn(f"lowprec: torch.cdist in {layers}: {CDIST}", stacklevel=1)


# Linear algebra whose result or gradient is a product with an inverse, computed inside
# the call: lowprec rounds products, not solves
SOLVES = {
    torch.linalg.inv,
    torch.linalg.inv_ex,
    torch.inverse,
    torch.linalg.pinv,
    torch.linalg.solve,
    torch.linalg.solve_ex,
    torch.linalg.solve_triangular,
    torch.linalg.lstsq,
    torch.linalg.lu_solve,
    torch.cholesky_solve,
    torch.linalg.tensorinv,
    torch.linalg.tensorsolve,
    torch.linalg.ldl_solve,
    torch.pinverse,
    torch.triangular_solve,
    torch.lu_solve,
    torch.cholesky_inverse,
}
# their method forms
SOLVE_METHODS = {"inverse", "pinverse", "cholesky_solve", "cholesky_inverse", "triangular_solve", "lu_solve"}
SOLVE = (
    "inverts or solves in the model's precision, and its backward multiplies by the inverse "
    "unrounded: lowprec rounds products, not linear algebra (the products the model makes "
    "of its result are rounded)"
)


def warn_linear_algebra(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Warn about inverses and solves (``linalg.inv``, ``solve``, ...; in ``gm`` and its
    Functions' bodies), whose products, forward and backward, run inside the call,
    unrounded."""
    if not ctx.config.quantizes:
        return
    found = [
        n
        for graph in _with_function_bodies(gm)
        for n in graph.graph.nodes
        if (n.op == "call_function" and n.target in SOLVES)
        or (n.op == "call_method" and n.target in SOLVE_METHODS)
    ]
    for node in found:
        ctx.kept.append(KeptProduct(layer_name(node), op_name(node), SOLVE))
    if found:
        calls = ", ".join(f"{op_name(node)} in {layer_name(node)!r}" for node in found)
        warnings.warn(f"lowprec: {calls}: {SOLVE}", stacklevel=1)


def warn_unentered_subgraphs(gm: torch.fx.GraphModule, ctx: CompileContext, entered=BODIES) -> None:
    """Warn about products inside subgraphs of higher-order ops the pass does not enter
    (all but activation checkpoints, Functions and ``torch.cond``: ``map``, ``scan``, ...;
    in a Function's bodies, none): they run unrounded."""
    if not ctx.config.quantizes:
        return
    missed = []
    for node in gm.graph.find_nodes(op="get_attr"):
        sub = getattr(gm, node.target, None)
        if not isinstance(sub, torch.fx.GraphModule) or any(u.target in entered for u in node.users):
            continue
        for inner in sub.graph.nodes:
            if is_layer_call(inner):
                layer, op = layer_name(inner), op_name(inner)
                missed.append(f"{op} in {layer!r}")
                ctx.kept.append(KeptProduct(layer, op, "in a higher-order op's subgraph"))
    if missed:
        warnings.warn(
            "lowprec: products inside higher-order-op subgraphs stay in higher precision:"
            f" {', '.join(missed)} (the quantize pass enters only activation-checkpoint,"
            " autograd.Function and torch.cond bodies)",
            stacklevel=1,
        )


def runs_under_autocast(call: torch.fx.Node, device: str) -> bool:
    """Whether ``call`` runs with autocast on for ``device``: entered around the compiled
    call (Dynamo compiles under that state, and guards on it), or inside the graph (in a
    checkpoint body or a ``torch.cond`` branch: in it, or around its call in the parent)."""
    module = call.graph.owning_module
    parent = module.meta.get(CHECKPOINT_PARENT) or module.meta.get(COND_PARENT)
    if parent is not None:
        enabled = [runs_under_autocast(parent[1], device)]
    else:
        enabled = [torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)]
    for node in call.graph.nodes:
        if node is call:
            break
        if node.target is torch.amp._enter_autocast and node.args[0] == device:
            enabled.append(bool(node.args[2]))
        elif node.target is torch.amp._exit_autocast and node.args[0].args[0] == device:
            enabled.pop()
    return enabled[-1]


def check_operand_dtypes(call: torch.fx.Node) -> None:
    """Refuse, naming the layer, a product of operands in a dtype lowprec does not quantize
    (float64) or of two dtypes outside autocast (eager torch refuses those too; compiled,
    they fail deep inside Inductor)."""
    values = [call.args[i].meta.get("example_value") for i in product_operands(call)]
    dtypes = [v.dtype for v in values if is_float_value(v)]
    layer = shown_name(layer_name(call))
    for dtype in dtypes:
        if part_dtype(dtype) not in FLOAT_DTYPES:
            raise TypeError(
                f"lowprec: layer {layer!r} ({op_name(call)}) computes in {dtype}; lowprec"
                " quantizes float32, float16 and bfloat16 models, and complex ones of those parts"
                " (convert it with model.float(), a complex128 tensor with .to(torch.complex64))"
            )
    devices = {v.device.type for v in values if isinstance(v, torch.Tensor)}
    if len(set(dtypes)) > 1 and not any(runs_under_autocast(call, device) for device in devices):
        mixed = " by ".join(map(str, dtypes))
        raise TypeError(
            f"lowprec: layer {layer!r} ({op_name(call)}) multiplies {mixed}: its operands"
            " must have one dtype, as in eager torch (cast the input to the model's dtype)"
        )


# Products that read one rounding of an operand along more than one dimension (a
# convolution's window, a fused attention kernel's forward and backward, bilinear's weight):
# a rowwise scaling rounds their operands per tensor (see passes/joint/rowwise.py).
WHOLE_TENSOR_TARGETS = (
    CONV_TARGETS | CONV_TRANSPOSE_TARGETS | {F.scaled_dot_product_attention, FLEX_ATTENTION, F.bilinear}
)


def spec_for(call: torch.fx.Node, spec: QuantSpec) -> QuantSpec:
    """How ``call``'s operands of a role with ``spec`` are rounded: a rowwise or tiled spec
    per tensor for a product that is not a matmul (:data:`WHOLE_TENSOR_TARGETS`, other
    libraries' operators: a convolution's tiles would split the channels it sums over),
    and a rowwise one in a ``torch.cond`` branch too (a subgraph of the joint graph, which
    the rounding per matmul does not enter). A complex product's are rounded per tensor too:
    the rounding per matmul does not follow the conjugate transposes of its backward."""
    library = isinstance(call.target, torch._ops.OpOverload | torch._ops.OpOverloadPacket)
    branch = COND_PARENT in call.graph.owning_module.meta
    not_matmul = call.target in WHOLE_TENSOR_TARGETS or library or _is_complex_product(call)
    if (is_rowwise(spec.scaling) and (not_matmul or branch)) or (is_tiled(spec.scaling) and not_matmul):
        return dataclasses.replace(spec, scaling=per_tensor(spec.scaling))
    return spec


def _is_complex_product(call: torch.fx.Node) -> bool:
    operands = (call.args[i] for i in product_operands(call) or () if i < len(call.args))
    return any(
        isinstance(o, torch.fx.Node) and getattr(o.meta.get("example_value"), "is_complex", bool)()
        for o in operands
    )


def _quantize_operand(
    gm: torch.fx.GraphModule,
    ctx: CompileContext,
    operand: torch.fx.Node,
    call: torch.fx.Node,
    before: torch.fx.Node,
    computed_weight: bool = False,
    *,
    backward: bool,
    upcast: bool = False,
) -> torch.fx.Node:
    """``operand`` of the product ``call``, quantized (with its gradient, for a trained
    weight of a product with a ``backward``) right before ``before``, in FP32 if ``upcast``.
    A weight is a parameter, or (``computed_weight``) a tensor computed from parameters."""
    config, layer = ctx.config, layer_name(call)
    weight = computed_weight or weight_of(operand) is not None
    value = cast_to(operand, torch.float32, call, before) if upcast and _in_16_bits(operand) else operand
    if weight and backward and config.weight_grad.enabled and needs_grad(operand):
        spec = spec_for(call, config.weight_grad)
        value = _insert(gm, ctx, value, Role.WEIGHT_GRAD, layer, spec, True, before)
    role = Role.WEIGHT if weight else Role.ACTIVATION
    if config.spec(role).enabled:
        value = _insert(gm, ctx, value, role, layer, spec_for(call, config.spec(role)), False, before)
    return value


def _quantize_calls(gm: torch.fx.GraphModule, ctx: CompileContext, calls: list[torch.fx.Node]) -> None:
    config = ctx.config
    # found before any quantize is inserted: those read lowprec's seed, an input of no parameter
    computed = {
        operand
        for call in calls
        for operand in map(call.args.__getitem__, product_operands(call))
        if isinstance(operand, torch.fx.Node) and computed_from_parameters(operand)
    }
    # (a product whose output gets no gradient has no error and no weight gradient: one
    # under no_grad, a frozen first layer's; a weight gathered for several products gets
    # one where any of them does)
    backward = {call: (output := product_output(call)) is not None and _gets_error(output) for call in calls}
    gathers: dict[torch.fx.Node, bool] = {}  # the gathers of a parameter read, and their backward
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # the products that read each gather
    for call in calls:
        for operand in map(call.args.__getitem__, product_operands(call)):
            if isinstance(operand, torch.fx.Node) and (gather := gather_of_parameter(operand)) is not None:
                gathers[gather] = gathers.get(gather, False) or backward[call]
                readers.setdefault(gather, []).append(call)
    for call in calls:  # (before any product reads FP32 operands)
        check_operand_dtypes(call)
    upcasts = {call: computes_in_fp32(call, config) for call in calls}
    for products in readers.values():  # one dtype for a gathered weight: FP32 only if all agree
        if not all(upcasts[call] for call in products):
            upcasts.update(dict.fromkeys(products, False))
    # a gather of a parameter cast up -> (its dtype before, the views products read it through)
    upcast_gathers: dict[torch.fx.Node, tuple[torch.dtype, set[torch.fx.Node]]] = {}
    for call in calls:
        layer, upcast = layer_name(call), upcasts[call]
        for index in product_operands(call):
            operand = call.args[index]
            if not isinstance(operand, torch.fx.Node):
                continue
            if (gather := gather_of_parameter(operand)) is not None:
                # the weight picked per token (experts): quantize the whole parameter before the
                # gather, so that it is rounded once and its summed gradient is rounded whole
                if upcast and gather not in upcast_gathers and _in_16_bits(gather):
                    upcast_gathers[gather] = (gather.meta["example_value"].dtype, set())
                if gather in gathers:
                    rounded = _quantize_operand(
                        gm, ctx, gather.args[0], call, gather, backward=gathers.pop(gather), upcast=upcast
                    )
                    gather.update_arg(0, rounded)
                    if gather in upcast_gathers:
                        refresh_example(gather)
                if gather in upcast_gathers:  # (it may read the parameter cast up for another product)
                    views = _view_chain(operand, gather)[:-1]
                    upcast_gathers[gather][1].update(views)
                    for view in reversed(views):
                        refresh_example(view)
                continue
            if (base := base_of(operand)) in upcast_gathers:
                # another product's gather, whose parameter its rounding now hides: this product
                # rounds it again, in FP32 (no 16-bit copy of it between)
                views = _view_chain(operand, base)[:-1]
                upcast_gathers[base][1].update(views)
                for view in reversed(views):
                    refresh_example(view)
            value = _quantize_operand(
                gm, ctx, operand, call, call, operand in computed, backward=backward[call], upcast=upcast
            )
            if value is not operand:
                call.update_arg(index, value)
        output = result = product_output(call)
        users = list(output.users) if output is not None else []
        bias = _take_bias(call) if adds_bias_after(call, config) else None
        if upcast:
            dtype, device = call.meta["example_value"].dtype, call.meta["example_value"].device.type
            autocast = runs_under_autocast(call, device)
            _upcast_other_arguments(call)
            # (it runs without autocast: none, the model's region without it, or lowprec's)
            off = torch.amp.is_autocast_available(device)
            with torch.autocast(device, enabled=False) if off else contextlib.nullcontext():
                refresh_example(call)
        if config.error.enabled and backward[call]:
            result = _insert(gm, ctx, output, Role.ERROR, layer, spec_for(call, config.error), True)
        if upcast and dtype != torch.float32:
            result = cast_to(result, dtype, call)
        if bias is not None:
            result = _add_bias(result, bias, call)
        for user in users:
            user.replace_input_with(output, result)
        if upcast and autocast:
            _run_outside_autocast(call, device)
    for gather, (dtype, views) in upcast_gathers.items():
        _cast_back_other_readers(gather, dtype, views, set(calls))


def _cast_back_other_readers(
    gather: torch.fx.Node, dtype: torch.dtype, views: set[torch.fx.Node], products: set[torch.fx.Node]
) -> None:
    """Give the readers of the FP32 ``gather`` (and of its ``views`` that products read) that
    are neither those views nor products, nor roundings of a product's operand (a second
    product rounds the gathered weight again), its values cast back to ``dtype``, as they
    read them before."""
    for node in (gather, *views):
        for user in list(node.users):
            if user not in views and user not in products and user.target not in LOWPREC_OPS:
                user.replace_input_with(node, cast_to(node, dtype, user, user))


def _run_outside_autocast(call: torch.fx.Node, device: str) -> None:
    """Put ``call`` between an ``_enter_autocast`` that turns autocast off for ``device``
    and its ``_exit_autocast``, so that it multiplies its FP32 operands in FP32. The
    entry is marked (:data:`CAST`): it prepares the product, and joins its pipeline stage."""
    graph = call.graph
    with graph.inserting_before(call):
        enter = graph.call_function(torch.amp._enter_autocast, (device, None, False, None))
    with graph.inserting_after(call):
        leave = graph.call_function(torch.amp._exit_autocast, (enter,))
    for node in (enter, leave):
        place_in_module(node, call)
    enter.meta[CAST] = True


def computes_in_fp32(call: torch.fx.Node, config: LowPrecConfig) -> bool:
    """Whether the product ``call`` of float16 or bfloat16 operands runs in FP32: a role
    rounded for it has factors that are no powers of two, so that its values divided back
    are no 16-bit values. Its rounded operands stay FP32 and its result is cast back, as an
    FP8 GEMM applies the factors in FP32 and rounds only its result (and as torchao's
    float8 training emulates it). Under autocast, which would cast its operands to 16 bits
    (or has cast its output), the product is also one of a 16-bit operand or result, and
    runs with autocast off. In other libraries' operators and in grouped matmuls (which
    take 16-bit operands only), the product runs as it is."""
    example = call.meta.get("example_value")
    if not isinstance(example, torch.Tensor) or product_output(call) is not call:
        return False
    if call.target in GROUPED_MM_TARGETS or "grouped_mm" in op_name(call):
        return False
    if isinstance(call.target, torch._ops.OpOverload) and call.target.namespace != "aten":
        return False
    if isinstance(call.target, torch._ops.OpOverloadPacket) and not call.target._qualified_op_name.startswith(
        "aten::"
    ):
        return False
    operands = [call.args[i] for i in product_operands(call) if i < len(call.args)]
    if not any(isinstance(o, torch.fx.Node) for o in operands):
        return False
    if runs_under_autocast(call, example.device.type):
        if not _in_16_bits(call) and not any(map(_in_16_bits, operands)):
            return False
    elif not all(map(_in_16_bits, operands)):
        return False
    specs = [spec_for(call, config.spec(role)) for role in ROLES]
    specs += [getattr(config, name) for name in config.per_matmul]
    return any(spec.enabled and not divides_back_exactly(spec.scaling) for spec in specs)


def _in_16_bits(arg: object) -> bool:
    """Whether ``arg`` is a graph value of a float16 or bfloat16 tensor."""
    value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16)


def _bias_of(call: torch.fx.Node) -> object:
    return call.args[2] if len(call.args) > 2 else call.kwargs.get("bias")


def adds_bias_after(call: torch.fx.Node, config: LowPrecConfig) -> bool:
    """Whether the linear layer ``call`` adds its bias to its product's result (error site
    and cast back included), not inside the product: under a scaled rounding of one of its
    roles, torchao's float8 recipes, which add it so."""
    if call.target not in LINEAR_TARGETS or not isinstance(_bias_of(call), torch.fx.Node):
        return False
    specs = (spec_for(call, config.spec(role)) for role in ROLES)
    return any(spec.enabled and spec.scaling != "none" for spec in specs)


def _take_bias(call: torch.fx.Node) -> torch.fx.Node:
    """The linear layer ``call``'s bias, taken out of the call."""
    bias = _bias_of(call)
    if len(call.args) > 2:
        call.update_arg(2, None)
    else:
        call.update_kwarg("bias", None)
    return bias


def _upcast_other_arguments(call: torch.fx.Node) -> None:
    """Cast ``call``'s 16-bit tensor arguments that are no product operands (a bias, an
    attention mask) to FP32."""
    operands = set(product_operands(call))
    for index, arg in enumerate(call.args):
        if index not in operands and _in_16_bits(arg):
            call.update_arg(index, cast_to(arg, torch.float32, call, call))
    for key, arg in call.kwargs.items():
        if _in_16_bits(arg):
            call.update_kwarg(key, cast_to(arg, torch.float32, call, call))


def _add_bias(result: torch.fx.Node, bias: torch.fx.Node, call: torch.fx.Node) -> torch.fx.Node:
    """``result + bias`` in ``result``'s dtype (autocast's, for an FP32 bias), a node of
    ``call``'s module right after ``result``."""
    with result.graph.inserting_after(result):
        added = result.graph.call_function(operator.add, (result, bias))
    dtypes = {getattr(node.meta.get("example_value"), "dtype", None) for node in (result, bias)}
    if None not in dtypes and len(dtypes) > 1:
        added.update_arg(1, cast_to(bias, result.meta["example_value"].dtype, call, added))
    place_in_module(added, call)
    refresh_example(added)
    return added


def _gets_error(output: torch.fx.Node) -> bool:
    """Whether a product's ``output`` gets a gradient, as its fake example says (under the
    grad mode where it ran: an ``enable_grad`` block of a frame entered under ``no_grad``
    has a backward). Unlike :func:`needs_grad`, which reads any example, a missing error
    site is a silent FP32 error: without a fake example (under ``torch.vmap``, a plain
    tensor whose ``requires_grad`` says nothing) the grad mode the graph compiled under
    decides (:func:`has_backward`)."""
    example = output.meta.get("example_value")
    return (
        example.requires_grad if isinstance(example, FakeTensor) else has_backward(output.graph.owning_module)
    )


def _quantize_function(gm: torch.fx.GraphModule, ctx: CompileContext, call: torch.fx.Node) -> None:
    """Quantize the products of a custom ``torch.autograd.Function``, named after its call.

    Its forward body rounds each product operand (weight if it reads a parameter, else
    activation) at its base, the tensor before views, once. Its backward body rounds
    operands computed from the outputs' gradients as errors and those read from saved
    tensors with their forward role, a saved tensor the forward rounded with the forward's
    random stream (the same bits). The gradient it returns for a parameter its forward
    multiplies is rounded as a weight gradient: on each input reading that parameter that
    the backward returns a gradient for (Dynamo may pass a view the forward multiplies,
    ``w.T``, as an input of its own, and the gradient to the parameter itself).
    """
    config, layer = ctx.config, layer_name(call)
    forward, backward = function_bodies(gm, call)
    _take_views_inside(forward, call)
    rounded = _round_body_operands(forward, ctx, layer, set(), {})
    if has_backward(gm):  # (compiled under no_grad, its backward never runs)
        spec = config.weight_grad
        inputs = forward.graph.find_nodes(op="placeholder")[: len(call.args) - 2]
        multiplied = {
            id(weight_of(inner)) for inner, site in rounded.items() if site.role == Role.WEIGHT.value
        }
        (gradients,) = backward.graph.output_node().args
        for index, inner in enumerate(inputs, 2):
            weight = weight_of(inner) is not None and id(weight_of(inner)) in multiplied
            returned = len(gradients) != len(inputs) or gradients[index - 2] is not None
            if spec.enabled and weight and returned and needs_grad(arg := call.args[index]):
                call.update_arg(index, _insert(gm, ctx, arg, Role.WEIGHT_GRAD, layer, spec, True, call))
        grads, saved = backward_inputs(forward, backward)
        pairs = zip(saved, saved_values(forward), strict=True)
        reuse = {inner: rounded[outer] for inner, outer in pairs if outer in rounded}
        _round_body_operands(backward, ctx, layer, from_gradients(backward, grads), reuse)
    for body in (forward, backward):
        warn_unentered_subgraphs(body, ctx, entered=())
        warn_opaque_operators(body, ctx)
        body.graph.lint()
        body.recompile()


def _take_views_inside(forward: torch.fx.GraphModule, call: torch.fx.Node) -> None:
    """Where Dynamo passes the Function ``call`` a view of a parameter (``w.T``) beside the
    parameter itself, have its forward body take that view of the parameter's input: the
    forward then rounds the parameter, whose rounding the backward reuses where it reads
    the parameter saved (the same stochastic bits). Adaptive loss scaling's ``scale_grad``
    nodes around the arguments are looked through."""
    inputs = forward.graph.find_nodes(op="placeholder")
    outer = [_unscaled(arg) for arg in call.args[2 : 2 + len(inputs)]]
    position = {arg: i for i, arg in enumerate(outer) if isinstance(arg, torch.fx.Node)}
    for inner, arg in zip(inputs, outer, strict=True):
        if not isinstance(arg, torch.fx.Node) or (base := base_of(arg)) is arg or not inner.users:
            continue
        if base in position and weight_of(base) is not None and _only_views(arg, base):
            view = _views_of(forward, arg, base, inputs[position[base]], inputs[-1].next)
            inner.replace_all_uses_with(view)


def _unscaled(arg: object) -> object:
    """``arg`` without the ``scale_grad`` nodes around it."""
    while isinstance(arg, torch.fx.Node) and arg.op == "call_function" and arg.target is SCALE_GRAD:
        arg = arg.args[0]
    return arg


def _only_views(node: torch.fx.Node, base: torch.fx.Node) -> bool:
    """Whether ``node`` reads ``base`` through views only, each of it alone (no
    ``scale_grad``, no other graph value among its arguments)."""
    while node is not base:
        if node.target is SCALE_GRAD or any(other is not node.args[0] for other in node.all_input_nodes):
            return False
        node = node.args[0]
    return True


def _round_body_operands(
    body: torch.fx.GraphModule,
    ctx: CompileContext,
    layer: str,
    errors: set[torch.fx.Node],
    reuse: dict[torch.fx.Node, Site],
) -> dict[torch.fx.Node, Site]:
    """Round the float operands of every product of a Function body at their bases (the
    tensors their views read): a base in ``errors`` as an error, one that reads a parameter
    as a weight, else as an activation; a base in ``reuse`` with that site. The products
    read views of the rounded bases. Returns each rounded base's site."""
    rounded: dict[torch.fx.Node, torch.fx.Node] = {}
    sites: dict[torch.fx.Node, Site] = {}
    for call in [n for n in body.graph.nodes if is_layer_call(n)]:
        _operands_to_args(call)
        check_operand_dtypes(call)
        for index in product_operands(call):
            operand = call.args[index] if index < len(call.args) else None
            if not isinstance(operand, torch.fx.Node) or not _is_float(operand):
                continue
            base = base_of(operand)
            weight = weight_of(base) is not None
            role = Role.ERROR if base in errors else Role.WEIGHT if weight else Role.ACTIVATION
            spec = spec_for(call, ctx.config.spec(role))
            if not spec.enabled:
                continue
            if base not in rounded:
                rounded[base] = _insert(body, ctx, base, role, layer, spec, False, call, reuse.get(base))
                sites[base] = ctx.sites[rounded[base].args[5]]
            call.update_arg(index, _views_of(body, operand, base, rounded[base], call))
    return sites


def _is_float(node: torch.fx.Node) -> bool:
    return is_float_value(node.meta.get("example_value"))


def is_float_value(value: object) -> bool:
    """Whether ``value`` is a tensor lowprec rounds the values of: real or complex floats."""
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _view_chain(operand: torch.fx.Node, base: torch.fx.Node) -> list[torch.fx.Node]:
    """``operand``, the views it takes of ``base``, and ``base`` last."""
    chain = [operand]
    while chain[-1] is not base:
        chain.append(chain[-1].args[0])
    return chain


def _views_of(
    gm: torch.fx.GraphModule,
    operand: torch.fx.Node,
    base: torch.fx.Node,
    value: torch.fx.Node,
    before: torch.fx.Node,
) -> torch.fx.Node:
    """``operand``'s views of ``base`` taken of ``value`` instead, right before ``before``."""
    copies = {base: value}
    for view in reversed(_view_chain(operand, base)[:-1]):
        with gm.graph.inserting_before(before):
            copies[view] = gm.graph.node_copy(view, lambda node: copies.get(node, node))
    return copies[operand]
