"""How Inductor compiles the ``lowprec::*`` operators: decompositions and lowerings.

Importing this module registers them in Inductor's tables. It imports Inductor,
so nothing imports it at ``import lpcompile``: the backend imports it, and
:func:`lpcompile.numerics.register_when_inductor_loads` imports it as soon as
Inductor itself is imported (a plain ``torch.compile`` of code that calls
``lpcompile.quantize`` fuses the operators as well).

* ``quantize``, ``predict_weight``: their reference implementations, traced
  into Inductor's own kernels. Inside :func:`grid_marks` an unscaled quantize
  ends in ``lowprec::on_grid`` (the joint-graph passes read and remove it).
* ``quantize_grad``, ``scale_grad``: the identity in the forward (their
  backward nodes come from autograd).
* ``counter_bits``: a lowering of its own, see :func:`_lower_counter_bits`.
* ``on_grid``: nothing; ``realize``: computed once into a buffer.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch._inductor import decomposition, ir
from torch._inductor.decomposition import register_decomposition
from torch._inductor.lowering import register_lowering
from torch._inductor.utils import sympy_product
from torch._inductor.virtualized import V, ops

from lpcompile.numerics import predict, rng, scale_grad  # noqa: F401  (defines their operators)
from lpcompile.numerics.quantize import quantize_reference

# Set while the lowprec backend has Inductor compile its graphs: only there do the
# joint-graph passes read the marks and take them out again. A plain torch.compile
# that meets lowprec::quantize gets no marks.
_GRID_MARKS = contextvars.ContextVar("lowprec_grid_marks", default=False)


@contextlib.contextmanager
def grid_marks() -> Iterator[None]:
    """Inductor's decomposition of an unscaled quantize ends in ``lowprec::on_grid`` here."""
    token = _GRID_MARKS.set(True)
    try:
        yield
    finally:
        _GRID_MARKS.reset(token)


@register_decomposition(torch.ops.lowprec.quantize.default)
def _decompose_quantize(x, fmt, rounding, overflow, seed, offset, scale):
    out = quantize_reference(x, fmt, rounding, overflow, seed, offset, scale)
    # Unscaled, every value is on fmt's grid: lpcompile.passes.joint.matmul reads the mark.
    if scale is None and _GRID_MARKS.get():
        return torch.ops.lowprec.on_grid(out, fmt)
    return out


@register_decomposition(torch.ops.lowprec.quantize_grad.default)
def _decompose_quantize_grad(x, fmt, rounding, overflow, seed, offset):
    return x.clone()


@register_decomposition(torch.ops.lowprec.scale_grad.default)
def _decompose_scale_grad(x, scale, probe, stats):
    return x.clone()


@register_decomposition(torch.ops.lowprec.predict_weight.default)
def _decompose_predict_weight(w, buf, lr, delay, mode):
    return predict.predict_weight_reference(w, buf, lr, delay, mode)


@register_lowering(torch.ops.lowprec.counter_bits.default, type_promotion_kind=None)
def _lower_counter_bits(key: ir.TensorBox, shape: list) -> ir.TensorBox:
    """The hash as one Inductor pointwise node, each step's value built once.

    Decomposed into ATen ops, every xor-shift ``x ^ (x >> s)`` reads ``x``
    twice, and Inductor re-traces an inlined value once per read: 2^6 traces
    of the hash per kernel body, and stochastic rounding compiled several
    times slower than round-to-nearest. Here the ops are issued once, from
    ``MIX_STEPS``.
    """
    numel = sympy_product(shape)
    rng.check_numel(V.graph.sizevars.optimization_hint(numel))
    V.graph.sizevars.check_lt(numel, 1 << 31)  # a dynamic size: guarded
    key.realize()  # the 0-dim key: computed once, in its own kernel
    load_key = key.make_loader()
    strides = ir.FlexibleLayout.contiguous_strides(shape)

    def inner_fn(index):
        row_major = sum((i * stride for i, stride in zip(index, strides, strict=True)), 0)
        k = load_key([])
        mixed = rng.mix_ops(ops.bitwise_xor(ops.index_expr(row_major, torch.int32), k), ops)
        return rng.mix_ops(ops.add(mixed, k), ops)

    return ir.Pointwise.create(
        device=key.get_device(), dtype=torch.int32, inner_fn=inner_fn, ranges=list(shape)
    )


@register_lowering(torch.ops.lowprec.on_grid.default, type_promotion_kind=None)
def _lower_on_grid(x: ir.TensorBox, fmt: str) -> ir.TensorBox:
    return x  # a mark the joint-graph passes did not remove costs nothing


@register_lowering(torch.ops.lowprec.realize.default, type_promotion_kind=None)
def _lower_realize(x: ir.TensorBox) -> ir.TensorBox:
    x.realize()
    return x


def refresh_inductor_decompositions() -> None:
    """Make Inductor's decomposition table hold lowprec's decompositions.

    Inductor copies its table once per process, at its first compile
    (``fast_random_decomps``, cached). A copy made before this module was
    imported (a plain ``torch.compile`` first, then ``backend="lowprec"``
    through the entry point) lacks them: Inductor would call the reference
    operators instead of fusing them (the same numbers, several times slower),
    and its cache would keep that graph. The backend runs this before each of
    its Inductor compiles.
    """
    if not decomposition.decompositions.keys() <= decomposition.select_decomp_table().keys():
        decomposition.fast_random_decomps.cache_clear()  # registered since the copy was made


refresh_inductor_decompositions()
