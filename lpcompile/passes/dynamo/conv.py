"""Small convolutions as im2col and a matmul, in Inductor's hands (Dynamo graph).

On small images oneDNN's fixed per-call cost dominates a convolution's time.
``im2col_conv2d`` writes such a convolution as ATen ops Inductor compiles: the
quantized input, padded, is stored once channels-last; one strided slice per tap,
stacked, makes the im2col matrix (output pixels x taps), or, for non-overlapping
patches (stride equal to the kernel), a permutation of the input; one matmul with
the weight gives the output (channels-last, copied to the contiguous layout ATen's convolution
returns where Inductor does not fuse that away). Autograd turns the matmul into the
weight-gradient matmul and the slices into sums of shifted windows (an input
gradient, where one is needed).

Which convolutions: those whose im2col matrix has at most :data:`MAX_IM2COL`
elements: larger ones, such as a 32x32 CNN's first and third, run faster on
oneDNN; and of those, kernels of at most :data:`MAX_TAPS` positions, or
non-overlapping patches of any size. The bf16 matmul kernel's ``MIN_MACS``
(``passes/joint/matmul.py``) keeps it off the GEMMs of the digits CNN's second
convolution, whose short sides make the kernel lose to MKL.

Not ``unfold`` views: their backward is an accumulating ``index_put``, which
Inductor 2.13 writes for the CPU as atomic adds, slow and, in a 2-D tiled loop,
wrong: the input gradient of a 1x1 convolution over 8 channels of 16x16 pixels
indexed past its buffer and corrupted the heap (``torch.compile`` alone
reproduces it).

``use_im2col_convs`` rewrites only quantized convolutions (both operands
come from ``lowprec::quantize``) in Inductor compiles for the CPU
(``conv="auto"``), so FP32 layers and the eager executor keep ATen's
convolution. The products of two FP8 values are exact in FP32; only the order
of the FP32 additions differs from oneDNN's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
import torch.nn.functional as F
from torch.nn.modules.utils import _pair

from lpcompile.passes.driver import CompileContext
from lpcompile.passes.graph import inline

CONV2D_TARGETS = (torch.conv2d, F.conv2d)
CONV2D_PARAMS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV2D_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
GEOMETRY = ("stride", "padding", "dilation")
QUANTIZE = torch.ops.lowprec.quantize.default
# Largest im2col matrix (output pixels x taps, in elements) rewritten: set between the digits
# CNN's convolutions, which gain, and a 32x32 CNN's larger ones, which lose (docs/design-notes.md).
MAX_IM2COL = 1 << 18
# Most taps (kernel positions) gathered one strided slice each: Inductor generates a loop
# per tap in the forward and a shifted window per tap in the backward, so the compile grows
# with them while the step gains no more (docs/fp8.md). Non-overlapping patches take no
# gather and have no such bound.
MAX_TAPS = 9
# Most taps gathered in one graph, fewest-tap convolutions first: each adds about a fifth
# of a second to a CPU compile, and a model of many small convolutions (diffusers' UNet:
# nineteen 3x3) doubled Inductor's. Set above the project's CNNs and HF ResNet (18 taps).
TAPS_PER_GRAPH = 24


def _is_patches(kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]) -> bool:
    """Non-overlapping patches: the stride equals the kernel, no dilation."""
    return stride == kernel and dilation == (1, 1)


def _pads(padding: str | int | tuple[int, ...], kernel: tuple[int, int], dilation: tuple[int, int]):
    """``F.pad``'s (left, right, top, bottom) for conv2d's ``padding``."""
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":  # stride 1; an odd total puts the extra pixel right/bottom, as ATen does
        (top, bottom), (left, right) = (
            (d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) for k, d in zip(kernel, dilation, strict=True)
        )
        return (left, right, top, bottom)
    ph, pw = _pair(padding)
    return (pw, pw, ph, ph)


def _out_size(size: int, pad: int, kernel: int, stride: int, dilation: int) -> int:
    """Output positions along one axis of ``size`` input positions, ``pad`` of padding in all."""
    return (size + pad - dilation * (kernel - 1) - 1) // stride + 1


def im2col_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    padding: str | int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    *,
    sizes: tuple[Sequence[int], Sequence[int]] | None = None,
) -> torch.Tensor:
    """``F.conv2d`` of a batch ``x`` (one group) as an im2col matrix times the weight.

    ``sizes``: those of ``x`` and ``weight``, where they are FX proxies (the pass inlines
    this function into the graph)."""
    (sh, sw), (dh, dw) = _pair(stride), _pair(dilation)
    (n, _, in_height, in_width), (out_channels, in_channels, kh, kw) = sizes or (x.shape, weight.shape)
    left, right, top, bottom = _pads(padding, (kh, kw), (dh, dw))
    # Stored once, channels-last: the gather below would otherwise recompute a
    # quantize per tap, and a tap's channels are then adjacent.
    padded = torch.ops.lowprec.realize(F.pad(x, (left, right, top, bottom)).permute(0, 2, 3, 1))
    height, width = in_height + top + bottom, in_width + left + right
    out_h, out_w = _out_size(height, 0, kh, sh, dh), _out_size(width, 0, kw, sw, dw)
    if _is_patches((kh, kw), (sh, sw), (dh, dw)):
        # Non-overlapping patches (a ViT's patch embedding): the im2col matrix is a
        # permutation of the (cropped) input, with no gather per tap.
        patches = padded[:, : out_h * kh, : out_w * kw].reshape(n, out_h, kh, out_w, kw, in_channels)
        im2col = patches.permute(0, 1, 3, 2, 4, 5).reshape(n * out_h * out_w, kh * kw * in_channels)
    else:
        # One strided slice per tap, (n, out_h, out_w, c); stacked into rows (n, out_h, out_w)
        # and columns (kh, kw, c), the order of the weight permuted to channels-last.
        rows, cols = sh * (out_h - 1) + 1, sw * (out_w - 1) + 1
        taps = [
            padded[:, i * dh : i * dh + rows : sh, j * dw : j * dw + cols : sw]
            for i in range(kh)
            for j in range(kw)
        ]
        im2col = torch.stack(taps, dim=3).reshape(n * out_h * out_w, kh * kw * in_channels)
    # A contiguous (taps x out_channels) operand: autograd computes the weight gradient in
    # the layout of this operand, and for a transposed view that is out_grad^T @ im2col,
    # a GEMM layout MKL runs several times slower than im2col^T @ out_grad.
    out = torch.mm(im2col, weight.permute(0, 2, 3, 1).reshape(out_channels, -1).t().contiguous())
    if bias is not None:
        out = out + bias
    # Contiguous as ATen's result is, so that user code may view it as it would that.
    return out.view(n, out_h, out_w, out_channels).permute(0, 3, 1, 2).contiguous()


def _conv2d_args(node: torch.fx.Node) -> dict[str, object] | None:
    """A conv2d call's arguments by name, or ``None`` for another call."""
    if node.op != "call_function" or node.target not in CONV2D_TARGETS:
        return None
    args = {**CONV2D_DEFAULTS, **dict(zip(CONV2D_PARAMS, node.args, strict=False)), **node.kwargs}
    return args if set(args) == set(CONV2D_PARAMS) else None


def _rewritable(args: dict[str, object]) -> bool:
    x, weight = args["input"], args["weight"]
    if not all(isinstance(v, torch.fx.Node) and v.target is QUANTIZE for v in (x, weight)):
        return False
    # insert_quantize gives its nodes the example value of the tensor they quantize
    example, w = x.meta.get("example_value"), weight.meta.get("example_value")
    if not isinstance(example, torch.Tensor) or not isinstance(w, torch.Tensor):
        return False
    if example.device.type != "cpu" or example.dim() != 4:
        return False
    if args["groups"] != 1 or any(isinstance(args[key], torch.fx.Node) for key in GEOMETRY):
        return False
    if not all(isinstance(size, int) for size in (*example.shape, *w.shape)):
        return False  # dynamic shapes: the size limit needs sizes
    (sh, sw), (dh, dw) = _pair(args["stride"]), _pair(args["dilation"])
    _, in_channels, kh, kw = w.shape
    if kh * kw > MAX_TAPS and not _is_patches((kh, kw), (sh, sw), (dh, dw)):
        return False
    left, right, top, bottom = _pads(args["padding"], (kh, kw), (dh, dw))
    rows = (
        example.shape[0]
        * _out_size(example.shape[2], top + bottom, kh, sh, dh)
        * _out_size(example.shape[3], left + right, kw, sw, dw)
    )
    return rows * in_channels * kh * kw <= MAX_IM2COL


def im2col_applies(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """A quantizing recipe with ``conv="auto"`` under Inductor, without pipelining (the
    pipeline's partitioner finds layers by their conv calls)."""
    config = ctx.config
    inductor = config.executor == "inductor" and config.codegen == "inductor"
    return config.quantizes and config.conv == "auto" and inductor and config.pipeline is None


def _taps(args: dict[str, object]) -> int:
    """The strided slices a rewritten convolution gathers: its kernel positions, or none
    for non-overlapping patches (1x1 convolutions of stride 1 among them)."""
    _, _, kh, kw = args["weight"].meta["example_value"].shape
    patches = _is_patches((kh, kw), _pair(args["stride"]), _pair(args["dilation"]))
    return 0 if patches else kh * kw


def use_im2col_convs(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Replace quantized CPU conv2d calls whose im2col matrix has at most
    :data:`MAX_IM2COL` elements by the ops of :func:`im2col_conv2d` (Inductor compiles
    without pipelining, ``conv="auto"``), fewest taps first, up to :data:`TAPS_PER_GRAPH`
    taps in the graph. Inlined, not called: AOT autograd caches only graphs of torch's own
    functions."""
    calls = [(node, args) for node in gm.graph.nodes if (args := _conv2d_args(node)) and _rewritable(args)]
    budget = TAPS_PER_GRAPH
    for node, args in sorted(calls, key=lambda call: _taps(call[1])):  # stable: graph order within a size
        budget -= _taps(args)
        if budget < 0:
            break
        x, weight = args["input"], args["weight"]
        sizes = (tuple(x.meta["example_value"].shape), tuple(weight.meta["example_value"].shape))
        operands = {"x": x, "weight": weight, "bias": args["bias"], "sizes": sizes}
        out = inline(gm, node, im2col_conv2d, {**operands, **{key: args[key] for key in GEOMETRY}})
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
