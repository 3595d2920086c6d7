"""How Inductor compiles the ``lowprec::*`` operators: decompositions and lowerings.

Importing this module registers them in Inductor's tables. It imports Inductor,
so nothing imports it at ``import lpcompile``: the backend imports it, and
:func:`lpcompile.numerics.register_when_inductor_loads` imports it as soon as
Inductor itself is imported (a plain ``torch.compile`` of code that calls
``lpcompile.quantize`` fuses the operators as well).

* ``quantize``: lowered as one pointwise node (:func:`_lower_quantize`) that
  issues the rounding's and the generator's ops once each. Decomposed into ATen
  ops, every value read twice (``x ^ (x >> s)``, ``where(c, a, a)``) was
  re-traced once per read: an E5M2 rounding cost Inductor hundreds of op calls
  per kernel body, a stochastic one's key thousands, and compile time grew with
  them. A quantize with a given scale decomposes into an unscaled one between the
  multiply and the divide; a tiled one computes its scales first. A tensorwise,
  rowwise, MX, NVFP4 or blockwise one is lowered, its factors a reduction over the
  tensor, per row or per block of 32, 16 or 128 (the tensor viewed as blocks, padded;
  NVFP4's also one over the tensor): it stays one node in the joint graph, where the
  backend reads which tensor each matmul's operand rounds
  (:mod:`lpcompile.passes.joint.rowwise`).
* ``predict_weight``: its reference implementation, traced into Inductor's kernels.
* ``quantize_grad``, ``scale_grad``, ``count_grad``: the identity in the forward (their
  backward nodes come from autograd).
* ``realize``: computed once into a buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._inductor import decomposition, ir
from torch._inductor.decomposition import register_decomposition
from torch._inductor.lowering import lowerings, register_lowering, to_dtype
from torch._inductor.utils import sympy_product
from torch._inductor.virtualized import V, ops
from torch.utils._sympy.functions import CeilDiv

from lpcompile.numerics import predict, rng, scale_grad, tag_inductor_cache_keys  # noqa: F401  (scale_grad's ops)
from lpcompile.numerics.formats import parse_format
from lpcompile.numerics.quantize import (
    AMAX_FLOOR,
    BLOCK_SCALINGS,
    E4M3_MAX,
    E4M3_TINY,
    MX_MODES,
    TILED_SCALINGS,
    amax_factor,
    check_args,
    complex_of,
    dynamic_scale,
    is_rowwise,
    mx_factor,
    real_parts,
    round_value,
    scale_within,
)

aten = torch.ops.aten


@register_decomposition(torch.ops.lowprec.quantize.default)
def _decompose_quantize(x, fmt, rounding, overflow, seed, offset, scale, scaling="none"):
    if x.is_complex():  # Inductor lowers no complex values: the parts, rounded as floats
        parts = real_parts(x)
        return complex_of(
            torch.ops.lowprec.quantize(parts, fmt, rounding, overflow, seed, offset, scale, scaling), x
        )
    if scaling in TILED_SCALINGS:  # the reference's steps around an unscaled quantize
        target = check_args(x, fmt, rounding, overflow, scaling)
        scale = dynamic_scale(x, target, scaling)
        xf = scale_within(x.to(torch.float32), scale, target.max)
        rounded = torch.ops.lowprec.quantize(xf, fmt, rounding, overflow, seed, offset, None)
        return (rounded / scale).to(x.dtype)
    if scale is not None:
        xf = x.to(torch.float32) * scale
        rounded = torch.ops.lowprec.quantize(xf, fmt, rounding, overflow, seed, offset, None)
        return (rounded / scale).to(x.dtype)
    if seed is not None and seed.device != x.device:
        seed = seed.to(x.device)
        return torch.ops.lowprec.quantize(x, fmt, rounding, overflow, seed, offset, None, scaling)
    return NotImplemented  # lowered by _lower_quantize


@register_decomposition(torch.ops.lowprec.quantize_grad.default)
def _decompose_quantize_grad(x, fmt, rounding, overflow, seed, offset, scaling="none"):
    return x.clone()


@register_decomposition(torch.ops.lowprec.scale_grad.default)
def _decompose_scale_grad(x, scale, probe, stats, record=None):
    return x.clone()


@register_decomposition(torch.ops.lowprec.count_grad.default)
def _decompose_count_grad(x, probe, fmt, scaling="none"):
    return x.clone()


@register_decomposition(torch.ops.lowprec.predict_weight.default)
def _decompose_predict_weight(w, buf, lr, delay, mode):
    return predict.predict_weight_reference(w, buf, lr, delay, mode)


def _scalar_buffer(device: torch.device, inner_fn) -> ir.TensorBox:
    """A 0-dim int32 value computed once into its own buffer."""
    value = ir.Pointwise.create(device=device, dtype=torch.int32, inner_fn=inner_fn, ranges=[])
    value.realize()
    return value


def _seed_digest(seed: ir.TensorBox) -> ir.TensorBox:
    """The :func:`rng.seed_digest` of ``seed``, one buffer per seed and graph.

    Every stochastic site of a graph reads the same seed: its keys share this part,
    so each key costs one hash round instead of three.
    """
    digests = V.graph.__dict__.setdefault("_lowprec_seed_digests", {})
    name = seed.realize()
    if name not in digests:
        load_seed = seed.make_loader()
        digests[name] = _scalar_buffer(
            seed.get_device(), lambda index: rng.seed_digest(ops.to_dtype(load_seed([]), torch.int64), ops)
        )
    return digests[name]


def _stream_key(seed: ir.TensorBox, offset) -> ir.TensorBox:
    """The 0-dim int32 key of ``seed`` and ``offset`` (:func:`rng.key_value`), computed
    once into its own buffer."""
    load_digest = _seed_digest(seed).make_loader()

    def inner_fn(index):
        if isinstance(offset, int):
            low_bits = ops.constant(rng.to_int32(offset), torch.int32)
        else:  # symbolic (the direct API's compiled kernel): below 2**32, its low 32 bits
            sign = ops.constant(1 << 31, torch.int64)
            wide = ops.index_expr(offset, torch.int64)
            low_bits = ops.to_dtype(ops.sub(ops.bitwise_xor(wide, sign), sign), torch.int32)
        return rng.key_from_digest(load_digest([]), low_bits, ops)

    return _scalar_buffer(seed.get_device(), inner_fn)


@register_lowering(torch.ops.lowprec.quantize.default, type_promotion_kind=None)
def _lower_quantize(
    x: ir.TensorBox, fmt, rounding, overflow, seed, offset, scale, scaling="none"
) -> ir.TensorBox:
    """An unscaled, rowwise, tensorwise or block-scaled quantize as one pointwise node, each
    op of :func:`round_value` (and, for stochastic rounding, of the generator) issued once
    per kernel body; a rowwise or tensorwise one reads its rows' or the tensor's factor
    (:func:`_scales`), an MX, NVFP4 or blockwise one rounds ``x`` viewed as blocks
    (:func:`_in_blocks`). A tiled one decomposes first (:func:`_decompose_quantize`)."""
    if scale is not None or scaling in TILED_SCALINGS:
        raise NotImplementedError(
            "a scaled lowprec::quantize reached Inductor's lowering: Inductor's decomposition table"
            " lacks lpcompile.numerics.lowering's (see refresh_inductor_decompositions)"
        )
    dtype = x.get_dtype()
    target = check_args(torch.empty((), dtype=dtype, device="meta"), fmt, rounding, overflow)
    shape = list(x.get_size())
    load_key = None
    if rounding == "stochastic":
        if seed is None:
            raise ValueError("stochastic rounding needs a seed")
        numel = sympy_product(shape)
        rng.check_numel(V.graph.sizevars.optimization_hint(numel))
        V.graph.sizevars.check_lt(numel, 1 << 31)  # a dynamic size: guarded
        load_key = _stream_key(seed, offset).make_loader()
    strides = ir.FlexibleLayout.contiguous_strides(shape or [1])
    if V.graph.sizevars.statically_known_equals(sympy_product(shape), 0):
        scaling = "none"  # nothing to scale, and an empty reduction has no largest magnitude
    if scaling not in BLOCK_SCALINGS:
        load_scale = None if scaling == "none" else _scales(x, target, scaling)
        return _round(x, target, (rounding, overflow, load_key), load_scale, lambda index: index, strides)
    size = BLOCK_SCALINGS[scaling][0]
    blocks = _in_blocks(x, shape, size)
    if scaling in MX_MODES:
        mode = MX_MODES[scaling]
        load_factor = _block_factors(blocks, lambda amax: mx_factor(amax, target, mode, ops))
    elif scaling == "nvfp4":
        load_factor = _nvfp4_factors(blocks, target)
    elif scaling == "blockwise":
        load_factor = _block_factors(blocks, lambda amax: amax_factor(amax, target.max, ops))
    else:
        raise NotImplementedError(f"lowprec::quantize: no lowering of the block scaling {scaling!r}")

    def element(index):  # the element of x at an index of the blocks (past its end: padding)
        return [*index[:-2], index[-2] * size + index[-1]]

    def factor(index):
        return load_factor([*index[:-1], 0])

    return _out_of_blocks(
        _round(blocks, target, (rounding, overflow, load_key), factor, element, strides), shape
    )


def _round(x: ir.TensorBox, target, how: tuple, load_scale, element, strides) -> ir.TensorBox:
    """``x`` rounded onto ``target``'s grid (``how``: the rounding, the overflow and the
    random key's loader), times the factor ``load_scale`` gives at an index (if any) and
    divided back; its random bits indexed by the row-major position (``strides``: of the
    tensor rounded) of the element ``element`` maps an index to."""
    rounding, overflow, load_key = how
    dtype = x.get_dtype()
    load_x = x.make_loader()

    def inner_fn(index):
        xf = load_x(index)
        if dtype != torch.float32:
            xf = ops.to_dtype(xf, torch.float32)
        if load_scale is not None:  # scale_within's product and clamp
            scale = load_scale(index)
            largest = ops.constant(target.max, torch.float32)
            xf = ops.minimum(ops.maximum(ops.mul(xf, scale), ops.neg(largest)), largest)
        random = None
        if load_key is not None:  # element indices are row-major, whatever the layout
            row_major = sum((i * stride for i, stride in zip(element(index), strides, strict=False)), 0)
            random = rng.bits_from_index(ops.index_expr(row_major, torch.int32), load_key([]), ops)
        out = round_value(xf, target, rounding, overflow, random, ops)
        if load_scale is not None:
            out = ops.truediv(out, scale)
        return out if dtype == torch.float32 else ops.to_dtype(out, dtype)

    return ir.Pointwise.create(
        device=x.get_device(), dtype=dtype, inner_fn=inner_fn, ranges=list(x.get_size())
    )


def _scales(x: ir.TensorBox, target, scaling: str):
    """A loader, by ``x``'s index, of :func:`lpcompile.numerics.quantize.dynamic_scale`'s
    factor of that element's row (of the last dimension; of the whole tensor for a
    tensorwise ``scaling``), the factors computed once into a buffer."""
    shape = list(x.get_size())
    rows = is_rowwise(scaling) and shape
    magnitude = lowerings[aten.abs.default](to_dtype(x, torch.float32))
    dims = [-1] if rows else list(range(len(shape)))
    load_amax = lowerings[aten.amax.default](magnitude, dims, True).make_loader()

    def inner_fn(index):
        scale = amax_factor(load_amax(index), target.max, ops)
        if scaling.endswith("_pow2"):
            scale = ops.exp2(ops.floor(ops.log2(scale)))
        return scale

    size = [*shape[:-1], 1] if rows else [1] * len(shape)
    scales = ir.Pointwise.create(device=x.get_device(), dtype=torch.float32, inner_fn=inner_fn, ranges=size)
    scales.realize()
    load = scales.make_loader()
    if not rows:
        return lambda index: load([0] * len(index))
    return lambda index: load([*index[:-1], 0])


def _in_blocks(x: ir.TensorBox, shape: list, size: int) -> ir.TensorBox:
    """``x`` as (..., blocks, ``size``) along its last dimension, padded with zeros (a 0-dim
    ``x``: one block); a dynamic length stays symbolic, padded unless known a multiple."""
    length = shape[-1] if shape else 1
    if not shape:
        x = lowerings[aten.view.default](x, [1])
    blocks = CeilDiv(length, size)
    if not V.graph.sizevars.statically_known_multiple_of(length, size):
        x = lowerings[aten.constant_pad_nd.default](x, [0, blocks * size - length], 0.0)
    return lowerings[aten.view.default](x, [*shape[:-1], blocks, size])


def _block_factors(blocks: ir.TensorBox, factor_of: Callable) -> Callable:
    """A loader of ``factor_of`` each block's largest magnitude (the last dimension kept, as
    size 1), the factors computed once into a buffer."""
    magnitude = lowerings[aten.abs.default](to_dtype(blocks, torch.float32))
    load_amax = lowerings[aten.amax.default](magnitude, [-1], True).make_loader()
    factors = ir.Pointwise.create(
        device=blocks.get_device(),
        dtype=torch.float32,
        inner_fn=lambda index: factor_of(load_amax(index)),
        ranges=[*blocks.get_size()[:-1], 1],
    )
    factors.realize()
    return factors.make_loader()


def _nvfp4_factors(blocks: ir.TensorBox, target) -> Callable:
    """A loader of :func:`lpcompile.numerics.quantize.nvfp4_factors` of each block (the last
    dimension kept, as size 1), its operations in the same order, computed once into a
    buffer."""
    f32, f64 = torch.float32, torch.float64
    magnitude = lowerings[aten.abs.default](to_dtype(blocks, f32))
    dims = list(range(len(blocks.get_size())))
    load_tensor_amax = lowerings[aten.amax.default](magnitude, dims, False).make_loader()
    load_amax = lowerings[aten.amax.default](magnitude, [-1], True).make_loader()
    e4m3 = parse_format("e4m3")

    def divide(a, b):  # FP32's correctly rounded quotient on every device (Triton's is not)
        return ops.to_dtype(ops.truediv(ops.to_dtype(a, f64), ops.to_dtype(b, f64)), f32)

    def inner_fn(index):
        amax = ops.maximum(load_tensor_amax([]), ops.constant(AMAX_FLOOR, f32))
        tensor_scale = divide(amax, ops.constant(E4M3_MAX * target.max, f32))
        block_scale = divide(divide(load_amax(index), ops.constant(target.max, f32)), tensor_scale)
        block_scale = ops.minimum(
            ops.maximum(block_scale, ops.constant(E4M3_TINY, f32)), ops.constant(E4M3_MAX, f32)
        )
        block_scale = round_value(block_scale, e4m3, "nearest", "saturate", None, ops)
        return divide(divide(ops.constant(1.0, f32), tensor_scale), block_scale)

    factors = ir.Pointwise.create(
        device=blocks.get_device(), dtype=f32, inner_fn=inner_fn, ranges=[*blocks.get_size()[:-1], 1]
    )
    factors.realize()
    return factors.make_loader()


def _out_of_blocks(rounded: ir.TensorBox, shape: list) -> ir.TensorBox:
    """The rounded blocks in ``x``'s shape again, the padding left out. They are stored
    first: read through the view, Inductor splits the last dimension into blocks and drops a
    last block that is not whole."""
    rounded.realize()
    *outer, blocks, block = rounded.get_size()
    load = lowerings[aten.view.default](rounded, [*outer, blocks * block]).make_loader()
    ranges = shape or [1]
    out = ir.Pointwise.create(
        device=rounded.get_device(), dtype=rounded.get_dtype(), inner_fn=load, ranges=ranges
    )
    return out if shape else lowerings[aten.view.default](out, [])


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
    its Inductor compiles; it also puts lowprec's tag back into the cache keys.
    """
    if not decomposition.decompositions.keys() <= decomposition.select_decomp_table().keys():
        decomposition.fast_random_decomps.cache_clear()  # registered since the copy was made
    tag_inductor_cache_keys()  # (again, where a config patch or assignment dropped it)


refresh_inductor_decompositions()
