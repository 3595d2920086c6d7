"""Layouts: clean-ups of the AOT graphs before Inductor compiles them, and the
choice of Inductor's channels-last layout for small CPU convolutions.

AOT autograd's partitioner saves a layer's quantized weight for the backward
as ``permute(permute(w_q))``: the transpose that ``linear`` reads, transposed
back. Inductor's own rule for such pairs runs on the joint graph, before the
partitioner makes this one, so the forward graph reaches Inductor with it.
There the pair is a view of a view of an unrealized pointwise node, and the
quantize's kernel writes two weight-sized buffers: one for the matmul, one for
the saved copy. ``remove_permute_pairs`` turns the pair back into ``w_q``, so
both read one buffer.

On CPU, Inductor runs every graph with a convolution channels-last (its
``layout_optimization``), converting activations in and out around the oneDNN
calls. For small images the conversions cost more than the layout gains.
With ``conv="auto"`` the digits CNN's convolutions are matmuls
(``lpcompile.passes.dynamo.conv``), so this serves the small-image convolutions
left to oneDNN (``conv="aten"``, FP32 layers, or above the im2col limit).
``prefers_contiguous_layout`` tells the backend to keep the default layout where
every convolution's input has at most :data:`SMALL_CONV_PIXELS` pixels.

Without that layout one convolution kernel still gains from channels-last: the
backward that computes the input gradient. oneDNN's backward-data kernel for
NCHW tensors reorders them into blocked layouts on every call; on NHWC ones it
runs directly. ``use_channels_last_conv_backward`` hands such a backward
channels-last copies of its error and input, which Inductor writes from the
kernels that produce them. The gradients the graph returns keep the layout they
were traced with: only the clones' and the backward's own metadata change, and
Inductor lays graph outputs out by theirs.

Inductor inlines a pointwise copy into every loop that reads it. For a copy that
transposes (a ``clone`` of a ``permute``) that is a strided read in each of those
loops, and a loop that also reads other tensors in the copy's layout may then be
vectorised badly. A small convolution written as a matmul (``passes/dynamo/conv.py``)
returns the NCHW copy of its channels-last product; the backward graph recomputes
that copy from the saved product, and GroupNorm's backward reads it in three loops
next to the NCHW error. Inductor 2.13 vectorised the last of them across the
groups, gathering scalars into vectors, and that loop dominated GroupNorm's
backward. ``realize_transposed_copies`` stores such copies once (``lowprec::realize``),
written by a tiled transpose, in the CPU backward graphs. Forward graphs keep
Inductor's choice: realizing their copies as well made the step no faster.
"""

from __future__ import annotations

import torch
import torch.fx
from torch._guards import detect_fake_mode

from lpcompile.numerics.compat import optimization_hint
from lpcompile.passes.driver import CompileContext
from lpcompile.passes.graph import CONV_TARGETS

PERMUTE = torch.ops.aten.permute.default
CONV_BACKWARD = torch.ops.aten.convolution_backward.default
CLONE = torch.ops.aten.clone.default
REALIZE = torch.ops.lowprec.realize.default
# Largest convolution input (pixels of one image) for which the default layout is kept: up to
# 16x16 channels-last cost time on this project's benchmark CNNs, at 32x32 it no longer clearly
# did (docs/design-notes.md).
SMALL_CONV_PIXELS = 16 * 16
SPATIAL_DIMS = {target: int(target.__name__[-2]) for target in CONV_TARGETS}  # conv2d -> 2


def prefers_contiguous_layout(gm: torch.fx.GraphModule) -> bool:
    """Whether a Dynamo graph's convolutions all run on CPU on inputs of at most
    :data:`SMALL_CONV_PIXELS` pixels (and there is at least one)."""
    convs = [
        (node.args[0].meta.get("example_value"), dims)
        for target, dims in SPATIAL_DIMS.items()
        for node in gm.graph.find_nodes(op="call_function", target=target)
        if isinstance(node.args[0], torch.fx.Node)
    ]
    if not convs or any(not isinstance(x, torch.Tensor) for x, _ in convs):
        return False
    return all(x.device.type == "cpu" and _pixels(x, dims) <= SMALL_CONV_PIXELS for x, dims in convs)


def _pixels(x: torch.Tensor, dims: int) -> float:
    """Pixels of one image of a convolution's input (batched or not): its last ``dims`` sizes."""
    count = 1.0
    for size in x.shape[-dims:]:
        count *= float(optimization_hint(size))  # a hint: no guard on a dynamic size
    return count


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


def use_channels_last_conv_backward(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Give each 2-D CPU convolution backward that computes an input gradient
    channels-last copies of its error and input, where the graph runs without
    Inductor's channels-last layout (``ctx.contiguous_layout``)."""
    if not ctx.contiguous_layout:
        return
    for node in list(gm.graph.find_nodes(op="call_function", target=CONV_BACKWARD)):
        error, x, transposed, mask = node.args[0], node.args[1], node.args[7], node.args[10]
        value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not (mask[0] and not transposed and isinstance(value, torch.Tensor)):
            continue
        if value.dim() != 4 or value.device.type != "cpu":
            continue
        fake_mode = detect_fake_mode([value])
        with gm.graph.inserting_before(node), fake_mode:
            for index, operand in ((0, error), (1, x)):
                copy = gm.graph.call_function(CLONE, (operand,), {"memory_format": torch.channels_last})
                copy.meta["val"] = operand.meta["val"].clone(memory_format=torch.channels_last)
                node.update_arg(index, copy)
            args = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args]
            node.meta["val"] = CONV_BACKWARD(*args)  # the gradients' strides follow the input's


def realize_transposed_copies(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Store each CPU copy of a permuted view that changes its strides once, rather
    than have Inductor inline it into every loop that reads it (backward graphs)."""
    for node in list(gm.graph.find_nodes(op="call_function", target=CLONE)):
        source = node.args[0]
        if not (isinstance(source, torch.fx.Node) and source.target is PERMUTE):
            continue
        before, after = source.meta.get("val"), node.meta.get("val")
        if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
            continue
        if after.device.type != "cpu" or before.stride() == after.stride():
            continue
        readers = list(node.users)
        with gm.graph.inserting_after(node):
            stored = gm.graph.call_function(REALIZE, (node,))
        stored.meta = dict(node.meta)
        for reader in readers:
            reader.replace_input_with(node, stored)
