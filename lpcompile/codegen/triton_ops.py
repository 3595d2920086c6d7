"""Op -> Triton table: one small function per operator, rendering a Triton expression.

Each entry of :data:`OPS` maps an ATen or ``lowprec`` operator to an
:class:`OpSpec`: a ``check`` (may this node be fused?) and a ``render``
that writes the node's value through a :class:`Writer` (the kernel being
emitted, ``lpcompile.codegen.kernel``). Renderers only see the writer's small
interface: the values of their arguments, casts, literals, helpers.

Numerics follow the eager ATen ops bit for bit:

* arithmetic is done in FP32 (or the op's integer type) exactly as the ATen
  CPU kernels do, one IEEE operation per ATen operation (the launcher turns
  off FMA contraction on GPUs);
* all rounding to a narrower float format, the ``lowprec::quantize`` grid
  and the FP32 -> FP16/BF16 casts alike, is done with integer operations on
  the FP32 bit pattern (:func:`quantize_helper`, the Triton twin of
  ``lpcompile.numerics.quantize.round_bits``): the Triton interpreter's own FP8/BF16 casts do
  not round as torch's do;
* the counter RNG is rendered from ``lpcompile.numerics.rng.MIX_STEPS`` in uint32
  arithmetic (:func:`rng_helpers`), the same bits as the int32 torch version;
* transcendental ops (``gelu``) are marked: they agree with torch to a few
  ulp, not bit for bit (tests state the bound).
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

import lpcompile.numerics.predict  # noqa: F401  (registers lowprec::predict_weight)
import lpcompile.numerics.scale_grad  # noqa: F401  (registers lowprec::scale_grad)
from lpcompile.numerics import rng
from lpcompile.numerics.formats import FloatFormat, parse_format
from lpcompile.numerics.quantize import check_args, exact_power_steps, scale_arguments

aten = torch.ops.aten
prims = torch.ops.prims
lowprec = torch.ops.lowprec

TL_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64",
    torch.int64: "tl.int64",
    torch.int32: "tl.int32",
    torch.int16: "tl.int16",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# dtypes a fused node may compute in (FP16/BF16 only enter through loads and casts)
ARITH_DTYPES = (torch.float32, torch.int32, torch.int64, torch.bool)
SHORT_FLOATS = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Value:
    """A value in the kernel: a Triton expression (usually a variable) and its torch dtype."""

    expr: str
    dtype: torch.dtype


class Writer(Protocol):
    """What a renderer may ask of the kernel being written (``kernel.KernelWriter``)."""

    def arg(self, a: Any) -> Value | Any: ...

    def operand(self, a: Any, dtype: torch.dtype) -> str: ...

    def cast(self, value: Value, dtype: torch.dtype) -> Value: ...

    def assign(self, expr: str, dtype: torch.dtype) -> Value: ...

    def helper(self, name: str, source: str) -> str: ...

    def runtime_int(self, prefix: str, value: int) -> str: ...

    def random(self, seed: Value, offset: int) -> Value: ...


# ----------------------------------------------------------------------------- literals


def f32_bits(value: float) -> int:
    """The FP32 bit pattern of ``value`` rounded to FP32 (inf beyond FP32's range, as torch)."""
    try:
        packed = struct.pack("<f", value)
    except OverflowError:
        packed = struct.pack("<f", math.copysign(math.inf, value))
    return struct.unpack("<I", packed)[0]


def f32_literal(value: float) -> str:
    """A Triton FP32 constant equal to ``float32(value)``.

    Triton types a Python float literal as FP32 only when it is zero, inf/NaN or
    a normal FP32 number; subnormals and values beyond FP32 would become FP64.
    Those (and inf/NaN, which have no literal) are written as a bitcast.
    """
    bits = f32_bits(value)
    rounded = struct.unpack("<f", struct.pack("<I", bits))[0]
    exponent = (bits >> 23) & 0xFF
    if rounded == 0.0 and not bits & 0x80000000:
        return "0.0"
    if 0 < exponent < 0xFF:
        return repr(rounded)
    return f"tl.full([], 0x{bits:08X}, tl.uint32).to(tl.float32, bitcast=True)"


def literal(value: Any, dtype: torch.dtype) -> str:
    """A Python scalar as a Triton constant of ``dtype``."""
    if dtype == torch.bool:
        return "1" if value else "0"
    if dtype in INT_DTYPES:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"cannot write {value!r} as {dtype}")
        return str(int(value))
    if dtype == torch.float64:
        return repr(float(value)) if math.isfinite(value) else f"float('{value}')"
    return f32_literal(float(value))


# ----------------------------------------------------------------------------- helpers


def _mix_lines(var: str) -> list[str]:
    lines = []
    for op, const in rng.MIX_STEPS:
        if op == "xorshr":
            lines.append(f"{var} = {var} ^ ({var} >> {const})")
        elif op == "mul":
            lines.append(f"{var} = {var} * 0x{const:08X}")
        else:  # pragma: no cover - rng.MIX_STEPS only has these two
            raise ValueError(f"unknown mix step {op!r}")
    return lines


def rng_helpers() -> dict[str, str]:
    """Triton functions of the counter RNG, generated from ``rng.MIX_STEPS``."""
    mix = "\n    ".join(_mix_lines("x"))
    return {
        "lowbias32": f"""\
@triton.jit
def lowbias32(x):
    # One round of lpcompile.numerics.rng.MIX_STEPS on uint32 (logical shifts, wrapping multiplies).
    {mix}
    return x
""",
        "stream_key": f"""\
@triton.jit
def stream_key(seed, offset):
    # lpcompile.numerics.rng.key_tensor: the 32-bit key of a 64-bit seed and a 32-bit stream offset.
    seed = seed.to(tl.int64)  # any integer seed tensor, as the reference's key_tensor takes
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = (seed >> 32).to(tl.uint32)
    return lowbias32(lowbias32(lo ^ lowbias32(hi ^ 0x{rng.SEED_HI_SALT:08X})) ^ offset.to(tl.uint32))
""",
        "random_bits": """\
@triton.jit
def random_bits(index, key):
    # lpcompile.numerics.rng.bits_from_index: 32 random bits for each row-major element index.
    return lowbias32(lowbias32(index.to(tl.uint32) ^ key) + key)
""",
    }


def _ident(text: str) -> str:
    return re.sub(r"[^0-9a-zA-Z]+", "_", text).strip("_")


def quantize_helper(fmt: FloatFormat, rounding: str, overflow: str) -> tuple[str, str]:
    """``(name, source)`` of a Triton function rounding FP32 onto ``fmt``'s grid.

    The same steps as ``lpcompile.numerics.quantize.round_bits``, in uint32: add a rounding
    increment below the kept mantissa bits and truncate; below ``fmt``'s
    smallest normal round on the constant subnormal spacing in FP32
    arithmetic; then overflow and NaN. ``random`` (uint32) is only read for
    stochastic rounding.
    """
    name = f"round_{_ident(fmt.name)}_{rounding}_{overflow}"
    drop = 23 - fmt.man_bits
    out: list[str] = [
        "bits = x.to(tl.uint32, bitcast=True)",
        "sign = bits & 0x80000000",
        "mag = bits & 0x7FFFFFFF",
    ]
    if drop == 0:
        out.append("out = mag")
    else:
        low = (1 << drop) - 1
        if rounding == "nearest":
            out.append(f"inc = ((mag >> {drop}) & 1) + 0x{(1 << (drop - 1)) - 1:X}  # ties to even")
        else:
            out.append(f"inc = (random >> {32 - drop}) & 0x{low:X}  # {drop} random bits below the kept ones")
        out.append(f"out = (mag + inc) & 0x{0xFFFFFFFF ^ low:08X}")
    if fmt.min_exp > -126:
        spacing_exp = fmt.min_exp - fmt.man_bits
        out.append(f"# below {fmt.name}'s smallest normal the grid spacing is constant, 2**{spacing_exp}")
        out.append("absx = mag.to(tl.float32, bitcast=True)")
        if rounding == "nearest":
            magic = f32_literal(2.0 ** (spacing_exp + 23))
            out.append(f"sub = (absx + {magic}) - {magic}")
        else:
            factors = " * ".join(f32_literal(2.0**step) for step in exact_power_steps(-spacing_exp))
            out.append(f"units = absx * {factors}")
            out.append("whole = tl.floor(units)")
            out.append("uniform = ((random >> 8) & 0xFFFFFF).to(tl.float32)")
            out.append(f"up = (units - whole) > uniform * {f32_literal(2.0**-24)}")
            out.append(f"sub = (whole + up.to(tl.float32)) * {f32_literal(2.0**spacing_exp)}")
        out.append(
            f"out = tl.where(mag < 0x{(fmt.min_exp + 127) << 23:08X}, sub.to(tl.uint32, bitcast=True), out)"
        )
    max_bits = f32_bits(fmt.max)
    if overflow == "saturate" or not (fmt.has_inf or fmt.has_nan):
        over = max_bits
    else:
        over = 0x7F800000 if fmt.has_inf else 0x7FC00000
    # a signed comparison, as round_bits' int32: a negative pattern (a NaN with its sign set) is no overflow
    out.append(f"over = out.to(tl.int32, bitcast=True) > 0x{max_bits:08X}")
    out.append(f"out = tl.where(over, 0x{over:08X}, out)  # overflow ({overflow}), inf too")
    out.append("out = tl.where(mag > 0x7F800000, 0x7FC00000, out)  # NaN stays NaN")
    out.append("return (out | sign).to(tl.float32, bitcast=True)")
    body = "\n    ".join(out)
    doc = (
        f"Round FP32 x onto the {fmt.name} grid ({rounding}, overflow={overflow}):"
        " lpcompile.numerics.quantize.round_bits."
    )
    source = f"@triton.jit\ndef {name}(x, random):\n    # {doc}\n    {body}\n"
    return name, source


BF16_HELPERS = {
    "bf16_to_f32": """\
@triton.jit
def bf16_to_f32(x):
    # BF16 -> FP32 by moving the bits up (exact; no float conversion needed).
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
""",
    "f32_to_bf16_exact": """\
@triton.jit
def f32_to_bf16_exact(x):
    # FP32 already on the BF16 grid -> BF16, by dropping the 16 low (zero) bits.
    return (x.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
""",
}


def cast(w: Writer, value: Value, dst: torch.dtype) -> Value:
    """``value`` converted to ``dst`` as torch's ``Tensor.to`` does (RNE for narrower floats)."""
    src = value.dtype
    if src == dst:
        return value
    expr = value.expr
    if src == torch.bfloat16:
        expr, src = f"{w.helper('bf16_to_f32', BF16_HELPERS['bf16_to_f32'])}({expr})", torch.float32
        if dst == torch.float32:
            return w.assign(expr, dst)
    if dst == torch.bool:
        return w.assign(f"{expr} != 0", dst)
    if dst in SHORT_FLOATS:
        if src != torch.float32:
            expr = f"{expr}.to(tl.float32)"
        name, source = quantize_helper(_fmt("fp16" if dst == torch.float16 else "bf16"), "nearest", "inf")
        rounded = f"{w.helper(name, source)}({expr}, 0)"
        if dst == torch.float16:
            return w.assign(f"{rounded}.to(tl.float16)", dst)
        return w.assign(f"{w.helper('f32_to_bf16_exact', BF16_HELPERS['f32_to_bf16_exact'])}({rounded})", dst)
    return w.assign(f"{expr}.to({TL_DTYPES[dst]})", dst)


def _fmt(name: str) -> FloatFormat:
    return parse_format(name)


# ----------------------------------------------------------------------------- the table


def val(a: Any) -> Any:
    """The example value (FakeTensor) of a node argument, or the argument itself."""
    if isinstance(a, torch.fx.Node):
        return a.meta.get("val")
    return a


def out_dtype(node: torch.fx.Node) -> torch.dtype:
    return node.meta["val"].dtype


def common_dtype(*args: Any) -> torch.dtype:
    """torch's promoted dtype of ``args`` (tensors and Python scalars)."""
    return elementwise_dtypes(
        *[val(a) for a in args], type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
    )[1]


def _tensor_dtypes(node: torch.fx.Node) -> list[torch.dtype]:
    return [a.meta["val"].dtype for a in node.args if isinstance(a, torch.fx.Node)]


@dataclass(frozen=True)
class OpSpec:
    """How one operator is fused.

    ``kind``: ``"pointwise"`` (computed in the kernel), ``"identity"`` (a copy:
    same value), ``"view"`` (an alias, such as ``detach`` or a dtype view:
    computed in the kernel for fused users, recreated outside for the others).
    """

    render: Callable[[Writer, torch.fx.Node], Value]
    check: Callable[[torch.fx.Node], bool] = lambda node: True
    kind: str = "pointwise"
    transcendental: bool = False

    def reads(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """The tensor arguments the kernel reads (an identity reads only its first)."""
        if self.kind != "pointwise":
            first = node.args[0]
            return [first] if isinstance(first, torch.fx.Node) else []
        return list(node.all_input_nodes)


def _arith_ok(node: torch.fx.Node) -> bool:
    if len(node.args) > 2 or node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode") is not None:
        return False  # alpha: ATen uses a fused multiply-add; rounding modes: not rendered
    if out_dtype(node) not in ARITH_DTYPES:
        return False
    scalars = [a for a in node.args if not isinstance(a, torch.fx.Node)]
    return all(isinstance(s, int | float | bool) for s in scalars)


def _binary(op: str, bool_op: str | None = None) -> OpSpec:
    def render(w: Writer, node: torch.fx.Node) -> Value:
        dtype = out_dtype(node)
        a, b = node.args[:2]
        if dtype == torch.bool:
            if bool_op is None:
                raise ValueError(f"{node.target} on bool tensors")
            return w.assign(f"{w.operand(a, dtype)} {bool_op} {w.operand(b, dtype)}", dtype)
        return w.assign(f"{w.operand(a, dtype)} {op} {w.operand(b, dtype)}", dtype)

    def check(node: torch.fx.Node) -> bool:
        return _arith_ok(node) and (bool_op is not None or out_dtype(node) != torch.bool)

    return OpSpec(render, check)


def reciprocal_divisor(device: torch.device) -> bool:
    """Whether ATen on ``device`` divides by a CPU scalar as a multiply by its FP32 reciprocal
    (its CUDA kernel does; its CPU kernel divides)."""
    return device.type == "cuda"


def cpu_scalar(a: Any) -> bool:
    """Whether ``a`` (an FX node or a Python number, which ATen wraps) is a 0-dim CPU tensor."""
    if not isinstance(a, torch.fx.Node):
        return True
    return a.meta["val"].device.type == "cpu" and a.meta["val"].dim() == 0


def divide(w: Writer, num: str, den: Any, device: torch.device) -> Value:
    """``num / den`` in FP32 as ATen computes it on ``device``: IEEE division (``tl.div_rn``;
    Triton's ``/`` may compile to an approximate one on GPUs), or, for a CPU-scalar divisor
    where :func:`reciprocal_divisor`, ``num`` times the divisor's FP32 reciprocal."""
    if reciprocal_divisor(device) and cpu_scalar(den):
        if isinstance(den, torch.fx.Node):
            inv = f"tl.div_rn(1.0, {w.operand(den, torch.float32)})"
        else:  # a Python number: its reciprocal as ATen computes it on the host, in FP32
            inv = f32_literal(float(torch.tensor(1.0) / torch.tensor(float(den), dtype=torch.float32)))
        return w.assign(f"{num} * {inv}", torch.float32)
    return w.assign(f"tl.div_rn({num}, {w.operand(den, torch.float32)})", torch.float32)


def _render_div(w: Writer, node: torch.fx.Node) -> Value:
    a, b = node.args[:2]
    return divide(w, w.operand(a, torch.float32), b, node.meta["val"].device)


def _div_check(node: torch.fx.Node) -> bool:
    return _arith_ok(node) and out_dtype(node) == torch.float32


def _compare(op: str) -> OpSpec:
    def render(w: Writer, node: torch.fx.Node) -> Value:
        a, b = node.args[:2]
        dtype = common_dtype(a, b)
        return w.assign(f"{w.operand(a, dtype)} {op} {w.operand(b, dtype)}", torch.bool)

    def check(node: torch.fx.Node) -> bool:
        return len(node.args) == 2 and common_dtype(*node.args) in ARITH_DTYPES

    return OpSpec(render, check)


def _bitwise(op: str) -> OpSpec:
    def render(w: Writer, node: torch.fx.Node) -> Value:
        dtype = out_dtype(node)
        a, b = node.args[:2]
        return w.assign(f"{w.operand(a, dtype)} {op} {w.operand(b, dtype)}", dtype)

    def check(node: torch.fx.Node) -> bool:
        return out_dtype(node) in (torch.bool, torch.int32, torch.int64)

    return OpSpec(render, check)


def _shift(op: str) -> OpSpec:
    def render(w: Writer, node: torch.fx.Node) -> Value:
        dtype = out_dtype(node)
        return w.assign(f"{w.operand(node.args[0], dtype)} {op} {int(node.args[1])}", dtype)

    def check(node: torch.fx.Node) -> bool:
        dtype, amount = out_dtype(node), node.args[1]
        bits = torch.iinfo(dtype).bits if dtype in (torch.int32, torch.int64) else 0
        return isinstance(amount, int) and 0 <= amount < bits

    return OpSpec(render, check)


def _unary_ok(node: torch.fx.Node) -> bool:
    return out_dtype(node) in ARITH_DTYPES and all(d in ARITH_DTYPES for d in _tensor_dtypes(node))


def _render_neg(w: Writer, node: torch.fx.Node) -> Value:
    dtype = out_dtype(node)
    operand = w.operand(node.args[0], dtype)
    # Triton's unary minus is 0 - x, which turns +0.0 into +0.0; * -1.0 flips the sign bit.
    return w.assign(f"{operand} * -1.0" if dtype.is_floating_point else f"-{operand}", dtype)


def _render_abs(w: Writer, node: torch.fx.Node) -> Value:
    dtype = out_dtype(node)
    if dtype == torch.bool:
        return w.arg(node.args[0])
    return w.assign(f"tl.abs({w.operand(node.args[0], dtype)})", dtype)


def _render_not(w: Writer, node: torch.fx.Node) -> Value:
    dtype = out_dtype(node)
    x = w.operand(node.args[0], dtype)
    return w.assign(f"{x} == 0" if dtype == torch.bool else f"~{x}", dtype)


def _render_logical_not(w: Writer, node: torch.fx.Node) -> Value:
    return w.assign(f"{w.operand(node.args[0], torch.bool)} == 0", torch.bool)


def _render_relu(w: Writer, node: torch.fx.Node) -> Value:
    x = w.operand(node.args[0], torch.float32)
    # As ATen's clamp_min(x, 0): NaN and -0.0 pass through.
    return w.assign(f"tl.where({x} < 0.0, 0.0, {x})", torch.float32)


def _render_threshold_backward(w: Writer, node: torch.fx.Node) -> Value:
    grad, inp, threshold = node.args
    g = w.operand(grad, torch.float32)
    x = w.operand(inp, torch.float32)
    return w.assign(f"tl.where({x} <= {literal(threshold, torch.float32)}, 0.0, {g})", torch.float32)


def _float_only(node: torch.fx.Node) -> bool:
    return out_dtype(node) == torch.float32 and all(d in ARITH_DTYPES for d in _tensor_dtypes(node))


def _render_gelu(w: Writer, node: torch.fx.Node) -> Value:
    x = w.operand(node.args[0], torch.float32)
    # ATen's GeluKernel: x * 0.5 * (1 + erf(x * M_SQRT1_2)); erf is not bit-identical to ATen's.
    half = w.assign(f"{x} * 0.5", torch.float32).expr
    erf = w.assign(f"tl.math.erf({x} * {f32_literal(math.sqrt(0.5))})", torch.float32).expr
    return w.assign(f"{half} * (1.0 + {erf})", torch.float32)


def _gelu_check(node: torch.fx.Node) -> bool:
    return _float_only(node) and node.kwargs.get("approximate", "none") == "none" and len(node.args) == 1


def _render_where(w: Writer, node: torch.fx.Node) -> Value:
    cond, a, b = node.args
    dtype = out_dtype(node)
    return w.assign(
        f"tl.where({w.operand(cond, torch.bool)}, {w.operand(a, dtype)}, {w.operand(b, dtype)})", dtype
    )


def _where_check(node: torch.fx.Node) -> bool:
    return out_dtype(node) in ARITH_DTYPES and len(node.args) == 3


def _render_identity(w: Writer, node: torch.fx.Node) -> Value:
    return w.arg(node.args[0])


def _render_to_copy(w: Writer, node: torch.fx.Node) -> Value:
    return cast(w, w.arg(node.args[0]), out_dtype(node))


def _to_copy_check(node: torch.fx.Node) -> bool:
    src = node.args[0].meta["val"]
    dst = node.meta["val"]
    allowed = (*ARITH_DTYPES, *SHORT_FLOATS)
    extra = set(node.kwargs) - {"dtype", "layout", "device", "memory_format", "pin_memory", "non_blocking"}
    return not extra and src.device == dst.device and src.dtype in allowed and dst.dtype in allowed


def _convert_check(node: torch.fx.Node) -> bool:
    return node.args[0].meta["val"].dtype in (*ARITH_DTYPES, *SHORT_FLOATS) and out_dtype(node) in (
        *ARITH_DTYPES,
        *SHORT_FLOATS,
    )


def _render_view_dtype(w: Writer, node: torch.fx.Node) -> Value:
    x = w.arg(node.args[0])
    dtype = out_dtype(node)
    return w.assign(f"{x.expr}.to({TL_DTYPES[dtype]}, bitcast=True)", dtype)


def _view_dtype_check(node: torch.fx.Node) -> bool:
    src, dst = node.args[0].meta["val"].dtype, out_dtype(node)
    return src.itemsize == dst.itemsize and src != torch.bool and dst != torch.bool


def _render_quantize(w: Writer, node: torch.fx.Node) -> Value:
    x, fmt, rounding, overflow, seed, offset = node.args[:6]
    scale, _ = scale_arguments(node.args, node.kwargs)
    target = parse_format(fmt)
    name, source = quantize_helper(target, rounding, overflow)
    fn = w.helper(name, source)
    xf = cast(w, w.arg(x), torch.float32).expr
    if scale is not None:
        s = w.operand(scale, torch.float32)
        xf = w.assign(f"{xf} * {s}", torch.float32).expr
    if rounding == "stochastic":
        random = w.random(w.arg(seed), offset).expr
    else:
        random = "0"
    out = w.assign(f"{fn}({xf}, {random})", torch.float32)
    if scale is not None:
        out = divide(w, out.expr, scale, node.meta["val"].device)
    return cast(w, out, out_dtype(node))


def _quantize_check(node: torch.fx.Node) -> bool:
    x, fmt, rounding, overflow, seed, offset = node.args[:6]
    scale, scaling = scale_arguments(node.args, node.kwargs)
    check_args(x.meta["val"], fmt, rounding, overflow, scaling)
    if scaling != "none":  # its scale is a reduction of x: the operator runs unfused
        return False
    if rounding == "stochastic" and not isinstance(seed, torch.fx.Node):
        return False
    if isinstance(seed, torch.fx.Node) and seed.meta["val"].dtype not in INT_DTYPES:
        return False
    if isinstance(scale, torch.fx.Node) and scale.meta["val"].dtype not in (torch.float32, torch.float64):
        return False
    # With a scale, out / scale is not on the grid: a float16/bfloat16 result would need
    # a rounding cast, which cast() does; the scale's broadcast is the loader's.
    return isinstance(offset, int) and (scale is None or isinstance(scale, torch.fx.Node))


def _render_predict_weight(w: Writer, node: torch.fx.Node) -> Value:
    weight, buf, lr, delay, mode = node.args
    wv = w.operand(weight, torch.float32)
    bv = w.operand(buf, torch.float32)
    if mode == "lwp_v":  # w - (lr * delay) * buf, as lpcompile.numerics.predict
        step = w.assign(f"{w.operand(lr, torch.float32)} * {literal(delay, torch.float32)}", torch.float32)
        prod = w.assign(f"{step.expr} * {bv}", torch.float32)
        return w.assign(f"{wv} - {prod.expr}", torch.float32)
    diff = w.assign(f"{wv} - {bv}", torch.float32)  # w + delay * (w - buf)
    prod = w.assign(f"{literal(delay, torch.float32)} * {diff.expr}", torch.float32)
    return w.assign(f"{wv} + {prod.expr}", torch.float32)


def _predict_check(node: torch.fx.Node) -> bool:
    weight, buf, lr, delay, mode = node.args
    return (
        mode in ("lwp_v", "lwp_w")
        and weight.meta["val"].dtype == torch.float32
        and buf.meta["val"].dtype == torch.float32
        and lr.meta["val"].dtype in (torch.float32, torch.float64)
        and abs(delay) < 1 << 24
    )


def _identity_check(node: torch.fx.Node) -> bool:
    return node.args[0].meta["val"].dtype in (*ARITH_DTYPES, *SHORT_FLOATS)


OPS: dict[Any, OpSpec] = {
    aten.add.Tensor: _binary("+", "|"),
    aten.sub.Tensor: _binary("-"),
    aten.mul.Tensor: _binary("*", "&"),
    aten.div.Tensor: OpSpec(_render_div, _div_check),
    aten.neg.default: OpSpec(_render_neg, lambda n: _unary_ok(n) and out_dtype(n) != torch.bool),
    aten.abs.default: OpSpec(_render_abs, _unary_ok),
    aten.relu.default: OpSpec(_render_relu, _float_only),
    aten.threshold_backward.default: OpSpec(_render_threshold_backward, _float_only),
    aten.gelu.default: OpSpec(_render_gelu, _gelu_check, transcendental=True),
    aten.where.self: OpSpec(_render_where, _where_check),
    aten.bitwise_not.default: OpSpec(_render_not, _unary_ok),
    aten.logical_not.default: OpSpec(_render_logical_not, _unary_ok),
    aten.bitwise_right_shift.Tensor_Scalar: _shift(">>"),
    aten.bitwise_left_shift.Tensor_Scalar: _shift("<<"),
    aten.clone.default: OpSpec(_render_identity, _identity_check, kind="identity"),
    aten._to_copy.default: OpSpec(_render_to_copy, _to_copy_check),
    prims.convert_element_type.default: OpSpec(_render_to_copy, _convert_check),
    aten.detach.default: OpSpec(_render_identity, _identity_check, kind="view"),
    aten.alias.default: OpSpec(_render_identity, _identity_check, kind="view"),
    aten.view.dtype: OpSpec(_render_view_dtype, _view_dtype_check, kind="view"),
    lowprec.quantize.default: OpSpec(_render_quantize, _quantize_check),
    lowprec.quantize_grad.default: OpSpec(_render_identity, _identity_check, kind="identity"),
    lowprec.scale_grad.default: OpSpec(_render_identity, _identity_check, kind="identity"),
    lowprec.count_grad.default: OpSpec(_render_identity, _identity_check, kind="identity"),
    lowprec.predict_weight.default: OpSpec(_render_predict_weight, _predict_check),
}
for _name, _op in (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">=")):
    for _overload in ("Tensor", "Scalar"):
        OPS[getattr(getattr(aten, _name), _overload)] = _compare(_op)
for _name, _op in (("bitwise_and", "&"), ("bitwise_or", "|"), ("bitwise_xor", "^")):
    for _overload in ("Tensor", "Scalar"):
        OPS[getattr(getattr(aten, _name), _overload)] = _bitwise(_op)
for _name in ("add", "sub", "mul", "div"):
    OPS[getattr(aten, _name).Scalar] = OPS[getattr(aten, _name).Tensor]
