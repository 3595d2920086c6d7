"""The quantize operators and their reference implementations.

* ``lowprec::quantize(x, fmt, rounding, overflow, seed, offset, scale, scaling)``:
  round ``x`` (times ``scale``, or times the factor ``scaling`` computes from ``x``
  itself) onto the grid of ``fmt``, return it (divided by that factor) in ``x``'s
  dtype. Straight-through gradient.
* ``lowprec::quantize_grad(x, fmt, rounding, overflow, seed, offset, scaling)``: the
  identity in the forward; its gradient is ``quantize`` of the incoming
  gradient. This is how errors and weight gradients get quantize nodes in the
  backward graph: autograd places them.
* ``lowprec::realize(x)``: the identity, whose Inductor lowering stores ``x``
  in a buffer rather than recomputing it wherever it is read
  (``lpcompile.passes.dynamo.conv``, ``lpcompile.passes.aot.layout``).

The rounding works on the FP32 bit pattern, in 32-bit integers, and is written
once against Inductor's ops-handler names (:func:`round_bits`, with
:class:`lpcompile.numerics.rng.TorchOps`): run on torch tensors it is the
reference implementation (the eager kernel, and the oracle the generated Triton
is tested against); run by Inductor it is the operator's lowering
(:mod:`lpcompile.numerics.lowering`).
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
import sys
from collections.abc import Callable

import torch
import torch.fx

from lpcompile.numerics import rng
from lpcompile.numerics.checks import check_fp32_scale, is_real
from lpcompile.numerics.formats import FloatFormat, parse_format

ROUNDINGS = ("nearest", "stochastic")
OVERFLOWS = ("saturate", "inf")
# "none": values rounded as they are; "tensorwise": each tensor times the factor that takes
# its largest magnitude to the format's largest value (torchao float8's dynamic scaling,
# TransformerEngine's current scaling); "rowwise": a factor per row of the last dimension
# (torchao's axiswise scaling: the backend rounds each matmul operand along the dimension
# that matmul sums over, passes/joint/rowwise.py); "_pow2": the factors rounded down to
# powers of two; "mx": OCP microscaling, a power-of-two factor per block of MX_BLOCK values
# along the last dimension (along the summed dimension, as rowwise), "mx_ceil" and
# "mx_rceil" the same with the scale rounded up, "mx_even" with the block's largest
# magnitude first rounded to the element format's precision (MX_MODES); "nvfp4": NVIDIA's two-level
# scaling, an E4M3 factor per block of NVFP4_BLOCK values under an FP32 one per tensor;
# "nvfp4_2d" the same per tile of NVFP4_BLOCK x NVFP4_BLOCK values of the last two
# dimensions (NVIDIA's weights: one rounding that every matmul reading it sums alike);
# "blockwise" a tensorwise factor per block of BLOCKWISE_BLOCK values along the last
# dimension, "blockwise_2d" per tile of BLOCKWISE_BLOCK x BLOCKWISE_BLOCK values
# (DeepSeek-V3's FP8 training, torchao's blockwise_fp8_training).
SCALINGS = (
    "none",
    "tensorwise",
    "tensorwise_pow2",
    "rowwise",
    "rowwise_pow2",
    "mx",
    "mx_ceil",
    "mx_rceil",
    "mx_even",
    "nvfp4",
    "nvfp4_2d",
    "blockwise",
    "blockwise_2d",
)
# MX scalings -> how the block's scale is computed (torchao's ScaleCalculationMode)
MX_MODES = {"mx": "floor", "mx_ceil": "ceil", "mx_rceil": "rceil", "mx_even": "even"}
MX_BLOCK = 32
NVFP4_BLOCK = 16
BLOCKWISE_BLOCK = 128
# NVFP4's block scales are E4M3 values, at least its smallest normal one
E4M3_MAX, E4M3_TINY = torch.finfo(torch.float8_e4m3fn).max, torch.finfo(torch.float8_e4m3fn).tiny
# block scalings -> (values per block, the per-tensor scaling that stands in for them
# where a product is no matmul)
BLOCK_SCALINGS = {
    **{mx: (MX_BLOCK, "tensorwise_pow2") for mx in MX_MODES},
    "nvfp4": (NVFP4_BLOCK, "tensorwise"),
    "blockwise": (BLOCKWISE_BLOCK, "tensorwise"),
}
# scalings with a factor per square tile of the last two dimensions (NVFP4_BLOCK or
# BLOCKWISE_BLOCK values a side; "tensorwise" where a product is no matmul)
TILED_SCALINGS = frozenset({"nvfp4_2d", "blockwise_2d"})
# The smallest largest-magnitude a factor is computed from (torchao's): an all-zero or
# nearly zero tensor is not blown up to the format's range.
AMAX_FLOOR = 1e-12
FP32_MAX = torch.finfo(torch.float32).max
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_EXP_MASK = 0x7F800000
_ABS_MASK = 0x7FFFFFFF
_NAN_BITS = 0x7FC00000


@functools.cache
def _format(name: str) -> FloatFormat:
    return parse_format(name)


def _f32_bits(value: float) -> int:
    return torch.tensor(value, dtype=torch.float32).view(torch.int32).item()


def check_args(x: torch.Tensor, fmt: str, rounding: str, overflow: str, scaling: str = "none") -> FloatFormat:
    """Validate the arguments of a quantize call; return the parsed format."""
    target = _format(fmt)
    if part_dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"lowprec.quantize takes float32, float16 or bfloat16 tensors (or complex ones of those"
            f" parts), got {x.dtype}"
        )
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if overflow not in OVERFLOWS:
        raise ValueError(f"overflow must be one of {OVERFLOWS}, got {overflow!r}")
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if not target.fits_in(part_dtype(x.dtype)):
        raise ValueError(f"format {target.name} has values that {x.dtype} cannot hold exactly")
    return target


def part_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a complex ``dtype``'s real and imaginary parts; a real one itself."""
    return dtype.to_real() if dtype.is_complex else dtype


def real_parts(x: torch.Tensor) -> torch.Tensor:
    """A complex ``x``'s real and imaginary parts, interleaved along its last dimension
    (twice as long; a 0-dim ``x``: its two parts): what lowprec rounds of it."""
    parts = torch.view_as_real(x.resolve_conj())
    return parts.reshape(*x.shape[:-1], 2 * x.shape[-1]) if x.dim() else parts


def complex_of(parts: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The complex tensor of ``like``'s shape whose parts :func:`real_parts` gave."""
    return torch.view_as_complex(parts.reshape(*like.shape, 2).contiguous())


def exact_power_steps(exponent: int) -> list[int]:
    """Split ``2**exponent`` into factors that FP32 holds (exponents ≤ 127)."""
    steps = []
    while exponent > 127:
        steps.append(127)
        exponent -= 127
    return [*steps, exponent]


def round_bits(bits, fmt: FloatFormat, rounding: str, overflow: str, random, ops=rng.TorchOps):
    """Round FP32 bit patterns (int32) onto ``fmt``'s grid; return the bit
    patterns of the rounded magnitudes (sign bit clear). In ``ops``' terms
    (:class:`lpcompile.numerics.rng.TorchOps`, or Inductor's ops handler).

    Normal range: add a rounding increment below the kept mantissa bits and
    truncate (the carry moves into the exponent by itself). Below the smallest
    normal of ``fmt`` the grid spacing is constant, 2**(min_exp - man_bits):
    nearest-even rounds with one FP32 add and subtract of a constant whose
    ulp is that spacing; stochastic rounding compares the fraction of a
    spacing with 24 random bits.
    """
    i32, f32 = torch.int32, torch.float32

    def bits_const(value: int):
        return ops.constant(value, i32)

    def float_const(value: float):
        return ops.constant(value, f32)

    drop = 23 - fmt.man_bits
    mag = ops.bitwise_and(bits, bits_const(_ABS_MASK))
    if drop == 0:
        out = mag
    else:
        low = (1 << drop) - 1
        if rounding == "nearest":
            odd = ops.bitwise_and(ops.bitwise_right_shift(mag, bits_const(drop)), bits_const(1))
            inc = ops.add(odd, bits_const((1 << (drop - 1)) - 1))
        else:
            inc = ops.bitwise_and(ops.bitwise_right_shift(random, bits_const(32 - drop)), bits_const(low))
        out = ops.bitwise_and(ops.add(mag, inc), bits_const(~low))
    if fmt.min_exp > -126:  # fmt's subnormals are FP32 normals: constant spacing there
        absx = ops.to_dtype_bitcast(mag, f32, i32)
        spacing_exp = fmt.min_exp - fmt.man_bits
        if rounding == "nearest":
            magic = float_const(2.0 ** (spacing_exp + 23))
            sub = ops.sub(ops.add(absx, magic), magic)
        else:
            units = absx
            for step in exact_power_steps(-spacing_exp):
                units = ops.mul(units, float_const(2.0**step))
            whole = ops.floor(units)
            uniform = ops.bitwise_and(ops.bitwise_right_shift(random, bits_const(8)), bits_const(0xFFFFFF))
            threshold = ops.mul(ops.to_dtype(uniform, f32), float_const(2.0**-24))
            up = ops.gt(ops.sub(units, whole), threshold)
            sub = ops.mul(ops.add(whole, ops.to_dtype(up, f32)), float_const(2.0**spacing_exp))
        tiny = ops.lt(mag, bits_const((fmt.min_exp + 127) << 23))
        out = ops.where(tiny, ops.to_dtype_bitcast(sub, i32, f32), out)
    max_bits = _f32_bits(fmt.max)
    if overflow == "saturate" or not (fmt.has_inf or fmt.has_nan):
        over_bits = max_bits
    else:
        over_bits = _EXP_MASK if fmt.has_inf else _NAN_BITS
    # Finite overflow and infinite inputs alike go to over_bits; NaN stays NaN.
    out = ops.where(ops.gt(out, bits_const(max_bits)), bits_const(over_bits), out)
    return ops.where(ops.gt(mag, bits_const(_EXP_MASK)), bits_const(_NAN_BITS), out)


def round_value(xf, fmt: FloatFormat, rounding: str, overflow: str, random, ops=rng.TorchOps):
    """``xf`` (FP32) rounded onto ``fmt``'s grid, in FP32, its sign put back with
    ``copysign``; in ``ops``' terms (see :func:`round_bits`)."""
    i32, f32 = torch.int32, torch.float32
    mag = round_bits(ops.to_dtype_bitcast(xf, i32, f32), fmt, rounding, overflow, random, ops)
    return ops.copysign(ops.to_dtype_bitcast(mag, f32, i32), xf)


def is_rowwise(scaling: str) -> bool:
    """Whether ``scaling`` gives each row of the last dimension (or each block of a row)
    factors of its own: ``"rowwise"``, ``"rowwise_pow2"``, the block scalings of
    :data:`BLOCK_SCALINGS` (MX, ``"nvfp4"``, ``"blockwise"``)."""
    return scaling.startswith("rowwise") or scaling in BLOCK_SCALINGS


def reads_whole_tensor(scaling: str) -> bool:
    """Whether ``scaling``'s factors depend on the whole tensor's largest magnitude (a
    vmapped tensor's slices each get their own)."""
    return scaling.startswith("tensorwise") or scaling.startswith("nvfp4")


def is_tiled(scaling: str) -> bool:
    """Whether ``scaling`` gives each tile of the last two dimensions factors of its own
    (:data:`TILED_SCALINGS`): one rounding for the matmuls that sum over either dimension."""
    return scaling in TILED_SCALINGS


def per_tensor(scaling: str) -> str:
    """The tensorwise counterpart of ``scaling`` (itself if it is neither rowwise nor
    tiled; a block scaling's from :data:`BLOCK_SCALINGS`: MX's power-of-two factors give
    ``"tensorwise_pow2"``, NVFP4's and blockwise's ``"tensorwise"``, and so do tiles)."""
    if scaling in BLOCK_SCALINGS:
        return BLOCK_SCALINGS[scaling][1]
    if is_tiled(scaling):
        return "tensorwise"
    return scaling.replace("rowwise", "tensorwise")


def divides_back_exactly(scaling: str) -> bool:
    """Whether values rounded with ``scaling``'s factors and divided back by them are the
    format's values times powers of two (no scaling, the ``_pow2`` and MX scalings): a
    float16 or bfloat16 tensor holds them as they are."""
    return scaling == "none" or scaling.endswith("_pow2") or scaling in MX_MODES


def mx_factor(amax, target: FloatFormat, mode: str = "floor", ops=rng.TorchOps):
    """The factor (one over the E8M0 scale) of an MX block whose largest magnitude is
    ``amax`` (FP32), for the element format ``target`` (its largest value ``largest``), as
    torchao's scale calculation ``mode`` computes it: ``"floor"`` (the OCP MX spec's) the
    scale ``2^(floor(log2(amax)) - max_exp)`` (``max_exp``: the exponent of ``largest``),
    ``"ceil"`` ``2^(ceil(log2(amax)) - max_exp)``, ``"even"`` ``"floor"``'s of ``amax``
    rounded to ``target``'s mantissa bits first (half a step up), so that a block whose
    largest value rounds up to the next power of two takes the next scale, all at least
    2^-126; ``"rceil"`` (cuBLAS's and TransformerEngine's) ``2^ceil(log2(amax /
    largest))``, the quotient rounded to FP32 and its exponent clamped to [-127, 127], a
    quotient of at most 2^-127 (an all-zero block) giving the factor 1. NaN for an
    infinite or NaN ``amax``. Read off exponent bits, in ``ops``' terms (see
    :func:`round_bits`)."""
    i32, f32 = torch.int32, torch.float32

    def const(value: int):
        return ops.constant(value, i32)

    def exponent_and_rest(value):  # the biased exponent, and whether any mantissa bit is set
        bits = ops.to_dtype_bitcast(value, i32, f32)
        exponent = ops.bitwise_and(ops.bitwise_right_shift(bits, const(23)), const(0xFF))
        return exponent, ops.bitwise_and(bits, const(0x7FFFFF))

    def power(biased):  # 2^(127 - biased), for biased in [1, 253]
        return ops.to_dtype_bitcast(ops.mul(ops.sub(const(254), biased), const(1 << 23)), f32, i32)

    largest = target.max
    if mode == "rceil":
        # FP32's correctly rounded quotient, through float64, on every device (not Triton's)
        f64 = torch.float64
        quotient = ops.to_dtype(ops.truediv(ops.to_dtype(amax, f64), ops.constant(largest, f64)), f32)
        exponent, mantissa = exponent_and_rest(quotient)
        # ceil(log2) of a subnormal quotient clamps to -127, or is -126 above 2^-127
        subnormal = ops.to_dtype(ops.gt(mantissa, const(1 << 22)), i32)
        biased = ops.add(exponent, ops.to_dtype(ops.gt(mantissa, const(0)), i32))
        biased = ops.where(ops.lt(exponent, const(1)), subnormal, biased)
        factor = ops.where(ops.lt(biased, const(1)), ops.constant(1.0, f32), power(biased))
    else:
        exponent, mantissa = exponent_and_rest(amax)
        powered = exponent  # the biased exponent of the power of two the scale is taken from
        if mode == "even" and target.man_bits < 23:  # (inf and NaN capped: the sum stays below 2^31)
            bits = ops.minimum(ops.to_dtype_bitcast(amax, i32, f32), const(0x7F800000))
            rounded = ops.add(bits, const(1 << (22 - target.man_bits)))
            powered = ops.bitwise_and(ops.bitwise_right_shift(rounded, const(23)), const(0xFF))
        biased = ops.sub(powered, const(math.frexp(largest)[1] - 1))  # the scale's biased exponent
        if mode == "ceil":
            biased = ops.add(biased, ops.to_dtype(ops.gt(mantissa, const(0)), i32))
        factor = power(ops.where(ops.lt(biased, const(1)), const(1), biased))
    return ops.where(ops.gt(exponent, const(254)), ops.constant(float("nan"), f32), factor)


def _rank(x: torch.Tensor | torch.fx.Proxy) -> int:
    """``x.dim()``; of a proxy, that of the value it traces (a pass writes the factors of
    :func:`dynamic_scale` into a graph), or 1 where the node holds none."""
    if not isinstance(x, torch.fx.Proxy):
        return x.dim()
    example = x.node.meta.get("example_value")
    return example.dim() if isinstance(example, torch.Tensor) else 1


def _block_amax(magnitude: torch.Tensor, block: int) -> torch.Tensor:
    """The largest of each block of ``block`` values along the last dimension of
    ``magnitude`` (at least 1-dim), the last block as if padded with zeros."""
    length = magnitude.shape[-1]
    blocks = -(-length // block)
    padded = torch.nn.functional.pad(magnitude, (0, blocks * block - length))
    return padded.unflatten(-1, (blocks, block)).amax(-1)


def _per_value(factors: torch.Tensor, block: int, like: torch.Tensor) -> torch.Tensor:
    """The factors of blocks of ``block`` values along the last dimension, one per value of
    ``like``."""
    # gathered: Inductor (CPU) fused a repeat or expand of them, cut to a length that is no
    # multiple of the block, into its reader with the last block's factors wrong
    index = torch.arange(like.shape[-1] if _rank(like) else 1, device=factors.device) // block
    return factors[..., index].reshape(like.shape)


def _per_tile(factors: torch.Tensor, tile: int, like: torch.Tensor) -> torch.Tensor:
    """The factors of tiles of ``tile`` x ``tile`` values of the last two dimensions (of
    blocks along the last, for a ``like`` of fewer dimensions), one per value of ``like``."""
    if _rank(like) >= 2:  # each tile's factor over its rows first
        index = torch.arange(like.shape[-2], device=factors.device) // tile
        factors = factors.index_select(-2, index)
    return _per_value(factors, tile, like)


def _local_amax(x: torch.Tensor, size: int, tiles: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s magnitudes in FP32, and the largest of each block of ``size`` values along its
    last dimension, or with ``tiles`` of each tile of ``size`` x ``size`` values of its last
    two (a tensor of fewer dimensions: one row), the last ones as if padded with zeros."""
    magnitude = x.detach().abs().float()
    if tiles:
        return magnitude, _tile_amax(magnitude.reshape(1, -1) if _rank(x) < 2 else magnitude, size)
    return magnitude, _block_amax(magnitude.reshape(1) if _rank(x) == 0 else magnitude, size)


def mx_factors(x: torch.Tensor, target: FloatFormat, mode: str) -> torch.Tensor:
    """:func:`mx_factor` of each block of :data:`MX_BLOCK` values along ``x``'s last
    dimension (the last block as if padded with zeros), repeated over its values."""
    return _per_value(mx_factor(_local_amax(x, MX_BLOCK)[1], target, mode), MX_BLOCK, x)


def amax_factor(amax, largest: float, ops=rng.TorchOps):
    """The tensorwise factor of values whose largest magnitude is ``amax``: ``largest`` over
    it (at least :data:`AMAX_FLOOR`), computed in float64 and rounded to FP32 as torchao
    does, so that every executor gets the same bits; in ``ops``' terms (see
    :func:`round_bits`)."""
    f32, f64 = torch.float32, torch.float64
    floored = ops.maximum(ops.to_dtype(amax, f64), ops.constant(AMAX_FLOOR, f64))
    scale = ops.minimum(ops.truediv(ops.constant(largest, f64), floored), ops.constant(FP32_MAX, f64))
    return ops.to_dtype(scale, f32)


def blockwise_factors(x: torch.Tensor, largest: float, tiles: bool = False) -> torch.Tensor:
    """DeepSeek-V3's FP8 factors of ``x``, one per element: :func:`amax_factor` of each
    block of :data:`BLOCKWISE_BLOCK` values along the last dimension, or with ``tiles`` of
    each tile of :data:`BLOCKWISE_BLOCK` x :data:`BLOCKWISE_BLOCK` values of the last two
    (the last ones as if padded with zeros), as torchao's ``blockwise_fp8_training``
    computes them."""
    factors = amax_factor(_local_amax(x, BLOCKWISE_BLOCK, tiles)[1], largest)
    return _per_tile(factors, BLOCKWISE_BLOCK, x) if tiles else _per_value(factors, BLOCKWISE_BLOCK, x)


def _quotient(a, b):
    """``a / b`` rounded to FP32, computed in float64 (the same bits: the quotient of two
    FP32 values rounds to FP32 alike through float64), so that a compiled graph gets FP32's
    correctly rounded quotient on every device (Triton's FP32 division is not)."""
    return ((a.double() if hasattr(a, "double") else a) / (b.double() if hasattr(b, "double") else b)).float()


def _tile_amax(magnitude: torch.Tensor, tile: int) -> torch.Tensor:
    """The largest of each ``tile`` x ``tile`` tile of the last two dimensions of
    ``magnitude`` (at least 2-dim), the last tiles as if padded with zeros."""
    rows, cols = magnitude.shape[-2:]
    down, across = -(-rows // tile), -(-cols // tile)
    padded = torch.nn.functional.pad(magnitude, (0, across * tile - cols, 0, down * tile - rows))
    return padded.unflatten(-1, (across, tile)).unflatten(-3, (down, tile)).amax((-3, -1))


def nvfp4_factors(x: torch.Tensor, largest: float, tiles: bool = False) -> torch.Tensor:
    """NVIDIA's two-level NVFP4 factors of ``x``, one per element (its block's), as
    torchao's ``nvfp4_quantize`` computes them: a per-tensor scale ``amax / (448 *
    largest)`` (``amax`` at least :data:`AMAX_FLOOR`), and for each block of
    :data:`NVFP4_BLOCK` values along the last dimension (the last one as if padded with
    zeros) its largest magnitude over ``largest`` divided by that, clamped to E4M3's normal
    range and rounded to E4M3; the factor is one over the per-tensor scale, divided by the
    block's. With ``tiles``, a block is a tile of :data:`NVFP4_BLOCK` x :data:`NVFP4_BLOCK`
    values of the last two dimensions (a tensor of fewer is one row). An infinite or NaN
    magnitude makes every factor 0 or NaN."""
    magnitude, block_amax = _local_amax(x, NVFP4_BLOCK, tiles)
    tensor_scale = _quotient(magnitude.amax().clamp(min=AMAX_FLOOR), E4M3_MAX * largest)
    block_scale = _quotient(_quotient(block_amax, largest), tensor_scale)
    block_scale = block_scale.clamp(E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn).float()
    factors = _quotient(_quotient(1.0, tensor_scale), block_scale)
    return _per_tile(factors, NVFP4_BLOCK, x) if tiles else _per_value(factors, NVFP4_BLOCK, x)


def dynamic_scale(x: torch.Tensor, target: FloatFormat, scaling: str) -> torch.Tensor:
    """The factors ``scaling`` rounds ``x`` onto ``target``'s grid with, in FP32: one (a 0-dim tensor) for a
    tensorwise scaling, one per row of the last dimension (keeping it, as size 1) for a
    rowwise one, one per element for the MX, NVFP4 and blockwise scalings (its block's or
    tile's: :func:`mx_factors`, :func:`nvfp4_factors`, :func:`blockwise_factors`). Each
    tensorwise, rowwise or blockwise factor is ``target``'s largest finite value over the
    largest magnitude it scales (:func:`amax_factor`), rounded down to a
    power of two for the ``_pow2`` scalings. An empty tensor's is 1; an infinite magnitude
    gives 0 and a NaN gives NaN, so that the rounded values are NaN and a loss scaler sees
    them."""
    if not isinstance(x, torch.fx.Proxy) and x.numel() == 0:  # (a pass traces it with proxies)
        return torch.ones((), dtype=torch.float32, device=x.device)
    largest = target.max
    if scaling in MX_MODES:
        return mx_factors(x, target, MX_MODES[scaling])
    if scaling.startswith("nvfp4"):
        return nvfp4_factors(x, largest, tiles=is_tiled(scaling))
    if scaling.startswith("blockwise"):
        return blockwise_factors(x, largest, tiles=is_tiled(scaling))
    magnitude = x.detach().abs()
    rows = is_rowwise(scaling) and _rank(x) > 0
    scale = amax_factor(magnitude.amax(-1, keepdim=True) if rows else magnitude.amax(), largest)
    if scaling.endswith("_pow2"):
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def scale_within(xf: torch.Tensor, scale: torch.Tensor, largest: float) -> torch.Tensor:
    """``xf`` times its dynamic ``scale``, clamped to ``±largest``: the factor's FP32
    rounding can take the largest magnitude one ulp past it, which stochastic rounding
    would then round up beyond the format's range."""
    return (xf * scale).clamp(-largest, largest)


def quantize_reference(
    x: torch.Tensor,
    fmt: str,
    rounding: str = "nearest",
    overflow: str = "saturate",
    seed: torch.Tensor | None = None,
    offset: int = 0,
    scale: torch.Tensor | None = None,
    scaling: str = "none",
) -> torch.Tensor:
    """Reference implementation of ``lowprec::quantize`` in plain torch ops. A complex ``x``
    has its real and imaginary parts rounded (:func:`real_parts`)."""
    target = check_args(x, fmt, rounding, overflow, scaling)
    if x.is_complex():
        rounded = quantize_reference(real_parts(x), fmt, rounding, overflow, seed, offset, scale, scaling)
        return complex_of(rounded, x)
    if scaling != "none" and scale is not None:
        raise ValueError(f"scaling={scaling!r} computes the scale: pass no scale with it")
    # Contiguous, as the fake kernel promises (a transposed input would otherwise
    # give a transposed result); element indices are row-major anyway.
    xf = x.to(torch.float32).contiguous()
    if scaling != "none":
        scale = dynamic_scale(xf, target, scaling)
        xf = scale_within(xf, scale, target.max)
    elif scale is not None:
        xf = xf * scale
    random = None
    if rounding == "stochastic":
        if seed is None:
            raise ValueError("stochastic rounding needs a seed")
        random = rng.index_bits(x.shape, rng.key_tensor(seed.to(x.device), offset))
    out = round_value(xf, target, rounding, overflow, random)
    if scale is not None:
        out = out / scale
    return out.to(x.dtype)


@torch.library.custom_op("lowprec::quantize", mutates_args=())
def quantize_op(
    x: torch.Tensor,
    fmt: str,
    rounding: str,
    overflow: str,
    seed: torch.Tensor | None,
    offset: int,
    scale: torch.Tensor | None,
    scaling: str = "none",
) -> torch.Tensor:
    return quantize_reference(x, fmt, rounding, overflow, seed, offset, scale, scaling)


def scaling_argument(scaling: str) -> tuple[str, ...]:
    """The trailing ``scaling`` argument of a quantize call: none for the default
    ``"none"``, so that graphs without scaling print as they always did."""
    return () if scaling == "none" else (scaling,)


def scale_arguments(args: tuple, kwargs: dict) -> tuple[object, str]:
    """The ``scale`` and ``scaling`` arguments of a ``lowprec::quantize`` call (a graph
    node's ``args`` and ``kwargs``), defaults filled in."""
    scale = args[6] if len(args) > 6 else kwargs.get("scale")
    scaling = args[7] if len(args) > 7 else kwargs.get("scaling", "none")
    return scale, scaling


@quantize_op.register_fake
def _(x, fmt, rounding, overflow, seed, offset, scale, scaling="none"):
    check_args(x, fmt, rounding, overflow, scaling)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _straight_through(ctx, grad):
    return grad, None, None, None, None, None, None, None


quantize_op.register_autograd(_straight_through)


@torch.library.custom_op("lowprec::quantize_grad", mutates_args=())
def quantize_grad_op(
    x: torch.Tensor,
    fmt: str,
    rounding: str,
    overflow: str,
    seed: torch.Tensor | None,
    offset: int,
    scaling: str = "none",
) -> torch.Tensor:
    check_args(x, fmt, rounding, overflow, scaling)
    return x.clone()


@quantize_grad_op.register_fake
def _(x, fmt, rounding, overflow, seed, offset, scaling="none"):
    check_args(x, fmt, rounding, overflow, scaling)
    return torch.empty_like(x)


def _save_grad_spec(ctx, inputs, output):
    _, ctx.fmt, ctx.rounding, ctx.overflow, seed, ctx.offset, *scaling = inputs
    ctx.scaling = scaling[0] if scaling else "none"
    ctx.save_for_backward(seed)


def _quantize_incoming(ctx, grad):
    (seed,) = ctx.saved_tensors
    scaling = scaling_argument(ctx.scaling)
    out = quantize_op(grad, ctx.fmt, ctx.rounding, ctx.overflow, seed, ctx.offset, None, *scaling)
    return out, None, None, None, None, None, None


quantize_grad_op.register_autograd(_quantize_incoming, setup_context=_save_grad_spec)


def _batched(value: torch.Tensor | None, dim: int | None, size: int) -> torch.Tensor | None:
    """``value`` with its vmapped dimension ``dim`` first (expanded to ``size`` if unbatched)."""
    if value is None:
        return None
    return value.movedim(dim, 0) if dim is not None else value.expand(size, *value.shape)


def _round_slices(
    x: torch.Tensor,
    seed: torch.Tensor | None,
    round_slice: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
) -> torch.Tensor:
    """Each slice of vmapped ``x`` (batch dimension first) rounded alone by
    ``round_slice(slice, seed)``, with a random stream of its own."""
    streams = [None if seed is None else seed ^ ((i + 1) << 40) for i in range(x.shape[0])]
    return torch.stack([round_slice(x[i], stream) for i, stream in enumerate(streams)])


def _slices_alone(scaling: str, batched: torch.Tensor) -> bool:
    """Whether the slices of a vmapped tensor (``batched``: batch dimension first) must be
    rounded one by one under ``scaling``: its factors read the whole tensor, or its rows
    (tiles) would run across the slices (slices of no (fewer than two) dimensions)."""
    rows = is_rowwise(scaling) and batched.dim() < 2
    return reads_whole_tensor(scaling) or rows or (is_tiled(scaling) and batched.dim() < 3)


def _quantize_vmap(info, in_dims, x, fmt, rounding, overflow, seed, offset, scale, scaling="none"):
    """``lowprec::quantize`` under ``torch.vmap``: the slices as one tensor, whose element
    indices give each slice random bits of its own, and whose rows, blocks and tiles are the
    slices'; where the factors read the whole tensor, or rows or tiles would run across the
    slices (:func:`_slices_alone`), each slice with its own factors and stream. (Torch's
    fallback would round each slice alone, all with the same bits.)"""
    x_dim, _, _, _, seed_dim, _, scale_dim, *_ = in_dims
    if seed_dim is not None:
        raise ValueError("lowprec::quantize under vmap: the seed must not be vmapped")
    x = _batched(x, x_dim, info.batch_size)
    if scale is not None and scale_dim is not None:  # [B, *S] against [B, *X]: S aligned right
        scale = scale.movedim(scale_dim, 0)
        scale = scale.reshape(scale.shape[0], *[1] * (x.dim() - scale.dim()), *scale.shape[1:])
    if _slices_alone(scaling, x):
        return _round_slices(
            x,
            seed,
            lambda part, stream: quantize_op(part, fmt, rounding, overflow, stream, offset, None, scaling),
        ), 0
    return quantize_op(x, fmt, rounding, overflow, seed, offset, scale, *scaling_argument(scaling)), 0


def _quantize_grad_vmap(info, in_dims, x, fmt, rounding, overflow, seed, offset, scaling="none"):
    """``lowprec::quantize_grad`` under ``torch.vmap``: the error rounded as
    :func:`_quantize_vmap` rounds a tensor."""
    x_dim, _, _, _, seed_dim, *_ = in_dims
    if seed_dim is not None:
        raise ValueError("lowprec::quantize_grad under vmap: the seed must not be vmapped")
    x = _batched(x, x_dim, info.batch_size)
    if _slices_alone(scaling, x):
        return _round_slices(
            x,
            seed,
            lambda part, stream: quantize_grad_op(part, fmt, rounding, overflow, stream, offset, scaling),
        ), 0
    return quantize_grad_op(x, fmt, rounding, overflow, seed, offset, *scaling_argument(scaling)), 0


quantize_op.register_vmap(_quantize_vmap)
quantize_grad_op.register_vmap(_quantize_grad_vmap)


@torch.library.custom_op("lowprec::realize", mutates_args=())
def realize_op(x: torch.Tensor) -> torch.Tensor:
    """The identity; under Inductor ``x`` is computed once into a buffer."""
    return x.clone()


@realize_op.register_fake
def _(x):
    return torch.empty_like(x)


realize_op.register_autograd(lambda ctx, grad: grad)


def is_dtensor(x: torch.Tensor) -> bool:
    """Whether ``x`` is a DTensor (without importing ``torch.distributed.tensor``)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def whole_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x``, or where it is a DTensor the whole tensor on every rank (a reduction of a
    sharded DTensor, such as ``mean()``, holds each rank's partial result until then)."""
    return x.full_tensor() if is_dtensor(x) else x


def _as_tensor(value, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    if value is None or isinstance(value, torch.Tensor):
        return value
    return torch.tensor(value, dtype=dtype, device=device)


def quantize(
    x: torch.Tensor,
    fmt: str | FloatFormat,
    rounding: str = "nearest",
    *,
    seed: int | torch.Tensor = 0,
    offset: int = 0,
    scale: float | torch.Tensor | None = None,
    overflow: str = "saturate",
    scaling: str = "none",
) -> torch.Tensor:
    """Round ``x`` onto the grid of ``fmt`` and return it in ``x``'s dtype.

    ``rounding`` is ``"nearest"`` (to nearest, ties to even) or
    ``"stochastic"`` (up with probability equal to the distance from the lower
    neighbour, in units of the grid spacing). Stochastic bits come from
    ``lpcompile.numerics.rng`` keyed by ``(seed, offset, element index)``.
    ``overflow="saturate"`` clamps values beyond the format's max, infinities
    included, to ±max (torch's ``float8_e4m3fn`` cast does this); ``"inf"``
    turns them into ±inf, or NaN for a format without inf (the OCP
    non-saturating mode). NaN stays NaN under both.
    With ``scale``, ``x * scale`` is rounded and the result divided by ``scale``.
    ``scaling="tensorwise"`` takes the scale from ``x`` itself: the format's largest
    finite value over ``x``'s largest magnitude (:func:`dynamic_scale`; ``x`` times it
    is clamped to the format's range), ``"rowwise"`` one such factor per row of the last
    dimension, and the ``_pow2`` scalings those rounded down to powers of two; ``"mx"`` a
    power-of-two factor per block of 32 values of a row (:func:`mx_factor`; ``"mx_ceil"``,
    ``"mx_rceil"`` and ``"mx_even"`` its other scale calculations); ``"nvfp4"``
    an E4M3 factor per block of 16 under a per-tensor one (:func:`nvfp4_factors`),
    ``"nvfp4_2d"`` per tile of 16 x 16 of the last two dimensions; ``"blockwise"`` a
    tensorwise factor per block of 128 values of a row, ``"blockwise_2d"`` per tile of
    128 x 128 (:func:`blockwise_factors`); no ``scale`` goes with them.
    A complex ``x`` has its real and imaginary parts rounded (:func:`real_parts`).
    """
    name = parse_format(fmt).name if isinstance(fmt, FloatFormat) else fmt
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize takes a tensor, got {type(x).__name__}")
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if not 0 <= offset < 2**32:
        raise ValueError(f"offset must be in [0, 2**32) (the streams' 32-bit offset), got {offset}")
    offset = int(offset)
    if x.is_complex():
        check_args(x, name, rounding, overflow, scaling)
        if isinstance(scale, torch.Tensor) and scale.dim() != 0:
            raise ValueError("a complex x takes a number or a 0-dim tensor as its scale")
        parts = real_parts(x)
        rounded = quantize(
            parts, name, rounding, seed=seed, offset=offset, scale=scale, overflow=overflow, scaling=scaling
        )
        return complex_of(rounded, x)
    if rounding == "stochastic" and not isinstance(seed, torch.Tensor):
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int or an int64 tensor, got {type(seed).__name__}")
        if not -(2**63) <= seed < 2**63:
            raise ValueError(f"seed must be a 64-bit int, in [-2**63, 2**63), got {seed}")
        seed = int(seed)
    if rounding == "stochastic" and isinstance(seed, torch.Tensor):
        if seed.dim() != 0 or seed.is_floating_point() or seed.is_complex() or seed.dtype == torch.bool:
            got = f"{seed.dtype} {tuple(seed.shape)}"
            raise TypeError(f"a seed tensor must be a 0-dim integer tensor, got {got}")
    if isinstance(scale, torch.Tensor):
        if not scale.is_floating_point():
            raise TypeError(f"a scale tensor must be a float tensor, got {scale.dtype}")
        if not bool((torch.isfinite(scale) & (scale > 0)).all()):
            raise ValueError(f"scale must be finite and > 0 everywhere, got {scale}")
    elif scale is not None:
        if not is_real(scale):
            raise TypeError(f"scale must be a number or a tensor, got {type(scale).__name__}")
        check_fp32_scale("scale", scale)
    if scaling != "none" and scale is not None:
        raise ValueError(f"scaling={scaling!r} computes the scale from x: pass no scale with it")
    seed_t = _as_tensor(seed, torch.int64, x.device) if rounding == "stochastic" else None
    scale_t = _as_tensor(scale, torch.float32, x.device)
    if is_dtensor(x):  # rounded by lowprec's DTensor rules, op by op
        importlib.import_module("lpcompile.numerics.dtensor").register_dtensor_rules()
    elif _runs_compiled(x, scale_t):
        check_args(x, name, rounding, overflow, scaling)
        if rounding == "stochastic":
            rng.check_numel(x.numel())
        scale_dtype = None if scale_t is None else scale_t.dtype
        kernel = _compiled_kernel(name, rounding, overflow, x.dtype, scale_dtype, scaling)
        # the elements in row-major order, as the reference indexes them (rowwise: in rows;
        # tiled: in matrices)
        if is_tiled(scaling) and x.dim() > 1:
            view = x.reshape(-1, *x.shape[-2:])
        elif is_rowwise(scaling) and x.dim() > 0:
            view = x.reshape(-1, x.shape[-1])
        else:
            view = x.reshape(-1)
        return _StraightThrough.apply(view, kernel, seed_t, offset, scale_t).view(x.shape)
    scaled = scaling_argument(scaling)
    return torch.ops.lowprec.quantize(x, name, rounding, overflow, seed_t, offset, scale_t, *scaled)


# From this many elements the direct API rounds with one fused kernel that Inductor
# compiles from the reference ops (the same integer code, so the same bits): the reference
# run op by op moves every intermediate through memory (0.02-0.07 of copy bandwidth, and
# peak memory 6-10 times the input's). The first call per format, rounding and dtype
# compiles (seconds); calls of any length, seed and offset reuse it.
COMPILED_NUMEL = 1 << 20


def _runs_compiled(x: torch.Tensor, scale: torch.Tensor | None) -> bool:
    large = x.numel() >= COMPILED_NUMEL and x.device.type == "cpu"
    plain = scale is None or scale.dim() == 0
    return large and plain and not torch.compiler.is_compiling()


class _StraightThrough(torch.autograd.Function):
    """A compiled quantize kernel, with ``lowprec::quantize``'s straight-through gradient.

    The kernel sees the same kind of inputs on every call (gradients off, none a
    view): Dynamo would compile a graph for each kind.
    """

    @staticmethod
    def forward(ctx, flat, kernel, seed, offset, scale):
        return kernel(flat.detach(), seed, offset, None if scale is None else scale.detach())

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


@functools.cache
def _compiled_kernel(
    fmt: str,
    rounding: str,
    overflow: str,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None,
    scaling: str,
):
    """``lowprec::quantize`` over a 1-D tensor of any length (a 2-D one, for a rowwise
    ``scaling``; a 3-D one, for a tiled one), compiled; the offset is symbolic too."""
    import lpcompile.numerics.lowering  # noqa: F401  (Inductor fuses the operator)

    def kernel(flat, seed, offset, scale):
        return torch.ops.lowprec.quantize(flat, fmt, rounding, overflow, seed, offset, scale, scaling)

    # A code object per variant: Dynamo counts recompiles per code object, against a
    # limit of 8, and each variant is one.
    parts = (fmt, rounding, overflow, dtype, scale_dtype, scaling)
    variant = "_".join(str(part).removeprefix("torch.") for part in parts)
    kernel.__code__ = kernel.__code__.replace(co_name=f"quantize_{variant}")

    return torch.compile(kernel, dynamic=True, fullgraph=True)
