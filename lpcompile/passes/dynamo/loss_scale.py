"""``insert_loss_scale``: per-layer adaptive loss-scale nodes (Zhao, Vogel et al. 2019).

Runs on the Dynamo graph before ``insert_quantize``. For layer ``i`` (each
matmul/conv that the quantize pass keeps) it inserts ``lowprec::scale_grad``:

* on the output, with scale ``s_i`` and the histogram probe: in the backward
  the error entering the layer is measured, then multiplied by ``s_i`` before
  its quantize (which ``insert_quantize`` puts between the layer and this node);
* on every input (activation, weight, bias), with scale ``1/s_i`` (an input of
  its own, so compiled loops multiply rather than divide): the layer's
  input gradient and weight gradient leave it in true units, the weight
  gradient after its quantize. In a layer without a trained weight (e.g. a
  matmul of two activations) the smallest of these gradients also carries the
  inf/NaN probe: each is a product of the layer's quantized error, so an
  inf/NaN there shows in all of them (a linear layer's bias, which a scaled
  recipe adds after the error's rounding, is no candidate). A layer with a trained weight gets no
  probe: an inf/NaN in its error shows in that weight's gradient, which
  ``LossScaler`` checks anyway (the per-call count, fused into the backward's
  kernels, made the adaptive MLP's backward 3-5% slower).

How the calls that record get their statistics (:func:`recording_mode`):

* ``"cond"``: where Inductor compiles the graph (torch 2.13 on), the histogram
  nodes also read ``lowprec_record``, a 0-dim bool input on the CPU (on a GPU too,
  so that the branch waits on no device): the backward computes the statistics
  under ``torch.cond`` on the calls that record, so one compiled graph serves
  every call.
* ``"every call"``: in a piece of a graph that Dynamo's DDPOptimizer split at
  DDP's gradient buckets, one compiled graph computes the statistics at every
  call and the calls that do not record drop them. DDPOptimizer keeps one AOT
  graph per piece, and the ``torch.cond`` of a piece fails AOT autograd (Dynamo,
  compiling the branch inside the piece's trace, leaves its operand as a fake
  constant).
* ``"variant"``: elsewhere the calls that record run a second variant, in which
  the probe requires grad: graphs run as FX compile in seconds (and a
  ``TorchDispatchMode`` around them sees no ``torch.cond``), and the Triton codegen
  fuses the statistics into the kernels that quantize the errors.

``s_i`` is the paper's cumulative scale ``A_i`` (the rules and bounds are in
``lpcompile.numerics.scale_rules``). Unscaling at each layer's inputs, in FP32 and by
powers of two, is exact, so outside the layers every gradient is at unit
scale: parameters that are not matmul/conv weights (norms, biases) get true
gradients and branches merge at a common scale with no extra nodes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

from lpcompile.config import AdaptiveScaleConfig
from lpcompile.numerics.compat import INDUCTOR_COND_TAKES_SIZES, optimization_hint
from lpcompile.numerics.scale_grad import STATS_SIZE
from lpcompile.passes.driver import CompileContext
from lpcompile.passes.dynamo.quantize import (
    adds_bias_after,
    graph_input,
    is_float_value,
    layers_in_order,
    outermost,
)
from lpcompile.passes.graph import (
    CONV_TARGETS,
    CONV_TRANSPOSE_TARGETS,
    LINEAR_TARGETS,
    SCALE_GRAD,
    base_of,
    has_backward,
    is_function_call,
    layer_name,
    needs_grad,
    product_operands,
    product_output,
    weight_operand,
)

# Names of the graph inputs that insert_loss_scale adds.
SCALES_INPUT, HIST_INPUT, FLAGS_INPUT = "lowprec_scales", "lowprec_hist", "lowprec_flags"
INVERSES_INPUT, RECORD_INPUT = "lowprec_inverse_scales", "lowprec_record"
# AdaptiveLayout.recording: how the calls that record get their statistics (module docstring)
RECORD_UNDER_COND, RECORD_EVERY_CALL, RECORD_IN_VARIANT = "cond", "every call", "variant"


@dataclass(frozen=True)
class AdaptiveLayout:
    """What ``insert_loss_scale`` put into one graph: its layers, in graph order."""

    layers: tuple[str, ...]
    weight_inputs: tuple[int | None, ...]  # graph input index of each layer's weight
    fmt: str  # the error format
    config: AdaptiveScaleConfig
    out_dims: tuple[int, ...]  # the dimension of each weight that holds the output features
    groups: tuple[int, ...]  # each layer's convolution groups (1 for every other layer)
    recording: str = RECORD_IN_VARIANT  # RECORD_UNDER_COND, RECORD_EVERY_CALL or RECORD_IN_VARIANT


def _scale_grad(
    gm: torch.fx.GraphModule,
    value: torch.fx.Node,
    scale,
    probe,
    stats: str,
    layer: str,
    record=None,
    role=None,
) -> torch.fx.Node:
    """``lowprec::scale_grad`` of ``value``: its gradient times ``scale``, with the statistics
    ``stats`` (role: ``loss_scale`` where it measures the error, else ``loss_unscale``)."""
    args = (value, scale, probe, stats) if record is None else (value, scale, probe, stats, record)
    node = gm.graph.call_function(SCALE_GRAD, args)
    role = role or ("loss_scale" if stats == "histogram" else "loss_unscale")
    node.meta["lowprec"] = {"role": role, "layer": layer}
    if "example_value" in value.meta:
        node.meta["example_value"] = value.meta["example_value"]
    return node


def _numel(value) -> float:
    """Elements of ``value``: a size hint, which adds no guard on a dynamic batch size."""
    example = value.meta.get("example_value")
    return float(optimization_hint(example.numel())) if example is not None else float("inf")


def _out_dim(call: torch.fx.Node, weight: torch.fx.Node | None) -> int:
    """The dimension of a layer's weight parameter that holds its output features: 0 for
    linear and conv (out, in, ...), 1 for conv_transpose (in, out/groups, ...); for a
    matrix product of a 2-D parameter, its columns when it is the right operand (x @ W)
    and its rows when the left, swapped when the product reads it transposed."""
    if call.target in CONV_TRANSPOSE_TARGETS:
        return 1
    if weight is None or call.target in LINEAR_TARGETS | CONV_TARGETS:
        return 0
    operands = [call.args[i] for i in product_operands(call)]
    right = operands.index(weight) == len(operands) - 1
    return int(right != _transposes(weight))


def _groups(call: torch.fx.Node) -> int:
    """A convolution's ``groups`` (its weight's output features split among them: each
    input-gradient element sums one group's); 1 for a transposed convolution, whose weight
    holds one group's output features already, and for every other layer."""
    if call.target not in CONV_TARGETS:
        return 1
    groups = call.kwargs.get("groups", call.args[6] if len(call.args) > 6 else 1)
    return groups if isinstance(groups, int) else 1


def _nodes_in(arg: Any) -> list[torch.fx.Node]:
    """The graph nodes in a call's argument: itself, or those of a tuple or list."""
    nodes: list[torch.fx.Node] = []
    map_arg(arg, nodes.append)
    return nodes


def _replaced(arg: Any, old: torch.fx.Node, new: torch.fx.Node) -> Any:
    """A call's argument with ``new`` for ``old``: the node itself, or in a tuple or list."""
    return map_arg(arg, lambda node: new if node is old else node)


def _outputs(call: torch.fx.Node) -> list[torch.fx.Node]:
    """Where a layer's errors enter the backward: a product's output; a Function's float
    (and complex) outputs, in order."""
    if not is_function_call(call):
        return [output] if (output := product_output(call)) is not None else []
    items = [u for u in call.users if u.target is operator.getitem]
    items = [u for u in items if is_float_value(u.meta.get("example_value"))]
    return sorted(items, key=lambda item: item.args[1])


def _transposes(node: torch.fx.Node) -> bool:
    """Whether ``node`` reads its parameter transposed (an odd number of ``t``/``transpose``)."""
    flipped = False
    while node is not base_of(node):
        name = node.args[1] if node.target is getattr else node.target  # w.T is getattr(w, "T")
        if name in ("t", "T", "mT", "transpose", torch.t, torch.transpose):
            flipped = not flipped
        node = node.args[0]
    return flipped


def recording_mode(ctx: CompileContext) -> str:
    """How the calls that record get their statistics: every call in a piece of a split
    graph; under ``torch.cond`` where Inductor compiles the graph and lowers such a cond;
    else in a variant of their own."""
    if ctx.split_from is not None:
        return RECORD_EVERY_CALL
    if ctx.config.executor == "inductor" and ctx.config.codegen != "triton" and INDUCTOR_COND_TAKES_SIZES:
        return RECORD_UNDER_COND
    return RECORD_IN_VARIANT


def loss_scale_applies(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """``loss_scale="adaptive"``, in a graph with a backward (not one compiled under no_grad,
    but for an ``enable_grad`` block in it: :func:`has_backward`)."""
    return ctx.config.loss_scale == "adaptive" and has_backward(gm)


def insert_loss_scale(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Scale each layer's error by its own power of two; unscale its input gradients.

    Layers in activation-checkpoint bodies and ``torch.cond`` branches take part in their
    place in the model (the scales reach the bodies as inputs their calls pass in; a branch
    not taken leaves its layers' statistics empty).
    """
    calls = layers_in_order(gm, ctx)
    if not calls:
        return
    count = len(calls)
    placeholders = gm.graph.find_nodes(op="placeholder")
    recording = recording_mode(ctx)
    examples = {
        SCALES_INPUT: torch.ones(count),
        INVERSES_INPUT: torch.ones(count),
        HIST_INPUT: torch.zeros(count, STATS_SIZE),
        FLAGS_INPUT: torch.zeros(count),
        **({RECORD_INPUT: torch.tensor(False)} if recording == RECORD_UNDER_COND else {}),
    }
    for name, example in examples.items():  # the Dynamo graph's inputs first, in this order
        ctx.add_input(gm, name, example)
    layers, weight_inputs, out_dims, groups = [], [], [], []
    for i, (graph, call) in enumerate(calls):
        layer = layer_name(call)
        scales, inverses, hist, flags, *record = (
            graph_input(graph, ctx, name, e) for name, e in examples.items()
        )
        with graph.graph.inserting_before(call):
            scale = graph.graph.call_function(torch.select, (scales, 0, i))
            inverse = graph.graph.call_function(torch.select, (inverses, 0, i))
            hist_i = graph.graph.call_function(torch.select, (hist, 0, i))
            flag_i = graph.graph.call_function(torch.select, (flags, 0, i))
            # an input batch gets no unscale node, which would make the backward compute its
            # gradient only to count its inf/NaN
            # (FlexAttention's score_mod may read parameters, passed in a tuple)
            inputs = [
                (i, node) for i, arg in enumerate(call.args) for node in _nodes_in(arg) if needs_grad(node)
            ]
            if needs_grad(call.kwargs.get("bias")):
                inputs.append(("bias", call.kwargs["bias"]))
            # a Function's weight has no known layout: its layers scale by the quantile rule
            weight = None if is_function_call(call) else weight_operand(call)
            is_weight = weight is not None
            out_dims.append(_out_dim(call, weight))  # before the operands are wrapped below
            groups.append(_groups(call))
            trained = is_weight and needs_grad(weight)
            # (a bias added after the product reads the unrounded error)
            after = adds_bias_after(call, ctx.config)
            candidates = [arg for where, arg in inputs if not (after and where in (2, "bias"))]
            counted = None if trained else min(candidates, key=_numel, default=None)
            for where, arg in inputs:
                probe, stats = (flag_i, "nonfinite") if arg is counted else (None, "none")
                unscaled = _scale_grad(graph, arg, inverse, probe, stats, layer)
                if where == "bias":
                    call.update_kwarg("bias", unscaled)
                else:
                    call.update_arg(where, _replaced(call.args[where], arg, unscaled))
        for k, output in enumerate(_outputs(call)):  # a Function's all scaled, the first measured
            users = list(output.users)
            with graph.graph.inserting_after(output):
                if k == 0:
                    scaled = _scale_grad(graph, output, scale, hist_i, "histogram", layer, *record)
                else:
                    scaled = _scale_grad(graph, output, scale, None, "none", layer, role="loss_scale")
            for user in users:
                user.replace_input_with(output, scaled)
        layers.append(layer)
        weight_inputs.append(placeholders.index(outermost(graph, weight)) if is_weight else None)
    for body in {id(g): g for g, _ in calls if g is not gm}.values():
        body.graph.lint()
        body.recompile()
    ctx.adaptive = AdaptiveLayout(
        tuple(layers),
        tuple(weight_inputs),
        ctx.config.error.fmt,
        ctx.config.adaptive,
        tuple(out_dims),
        tuple(groups),
        recording,
    )
