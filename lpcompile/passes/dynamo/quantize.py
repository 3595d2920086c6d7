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

import fnmatch
import warnings

import torch
import torch.fx

from lpcompile.config import QuantSpec, Role
from lpcompile.passes.driver import CompileContext, Site
from lpcompile.passes.graph import (
    CONV_TARGETS,
    CONV_TRANSPOSE_TARGETS,
    LINEAR_TARGETS,
    is_layer_call,
    is_unquantized_product,
    layer_name,
    parameter_of,
)

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
