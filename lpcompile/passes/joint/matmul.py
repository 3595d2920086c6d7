"""Matmuls of quantized tensors on the CPU's bfloat16 dot products (joint graph).

Every E5M2 or E4M3 value is a bfloat16 value, and the product of two is exact
in FP32. So a matmul whose two operands were both just quantized to such a
format can run on AVX512-BF16 instructions (``lowprec::mm_bf16``, ``bmm_bf16``) with FP32
accumulation and give what an FP32 GEMM gives, up to the order of the FP32
additions, and faster: each such instruction does twice the multiply-adds of an FP32 FMA.

A ``lowprec::quantize`` stays one node of the joint graph (Inductor lowers it,
:mod:`lpcompile.numerics.lowering`), but a tiled one or one with a given scale, which
decomposes. ``use_bf16_matmuls`` follows each ``mm``/``addmm``/``bmm`` operand back
through views to an unscaled quantize, which names the format: a scaled operand is no
FP8 value.
"""

from __future__ import annotations

import torch
import torch.fx

from lpcompile.config import LowPrecConfig
from lpcompile.kernels.cpu import gemm as cpu_gemm
from lpcompile.numerics.compat import optimization_hint
from lpcompile.numerics.formats import FloatFormat, parse_format
from lpcompile.numerics.quantize import scale_arguments
from lpcompile.passes.driver import CompileContext

aten = torch.ops.aten
QUANTIZE = torch.ops.lowprec.quantize.default
# What each matmul becomes when both operands qualify.
KERNELS = {
    aten.mm.default: torch.ops.lowprec.mm_bf16.default,
    aten.addmm.default: torch.ops.lowprec.mm_bf16.default,
    aten.bmm.default: torch.ops.lowprec.bmm_bf16.default,
}
# Ops whose output holds exactly their input's values.
VALUE_PRESERVING = frozenset(
    {
        aten.permute.default,
        aten.t.default,
        aten.transpose.int,
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.expand.default,
        aten.clone.default,
        aten.alias.default,
        aten.squeeze.dim,
        aten.unsqueeze.default,
    }
)
# Below this many multiply-adds (a bmm's batch included) ATen's FP32 GEMM wins in a training
# step, and GEMMs with a short side, such as the digits CNN's im2col convolutions
# (passes/dynamo/conv.py), lose more. Set where the kernel stopped losing on this project's
# benchmark shapes; see docs/design-notes.md.
MIN_MACS = 1 << 23
# A bmm also needs this many per matrix: below it the kernel's padding of each
# matrix to 8x32 blocks loses to ATen's bmm. Set at twice the measured break-even.
MIN_MACS_PER_MATRIX = 1 << 17


def exact_in_bf16_products(fmt: FloatFormat) -> bool:
    """Every value of ``fmt`` is a bfloat16 value, and every product of two (and any
    sum of those) is zero or a normal FP32 number: the dot-product instructions
    flush subnormal inputs and results to zero."""
    return fmt.fits_in(torch.bfloat16) and fmt.min_subnormal >= 2.0**-63


def grid_of(node: object) -> FloatFormat | None:
    """The format whose grid ``node``'s values lie on, following value-preserving ops."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is QUANTIZE:
            scale, scaling = scale_arguments(node.args, node.kwargs)
            return None if scale is not None or scaling != "none" else parse_format(node.args[1])
        if node.target not in VALUE_PRESERVING:
            return None
        node = node.args[0]
    return None


def _fp32_cpu(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32 and val.device.type == "cpu"


def _worth_it(node: torch.fx.Node) -> bool:
    a, b = node.args[-2].meta["val"].shape, node.args[-1].meta["val"].shape
    m, k, n = (optimization_hint(size, 0) for size in (*a[-2:], b[-1]))
    batch = optimization_hint(a[0], 0) if len(a) == 3 else 1
    return batch * m * k * n >= MIN_MACS and m * k * n >= (MIN_MACS_PER_MATRIX if len(a) == 3 else 0)


def _rewritable(node: torch.fx.Node) -> bool:
    if any(node.kwargs.get(scalar, 1) != 1 for scalar in ("beta", "alpha")):  # addmm's
        return False
    a, b = node.args[-2:]
    for operand in (a, b):
        fmt = grid_of(operand)
        if fmt is None or not exact_in_bf16_products(fmt) or not _fp32_cpu(operand):
            return False
    return _worth_it(node)


def uses_bf16_kernel(config: LowPrecConfig, on_cpu: bool) -> bool:
    """Whether quantized matmuls of a graph with tensors on the CPU (``on_cpu``) may run on
    the bf16 kernel (``mm_bf16``, ``bmm_bf16``) here. The kernel is built only when asked
    of a CPU graph: a GPU graph's compile never waits for it."""
    return on_cpu and config.matmul != "fp32" and cpu_gemm.unavailable() is None


def has_cpu_matmuls(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` has a matmul the bf16 kernel could take (FP32 operands on the CPU)."""
    nodes = (node for target in KERNELS for node in gm.graph.find_nodes(op="call_function", target=target))
    return any(_fp32_cpu(operand) for node in nodes for operand in node.args[-2:])


def use_bf16_matmuls(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Run ``mm``/``addmm``/``bmm`` of two quantized FP32 CPU operands on the bf16 kernel.

    Only with ``matmul="auto"`` (when the kernel is available here) or ``"bf16"``;
    ``addmm(bias, a, b)`` becomes ``mm_bf16(a, b) + bias``.
    """
    graph = gm.graph
    for target, kernel in KERNELS.items():
        for node in list(graph.find_nodes(op="call_function", target=target)):
            if not _rewritable(node):
                continue
            with graph.inserting_before(node):
                product = graph.call_function(kernel, tuple(node.args[-2:]))
                product.meta = dict(node.meta)
                result = product
                if target is aten.addmm.default:
                    result = graph.call_function(aten.add.Tensor, (product, node.args[0]))
                    result.meta = dict(node.meta)
            node.replace_all_uses_with(result)
            graph.erase_node(node)
