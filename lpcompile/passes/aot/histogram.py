"""Histograms as one ``bincount`` call instead of Inductor's scatter-add.

``gradient_stats`` counts each error's binary exponents with
``index_add(zeros(256), 0, bins, ones)``, which Inductor's decompositions turn
into ``index_put(full(0), [bins], full(1), accumulate=True)`` and lower to a
loop of atomic adds into 256 shared bins. On CPU the threads contend for them,
which makes a recording backward much slower than a plain one.
``count_histograms_serially`` hands the bins to ``lowprec::count_bins``
(``torch.bincount``: one pass, no atomics) instead; the counts are the same
integers. On a GPU, where the atomic adds pile onto the few bins that hold most
errors, ``count_bins`` runs CUDA's ``histc``, which counts in each block's shared
memory first. The Triton codegen keeps the ``index_add`` form, which it fuses into
its kernels.
"""

from __future__ import annotations

import torch
import torch.fx

import lpcompile.numerics.scale_grad  # noqa: F401  (registers lowprec::count_bins)
from lpcompile.passes.driver import CompileContext
from lpcompile.passes.graph import INDEX_CASTS, RESHAPES

aten = torch.ops.aten
FULLS = (aten.full.default, aten.full_like.default)


def _is_full(node: object, value: float) -> bool:
    return isinstance(node, torch.fx.Node) and node.target in FULLS and node.args[1] == value


def _histogram_bins(node: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """``(bins, K)`` if ``node`` is ``index_put(full([K], 0), [bins], full(1), accumulate=True)``
    of FP32 counts, with ``bins`` traced back through reshapes and casts to its integer
    source, ``x & (K - 1)`` (so every bin is in range: ``index_put`` would wrap a negative
    index, ``bincount`` refuses it)."""
    base, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    out = node.meta.get("val")
    if not (accumulate and _is_full(base, 0) and _is_full(values, 1) and len(indices) == 1):
        return None
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 1:
        return None
    bins = indices[0]
    if not isinstance(bins, torch.fx.Node) or bins.meta["val"].numel() != values.meta["val"].numel():
        return None
    while bins.target in RESHAPES | INDEX_CASTS and not bins.args[0].meta["val"].dtype.is_floating_point:
        bins = bins.args[0]
    size = int(out.shape[0])
    if bins.target != aten.bitwise_and.Scalar or bins.args[1] != size - 1 or size & (size - 1):
        return None
    return bins, size


def annotate_cond_operands(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Give each ``torch.cond`` branch input that receives a plain number that number as its
    value. AOT autograd's trace of the statistics' branches lifts a size of the error as
    such an input, which neither branch reads, without a value; Inductor's fake-tensor
    update after its post-grad passes compares every branch input with what the call
    passes, and stops at the missing one."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.cond):
        _, *branches, operands = node.args
        for branch in branches:
            placeholders = getattr(gm, branch.target).graph.find_nodes(op="placeholder")
            for placeholder, operand in zip(placeholders, operands, strict=True):
                if not isinstance(operand, torch.fx.Node):
                    placeholder.meta.setdefault("val", operand)


def count_histograms_serially(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Replace each accumulating ``index_put`` histogram by ``lowprec::count_bins``, in the
    graph and in its subgraphs (the ``torch.cond`` branches that compute statistics)."""
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            _count_serially(module)
            if module is not gm:
                module.graph.lint()
                module.recompile()


def _count_serially(gm: torch.fx.GraphModule) -> None:
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.index_put.default)):
        found = _histogram_bins(node)
        if found is None:
            continue
        with gm.graph.inserting_before(node):
            counts = gm.graph.call_function(torch.ops.lowprec.count_bins.default, found)
        counts.meta["val"] = node.meta["val"]
        inputs = node.all_input_nodes
        node.replace_all_uses_with(counts)
        gm.graph.erase_node(node)
        for value in inputs:  # the zeros and ones, if nothing else reads them
            if not value.users and value.target in FULLS:
                gm.graph.erase_node(value)
