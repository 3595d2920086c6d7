"""Round-to-nearest-even quantization against independent oracles.

Oracles: torch's own casts (``x.to(torch.float8_e5m2)`` rounds to nearest even
and overflows to inf; ``x.to(torch.float8_e4m3fn)`` saturates, infinities
included), ``ml_dtypes`` for the formats torch lacks, and a float64 model of an
arbitrary eXmY format (``rne_model``) for the generic sweep.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lpcompile import FloatFormat, parse_format, quantize

pytestmark = pytest.mark.usefixtures("single_thread")

INT_MIN = -(1 << 31)
TORCH_DTYPE = {
    "e5m2": torch.float8_e5m2,
    "e4m3": torch.float8_e4m3fn,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


# ---------------------------------------------------------------- inputs


def fp32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


@functools.cache
def binade_sweep(per_binade: int = 8192) -> torch.Tensor:
    """2 signs x 256 exponent codes x ``per_binade`` random mantissas (2**22 by default).

    Covers every binade of FP32, its subnormals (exponent 0), inf/NaN (255) and so
    every target's normal, subnormal and overflow range.
    """
    g = torch.Generator().manual_seed(1234)
    man = torch.randint(0, 1 << 23, (2, 256, per_binade), generator=g, dtype=torch.int32)
    man[:, :, 0] = 0  # exact powers of two (and inf)
    man[:, :, 1] = (1 << 23) - 1
    exp = (torch.arange(256, dtype=torch.int32) << 23).view(1, 256, 1)
    sign = torch.tensor([0, INT_MIN], dtype=torch.int32).view(2, 1, 1)
    return fp32_from_bits(sign | exp | man).reshape(-1)


def with_fp32_neighbours(values: np.ndarray) -> np.ndarray:
    """``values`` (float32), their FP32 neighbours either side, both signs."""
    v = values.astype(np.float32)
    with np.errstate(over="ignore"):  # nextafter(max) is inf: fine
        up = np.nextafter(v, np.float32(np.inf))
        down = np.nextafter(v, np.float32(-np.inf))
    allv = np.concatenate([v, up, down])
    return np.concatenate([allv, -allv])


def grid(fmt: FloatFormat) -> np.ndarray:
    """All finite non-negative values of ``fmt`` (float64, ascending), decoded from the bit layout."""
    m = fmt.man_bits
    frac = np.arange(1 << m, dtype=np.float64) / (1 << m)
    parts = [frac * 2.0**fmt.min_exp]  # subnormals and zero
    top = (1 << fmt.exp_bits) - 1
    for code in range(1, top + 1):
        binade = (1 + frac) * 2.0 ** (code - fmt.bias)
        if code == top and fmt.special == "ieee":
            break  # inf / NaN codes
        if code == top and fmt.special == "fn":
            binade = binade[:-1]  # all-ones mantissa is NaN
        parts.append(binade)
    return np.concatenate(parts)


def edge_values(fmt: FloatFormat) -> np.ndarray:
    """Grid values, midpoints (ties) between neighbours, the values past max, +-1 FP32 ulp of each."""
    g = grid(fmt)
    step_top = 2.0 ** (fmt.max_exp - fmt.man_bits)
    beyond = np.array([fmt.max + step_top / 2, fmt.max + step_top, fmt.max + 1.5 * step_top, 2 * fmt.max])
    points = np.concatenate([g, (g[1:] + g[:-1]) / 2, beyond, [fmt.min_subnormal / 4]])
    points = points[points <= np.finfo(np.float32).max]  # bf16: past its max is past FP32's
    assert np.all(points.astype(np.float32) == points), "edge points must be exact in FP32"
    return with_fp32_neighbours(points)


SPECIALS = np.array(
    [0.0, np.inf, np.nan, np.finfo(np.float32).max, np.finfo(np.float32).smallest_subnormal, 2.0**-126, 1.0]
)


@functools.cache
def inputs_for(name: str) -> torch.Tensor:
    """The full FP32 input set for target ``name``: binade sweep, edges and specials."""
    fmt = parse_format(name)
    extra = np.concatenate([with_fp32_neighbours(SPECIALS), edge_values(fmt)]).astype(np.float32)
    return torch.cat([binade_sweep(), torch.from_numpy(extra)])


# ---------------------------------------------------------------- oracles


def torch_oracle(x: torch.Tensor, name: str, overflow: str) -> torch.Tensor:
    """Round with torch's casts (or ml_dtypes where torch's cast has the other overflow policy)."""
    dtype = TORCH_DTYPE[name]
    if name == "e4m3":
        if overflow == "saturate":
            return x.to(dtype).to(x.dtype)  # torch's e4m3fn cast saturates, inf included
        # torch has no non-saturating e4m3fn cast; ml_dtypes overflows to NaN (OCP non-saturating)
        with np.errstate(invalid="ignore", over="ignore"):
            y = x.float().numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        return torch.from_numpy(y).to(x.dtype)
    if overflow == "saturate":
        fmax = torch.finfo(dtype).max
        x = x.clamp(-fmax, fmax)  # keeps NaN
    return x.to(dtype).to(x.dtype)


def rne_model(x: np.ndarray, fmt: FloatFormat, overflow: str) -> np.ndarray:
    """Round-to-nearest-even onto ``fmt`` in float64 arithmetic (exact for every format here)."""
    with np.errstate(all="ignore"):  # signalling NaNs, inf / spacing, ...
        x = x.astype(np.float64)
        ax = np.abs(x)
        _, e = np.frexp(ax)  # ax = f * 2**e with f in [0.5, 1)
        exp = np.maximum(e - 1, fmt.min_exp)
        spacing = np.ldexp(1.0, exp - fmt.man_bits)
        units = ax / spacing  # exact: a power-of-two scaling
        q = np.round(units) * spacing  # np.round: half to even
        if fmt.man_bits == 0:
            # Without mantissa bits "even" is the even *encoding*: the exponent code's
            # lowest bit. A tie between 2**E and 2**(E+1) goes to 2**E when E + bias is
            # even (e2m0: 3 -> 2, where an even multiple of the spacing would give 4).
            tie = (units - np.floor(units) == 0.5) & (ax >= fmt.min_normal)
            down = (exp + fmt.bias) % 2 == 0
            q = np.where(tie, np.where(down, np.floor(units), np.ceil(units)) * spacing, q)
    if overflow == "saturate" or fmt.special == "finite":
        over_value = fmt.max
    else:
        over_value = np.inf if fmt.has_inf else np.nan
    q = np.where(np.isinf(ax) | (q > fmt.max), over_value, q)
    q = np.where(np.isnan(x), np.nan, q)
    return np.copysign(q, x)


# ---------------------------------------------------------------- torch oracles


@pytest.mark.parametrize("overflow", ["saturate", "inf"])
@pytest.mark.parametrize("name", ["e5m2", "e4m3", "fp16", "bf16"])
def test_fp32_inputs_match_torch(name, overflow, same_bits):
    x = inputs_for(name)
    assert x.numel() >= 1 << 22
    same_bits(quantize(x, name, overflow=overflow), torch_oracle(x, name, overflow), x, f"{name}/{overflow}")


def all_patterns(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("overflow", ["saturate", "inf"])
@pytest.mark.parametrize("source", [torch.float16, torch.bfloat16])
def test_all_16bit_patterns(source, overflow, same_bits):
    """Every fp16 / bf16 bit pattern, upcast to FP32 and as a 16-bit tensor."""
    x16 = all_patterns(source)
    x32 = x16.float()
    for name in ["e5m2", "e4m3", "fp16", "bf16"]:
        want = torch_oracle(x32, name, overflow)
        same_bits(quantize(x32, name, overflow=overflow), want, x32, f"{source} as fp32 -> {name}/{overflow}")
    for name in ["e5m2", "e4m3"]:  # the 16-bit tensor itself: result keeps its dtype
        got = quantize(x16, name, overflow=overflow)
        assert got.dtype == source
        same_bits(got, torch_oracle(x16, name, overflow), x16, f"{source} -> {name}/{overflow}")
    own = "fp16" if source == torch.float16 else "bf16"  # its own format: the identity...
    want = (
        x16.float().clamp(-torch.finfo(source).max, torch.finfo(source).max)
        if overflow == "saturate"
        else x16
    )
    same_bits(quantize(x16, own, overflow=overflow), want.to(source), x16, f"{source} -> {own}/{overflow}")


def test_fp32_format_is_identity(same_bits):
    """...except that saturation maps inf to max, as for every format."""
    x = binade_sweep()
    fmax = torch.finfo(torch.float32).max
    same_bits(quantize(x, "fp32", overflow="inf"), x, x, "fp32/inf")
    same_bits(quantize(x, "fp32", overflow="saturate"), x.clamp(-fmax, fmax), x, "fp32/saturate")


@pytest.mark.parametrize("name", ["e5m2", "e4m3", "fp16", "bf16"])
def test_documented_edges(name):
    """A few hand-written cases, readable on their own."""
    fmt = parse_format(name)
    mx, sub = fmt.max, fmt.min_subnormal
    step = 2.0 ** (fmt.max_exp - fmt.man_bits)
    above_top = np.nan if fmt.special == "fn" else np.inf
    cases = [  # (x, saturate, inf)
        (mx, mx, mx),
        (mx + step / 2 - step / 64, mx, mx),  # below the midpoint to the next (virtual) value
        (mx + step, mx, above_top),
        (float("inf"), mx, above_top),
        (float("-inf"), -mx, -above_top),
        (sub, sub, sub),
        (sub / 2, 0.0, 0.0),  # a tie with an even zero
        (sub * 1.5, 2 * sub, 2 * sub),  # a tie: 1 (odd) and 2 (even) units -> 2
        (sub / 2 * 1.0001, sub, sub),
        (-sub / 4, -0.0, -0.0),
    ]
    x = torch.tensor([c[0] for c in cases])
    for col, overflow in [(1, "saturate"), (2, "inf")]:
        got = quantize(x, name, overflow=overflow)
        want = torch.tensor([c[col] for c in cases])
        ok = torch.eq(got, want) | (got.isnan() & want.isnan())
        ok &= torch.signbit(got) == torch.signbit(want)
        assert ok.all(), (
            f"{name}/{overflow}: x={x[~ok].tolist()} got {got[~ok].tolist()} want {want[~ok].tolist()}"
        )
    assert quantize(torch.tensor([float("nan")]), name).isnan().all()


# ---------------------------------------------------------------- ml_dtypes

# (FloatFormat, ml_dtypes type, overflow policies that type implements, compare NaN inputs?)
ML_DTYPES_CASES = [
    # The MX formats: no inf, no NaN; overflow saturates. ml_dtypes turns NaN into -0
    # (it has no NaN to keep); lowprec keeps NaN in the wider output dtype, so NaN
    # inputs are left out. Without inf or NaN both policies saturate.
    (FloatFormat(3, 2, special="finite"), ml_dtypes.float6_e3m2fn, ("saturate", "inf"), False),
    (FloatFormat(2, 3, special="finite"), ml_dtypes.float6_e2m3fn, ("saturate", "inf"), False),
    (FloatFormat(2, 1, special="finite"), ml_dtypes.float4_e2m1fn, ("saturate", "inf"), False),
    # ml_dtypes' fp8 casts do not saturate: overflow goes to inf (IEEE-style) or NaN (fn).
    (FloatFormat(4, 3, special="fn"), ml_dtypes.float8_e4m3fn, ("inf",), True),
    (FloatFormat(5, 2), ml_dtypes.float8_e5m2, ("inf",), True),
    # IEEE-style E4M3 (bias 7, max 240, has inf) and E3M4 (bias 3, max 15.5).
    (FloatFormat(4, 3, special="ieee"), ml_dtypes.float8_e4m3, ("inf",), True),
    (FloatFormat(3, 4, special="ieee"), ml_dtypes.float8_e3m4, ("inf",), True),
    # Not compared: float8_e4m3fnuz / e5m2fnuz / e4m3b11fnuz (no negative zero, the
    # NaN is 0x80: a convention FloatFormat does not model) and float8_e8m0fnu (unsigned).
]


@pytest.mark.parametrize("fmt,mltype,policies,with_nan", ML_DTYPES_CASES, ids=lambda v: str(v))
def test_generic_formats_match_ml_dtypes(fmt, mltype, policies, with_nan, same_bits):
    x = torch.cat(
        [
            binade_sweep()[:: 1 << 4],
            torch.from_numpy(edge_values(fmt)),
            torch.tensor(SPECIALS, dtype=torch.float32),
        ]
    )
    if not with_nan:
        x = x[~x.isnan()]
    with np.errstate(invalid="ignore", over="ignore"):
        want = torch.from_numpy(x.numpy().astype(mltype).astype(np.float32))
    for overflow in policies:
        got = quantize(x, fmt, overflow=overflow)
        same_bits(got, want, x, f"{fmt.name}/{overflow} vs ml_dtypes.{mltype.__name__}")


# ---------------------------------------------------------------- float64 model, any format


def structured_inputs(fmt: FloatFormat, n: int, seed: int) -> np.ndarray:
    """Random grid values of ``fmt``, the ties above them and FP32 neighbours of both."""
    rng = np.random.default_rng(seed)
    exps = rng.integers(fmt.min_exp - 1, fmt.max_exp + 2, n)  # min_exp - 1 stands for subnormals
    mant = rng.integers(0, 1 << fmt.man_bits, n) / (1 << fmt.man_bits)
    lead = np.where(exps < fmt.min_exp, 0.0, 1.0)
    exps = np.maximum(exps, fmt.min_exp)
    v = (lead + mant) * 2.0**exps
    spacing = 2.0 ** (exps - fmt.man_bits)
    points = [v]
    if fmt.man_bits < 23:
        points.append(v + spacing / 2)  # ties; exact in FP32 as the format has < 24 bits
    wide = np.concatenate(points)
    wide = wide[wide <= np.finfo(np.float32).max]
    return np.concatenate([with_fp32_neighbours(wide), with_fp32_neighbours(SPECIALS)]).astype(np.float32)


def sweep_formats():
    for exp_bits in range(2, 9):
        for man_bits in [0, 1, 2, 3, 5, 7, 10, 16, 23]:
            for special in ["ieee", "fn", "finite"]:
                try:
                    yield FloatFormat(exp_bits, man_bits, special=special)
                except ValueError:
                    pass  # e.g. 'fn' without mantissa bits, or beyond FP32's range
    yield FloatFormat(5, 2, bias=20)
    yield FloatFormat(4, 3, bias=11, special="fn")
    yield FloatFormat(3, 2, bias=-2, special="finite")


def test_generic_sweep_matches_model(same_bits):
    """Every exponent width, a spread of mantissa widths and all three special-value conventions."""
    base = binade_sweep()[:: 1 << 8].numpy()
    count = 0
    for i, fmt in enumerate(sweep_formats()):
        x_np = np.concatenate([base, structured_inputs(fmt, 2000, seed=i)])
        x = torch.from_numpy(x_np)
        for overflow in ["saturate", "inf"]:
            want = torch.from_numpy(rne_model(x_np, fmt, overflow).astype(np.float32))
            same_bits(quantize(x, fmt, overflow=overflow), want, x, f"{fmt.name}/{overflow}")
            count += 1
    assert count > 250


@settings(max_examples=300, deadline=None)
@given(
    x=st.floats(width=32, allow_nan=True, allow_infinity=True),
    exp_bits=st.integers(2, 8),
    man_bits=st.integers(0, 23),
    special=st.sampled_from(["ieee", "fn", "finite"]),
    overflow=st.sampled_from(["saturate", "inf"]),
)
def test_property_matches_model(x, exp_bits, man_bits, special, overflow):
    try:
        fmt = FloatFormat(exp_bits, man_bits, special=special)
    except ValueError:
        return
    xt = torch.tensor([x], dtype=torch.float32)
    got = quantize(xt, fmt, overflow=overflow).item()
    want = float(rne_model(np.array([x], dtype=np.float32), fmt, overflow)[0])
    assert (got == want and np.signbit(got) == np.signbit(want)) or (np.isnan(got) and np.isnan(want)), (
        f"{fmt.name}/{overflow}: x={x!r} got {got!r} want {want!r}"
    )


def test_model_agrees_with_torch(same_bits):
    """The float64 model is itself checked against torch on the named formats."""
    x = inputs_for("e5m2")[:: 1 << 5]
    for name in TORCH_DTYPE:
        for overflow in ["saturate", "inf"]:
            want = torch.from_numpy(rne_model(x.numpy(), parse_format(name), overflow).astype(np.float32))
            same_bits(torch_oracle(x, name, overflow), want, x, f"model vs torch {name}/{overflow}")


# ---------------------------------------------------------------- the API


def test_bad_arguments():
    x = torch.ones(4)
    with pytest.raises(TypeError):
        quantize(torch.ones(4, dtype=torch.int32), "e5m2")
    with pytest.raises(TypeError):
        quantize(torch.ones(4, dtype=torch.float64), "e5m2")
    with pytest.raises(TypeError):
        quantize([1.0, 2.0], "e5m2")
    with pytest.raises(TypeError):
        quantize(x, "e5m2", offset=1.5)
    # no silent wrap-around or truncation of the stream's key, no NaN from a bad scale
    with pytest.raises(ValueError, match="offset must be in"):
        quantize(x, "e5m2", "stochastic", offset=2**32)
    with pytest.raises(TypeError, match="seed must be an int"):
        quantize(x, "e5m2", "stochastic", seed=1.5)
    with pytest.raises(ValueError, match="seed must be a 64-bit int"):
        quantize(x, "e5m2", "stochastic", seed=2**63)
    for scale in (0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            quantize(x, "e5m2", scale=scale)
    with pytest.raises(ValueError, match="scale must be a normal float32 number"):
        quantize(x, "e5m2", scale=1e-50)  # 0 in FP32

    with pytest.raises(ValueError, match="rounding"):
        quantize(x, "e5m2", "up")
    with pytest.raises(ValueError, match="overflow"):
        quantize(x, "e5m2", overflow="wrap")
    with pytest.raises(ValueError, match="valid names"):
        quantize(x, "e5m3x")
    # formats whose values the tensor's dtype cannot hold exactly
    for fmt, dtype in [
        ("fp16", torch.bfloat16),
        ("bf16", torch.float16),
        ("fp32", torch.float16),
        ("e8m3", torch.float16),
    ]:
        with pytest.raises(ValueError, match="cannot hold"):
            quantize(x.to(dtype), fmt)


def test_numpy_scalars_are_numbers():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    want = quantize(x, "e5m2", "stochastic", seed=5, offset=3, scale=2.0)
    got = quantize(x, "e5m2", "stochastic", seed=np.int64(5), offset=np.int32(3), scale=np.float32(2.0))
    assert torch.equal(got, want)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), ()])
def test_empty_and_scalar(shape, rounding):
    x = torch.full(shape, 1.3)
    for dtype in [torch.float32, torch.float16, torch.bfloat16]:
        got = quantize(x.to(dtype), "e5m2", rounding)
        assert got.shape == x.shape and got.dtype == dtype
        if x.numel():
            assert got.item() in (1.25, 1.5)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_layout_does_not_matter(rounding, same_bits):
    """Element indices are row-major in the logical shape: strides never change a result."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, 4, 3, generator=g) * 100
    views = {
        "transposed": base.transpose(0, 3),
        "permuted": base.permute(2, 0, 3, 1),
        "strided slice": base[::2, 1:, ::3],
        "expanded": base[:1, :1].expand(6, 5, 4, 3),
        "channels_last": base.contiguous(memory_format=torch.channels_last),
    }
    for what, view in views.items():
        before = view.clone()
        got = quantize(view, "e5m2", rounding, seed=7)
        same_bits(got, quantize(view.contiguous(), "e5m2", rounding, seed=7), view, what)
        assert got.is_contiguous(), what
        same_bits(view, before, view, f"{what}: input modified")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_any_shape(rounding, same_bits):
    flat = torch.randn(2 * 3 * 5 * 7 * 2, generator=torch.Generator().manual_seed(1))
    want = quantize(flat, "e4m3", rounding, seed=3)
    for shape in [(2, 3, 5, 7, 2), (210, 2), (1, 420), (420, 1, 1)]:
        same_bits(quantize(flat.view(shape), "e4m3", rounding, seed=3).reshape(-1), want, flat, str(shape))


def test_scale(same_bits):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 1e-3
    for s in [2.0**10, 3.0, 1000.0]:
        got = quantize(x, "e5m2", scale=s)
        same_bits(got, quantize(x * s, "e5m2") / s, x, f"scale {s}")
        same_bits(quantize(x, "e5m2", scale=torch.tensor(s)), got, x, f"scale {s} as tensor")
    # a power-of-two scale moves the subnormal range: 2**-20 is below e5m2's min subnormal
    tiny = torch.tensor([2.0**-20, 3 * 2.0**-22])
    assert quantize(tiny, "e5m2").tolist() == [0.0, 0.0]
    assert quantize(tiny, "e5m2", scale=2.0**8).tolist() == tiny.tolist()


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_a_scale_tensor_is_checked_as_strictly_as_a_number(scale):
    """A zero or NaN scale tensor used to return all NaN; the number was refused."""
    x = torch.randn(8)
    with pytest.raises(ValueError, match="scale must be"):
        quantize(x, "e5m2", scale=scale)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        quantize(x, "e5m2", scale=torch.tensor(scale))


def test_integer_scale_tensors_and_float_seed_tensors_are_refused():
    x = torch.randn(8)
    with pytest.raises(TypeError, match="a scale tensor must be a float tensor"):
        quantize(x, "e5m2", scale=torch.tensor(2))
    with pytest.raises(TypeError, match="a seed tensor must be a 0-dim integer tensor, got torch.float32"):
        quantize(x, "e5m2", "stochastic", seed=torch.tensor(3.7))  # used to be truncated to 3


def test_large_inputs_run_one_compiled_kernel_with_the_same_bits(monkeypatch):
    """From COMPILED_NUMEL elements the direct API rounds to nearest in a kernel Inductor
    compiles from the reference ops: the bits are the reference's, strided input too."""
    from lpcompile.numerics import quantize as ops

    used = []
    compiled = ops._compiled_kernel

    def spy(fmt, rounding, *variant):
        used.append((fmt, rounding))
        return compiled(fmt, rounding, *variant)

    monkeypatch.setattr(ops, "_compiled_kernel", spy)
    x = torch.randn(1024, ops.COMPILED_NUMEL // 1024, generator=torch.Generator().manual_seed(0)) * 100
    for value in (x, x.t()):
        got = quantize(value, "e5m2")
        assert torch.equal(got.view(torch.int32), ops.quantize_reference(value, "e5m2").view(torch.int32))
    assert used == [("e5m2", "nearest")] * 2
    quantize(x[:2], "e5m2")  # small: the operator, op by op
    assert used == [("e5m2", "nearest")] * 2
