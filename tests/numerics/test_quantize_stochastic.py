"""Stochastic rounding: the two neighbours, unbiasedness, determinism."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from lpcompile import FloatFormat, parse_format, quantize
from lpcompile.numerics import quantize as ops
from lpcompile.numerics import rng

pytestmark = pytest.mark.usefixtures("single_thread")

FP8 = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}


def neighbours(x: torch.Tensor, fmt: FloatFormat, overflow: str):
    """(lo, hi, p): the grid neighbours of each ``x`` by magnitude (lo towards zero) and the
    probability of ``hi``, computed in float64; lo == hi and p == 0 on the grid.
    Overflow maps a neighbour past max to max ('saturate') or inf/NaN ('inf')."""
    with np.errstate(all="ignore"):
        xd = x.double().numpy()
        ax = np.abs(xd)
        _, e = np.frexp(ax)
        spacing = np.ldexp(1.0, np.maximum(e - 1, fmt.min_exp) - fmt.man_bits)
        lo = np.floor(ax / spacing) * spacing
        p = (ax - lo) / spacing
        hi = np.where(p > 0, lo + spacing, lo)
    if overflow == "saturate" or fmt.special == "finite":
        over = fmt.max
    else:
        over = np.inf if fmt.has_inf else np.nan
    lo, hi = (np.where(np.isinf(ax) | (v > fmt.max), over, v) for v in (lo, hi))
    lo, hi = (np.where(np.isnan(xd), np.nan, np.copysign(v, xd)) for v in (lo, hi))
    return torch.from_numpy(lo), torch.from_numpy(hi), torch.from_numpy(np.nan_to_num(p))


def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise equality that tells -0 from +0 and calls NaN equal to NaN."""
    return ((a == b) & (torch.signbit(a) == torch.signbit(b))) | (a.isnan() & b.isnan())


def assert_in_neighbours(got, x, fmt, overflow, label):
    lo, hi, _ = neighbours(x, fmt, overflow)
    g = got.double()
    ok = same(g, lo) | same(g, hi)
    bad = torch.nonzero(~ok).reshape(-1)
    assert bad.numel() == 0, f"{label}: {bad.numel()} of {x.numel()} outside {{lo, hi}}, e.g. " + ", ".join(
        f"x={x[i].item()!r} got {got[i].item()!r} lo={lo[i].item()!r} hi={hi[i].item()!r}"
        for i in bad[:6].tolist()
    )


def sweep_inputs(fmt: FloatFormat, n: int = 1 << 17, seed: int = 0) -> torch.Tensor:
    """Random FP32 values over every binade of ``fmt`` and beyond, its grid values and specials."""
    g = torch.Generator().manual_seed(seed)
    exps = torch.randint(fmt.min_exp - fmt.man_bits - 3, fmt.max_exp + 3, (n,), generator=g)
    x = (torch.rand(n, generator=g, dtype=torch.float64) + 1) * torch.pow(2.0, exps.double())
    x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x).float()
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, fmt.max, -fmt.max, fmt.min_subnormal])
    return torch.cat([x, specials, torch.full((8,), fmt.min_subnormal / 2)])


FORMATS = [
    "e5m2",
    "e4m3",
    "fp16",
    "bf16",
    FloatFormat(3, 2, special="finite"),
    FloatFormat(4, 3, special="ieee"),
]


@pytest.mark.parametrize("overflow", ["saturate", "inf"])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_output_is_a_neighbour(fmt, overflow):
    fmt = parse_format(fmt)
    x = sweep_inputs(fmt)
    for seed in [0, 12345]:
        got = quantize(x, fmt, "stochastic", seed=seed, overflow=overflow)
        assert_in_neighbours(got, x, fmt, overflow, f"{fmt.name}/{overflow}/seed {seed}")


@pytest.mark.parametrize("name", ["e5m2", "e4m3"])
def test_neighbours_match_torch_codes(name):
    """The float64 neighbours used above agree with torch's fp8 codes: lo, hi = codes c, c + 1."""
    codes = torch.arange(0, 0x7B if name == "e5m2" else 0x7E, dtype=torch.uint8)
    lo = codes.view(FP8[name]).float()
    hi = (codes + 1).view(FP8[name]).float()
    frac = torch.tensor([0.0, 0.25, 0.5, 0.999])
    x = (lo[:, None] + (hi - lo)[:, None] * frac).reshape(-1)
    mlo, mhi, p = neighbours(x, parse_format(name), "inf")
    assert torch.equal(mlo.float(), lo.repeat_interleave(4))
    want_hi = torch.where(frac == 0, lo[:, None], hi[:, None]).reshape(-1)
    assert torch.equal(mhi.float(), want_hi)
    assert torch.allclose(p.float(), frac.repeat(len(codes)))


@pytest.mark.parametrize("name", ["e5m2", "e4m3", "fp16"])
def test_grid_values_unchanged(name):
    if name == "fp16":
        grid = (
            torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
        )
    else:
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8[name]).float()
    grid = grid[grid.isfinite()]
    for seed in range(5):
        got = quantize(grid, name, "stochastic", seed=seed, overflow="inf")
        assert same(got, grid).all(), f"{name}: {grid[~same(got, grid)][:8].tolist()}"


# (format, value, overflow): e5m2 normals, subnormals (spacing 2**-16), near max,
# negatives, past max, e4m3 and the 16-bit formats' subnormals.
SR_CASES = [
    ("e5m2", 1.3, "saturate"),
    ("e5m2", 3.1416, "saturate"),
    ("e5m2", 1000.7, "saturate"),
    ("e5m2", -1.3, "saturate"),
    ("e5m2", 3.3 * 2**-16, "saturate"),
    ("e5m2", 0.7 * 2**-16, "saturate"),
    ("e5m2", -0.5 * 2**-16, "saturate"),
    ("e5m2", 1.9 * 2**-15, "saturate"),  # subnormal, just below the smallest normal
    ("e5m2", 55000.0, "saturate"),  # between 49152 and max 57344
    ("e5m2", -55000.0, "saturate"),
    ("e5m2", 60000.0, "inf"),  # between max and the (virtual) next value: max or inf
    ("e4m3", 1.3, "saturate"),
    ("e4m3", 0.01, "saturate"),  # subnormal (< 2**-6)
    ("e4m3", -430.0, "saturate"),
    ("e4m3", 460.0, "inf"),  # max 448 or NaN (no inf)
    ("fp16", 1.0001, "saturate"),
    ("fp16", 3.3 * 2**-24, "saturate"),  # fp16 subnormal
    ("bf16", 1.001, "saturate"),
    ("bf16", 1.3e-39, "saturate"),  # bf16 and FP32 subnormal
    (FloatFormat(2, 1, special="finite"), 2.6, "inf"),  # MX FP4: 2 or 3
]


@pytest.mark.parametrize("fmt,value,overflow", SR_CASES, ids=str)
def test_unbiased(fmt, value, overflow):
    """Same value repeated: the element index gives each its own bits. Binomial test on hi."""
    fmt = parse_format(fmt)
    n = 20_000
    x = torch.full((n,), value)
    got = quantize(x, fmt, "stochastic", seed=2024, overflow=overflow)
    assert_in_neighbours(got, x, fmt, overflow, f"{fmt.name} {value}")
    lo, hi, p = (t[0].item() for t in neighbours(x[:1], fmt, overflow))
    assert 0.0 < p < 1.0 and lo != hi, (lo, hi, p)
    k = int(same(got.double(), torch.tensor(hi, dtype=torch.float64)).sum())
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(k - n * p) <= 5 * sigma, (
        f"{fmt.name} {value}: {k} of {n} up, expected {n * p:.1f} +- {sigma:.1f}"
    )


@pytest.mark.parametrize("name", ["e5m2", "e4m3", "bf16"])
def test_unbiased_across_binades(name):
    """One sample each of many different values: sum(up - p) ~ N(0, sum p(1-p))."""
    fmt = parse_format(name)
    x = sweep_inputs(fmt, n=1 << 18, seed=5)
    x = x[x.isfinite() & (x.abs() < fmt.max)]
    lo, hi, p = neighbours(x, fmt, "saturate")
    got = quantize(x, fmt, "stochastic", seed=99).double()
    up = same(got, hi) & (p > 0)
    for region, mask in [("subnormal", x.abs() < fmt.min_normal), ("normal", x.abs() >= fmt.min_normal)]:
        excess = (up[mask].double() - p[mask]).sum().item()
        sigma = math.sqrt((p[mask] * (1 - p[mask])).sum().item())
        assert mask.sum() > 1000 and abs(excess) <= 5 * sigma, (
            f"{name} {region}: excess {excess:.1f}, sigma {sigma:.1f}"
        )


def test_special_values():
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e6, -1e6])
    sat = quantize(x, "e5m2", "stochastic", seed=1)
    assert sat[0].isnan()
    assert sat[1:].tolist() == [57344.0, -57344.0, 0.0, -0.0, 57344.0, -57344.0]
    assert torch.signbit(sat[4])
    inf = quantize(x, "e5m2", "stochastic", seed=1, overflow="inf")
    assert inf[1:3].tolist() == [math.inf, -math.inf] and inf[5:].tolist() == [math.inf, -math.inf]
    fn = quantize(x, "e4m3", "stochastic", seed=1, overflow="inf")
    assert fn[[0, 1, 2, 5, 6]].isnan().all()


def test_16bit_inputs():
    g = torch.Generator().manual_seed(3)
    for dtype in [torch.float16, torch.bfloat16]:
        x = (torch.randn(50_000, generator=g) * 4).to(dtype)
        got = quantize(x, "e5m2", "stochastic", seed=4)
        assert got.dtype == dtype
        assert_in_neighbours(got.float(), x.float(), parse_format("e5m2"), "saturate", str(dtype))
        # the same bits as for the FP32 copy: rounding happens in FP32 either way
        assert torch.equal(got.float(), quantize(x.float(), "e5m2", "stochastic", seed=4))


# ---------------------------------------------------------------- determinism


def half_way_values(n=4096):
    """Values exactly half-way between e5m2 neighbours: each rounding is a fair coin."""
    return torch.full((n,), 1.125)


def differing(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).double().mean().item()


def test_reproducible():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    for seed, offset in [(0, 0), (1, 0), (2**40 + 3, 17), (-5, 2**31 - 1)]:
        a = quantize(x, "e5m2", "stochastic", seed=seed, offset=offset)
        b = quantize(x.clone(), "e5m2", "stochastic", seed=seed, offset=offset)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (seed, offset)


def test_seed_and_offset_change_the_bits():
    x = half_way_values()
    base = quantize(x, "e5m2", "stochastic", seed=0, offset=0)
    others = {
        "seed 1": quantize(x, "e5m2", "stochastic", seed=1),
        "seed 2**32": quantize(x, "e5m2", "stochastic", seed=2**32),  # differs only in the high word
        "seed -1": quantize(x, "e5m2", "stochastic", seed=-1),
        "offset 1": quantize(x, "e5m2", "stochastic", offset=1),
        "offset 2**31 - 1": quantize(x, "e5m2", "stochastic", offset=2**31 - 1),
    }
    for what, other in others.items():
        assert 0.4 < differing(base, other) < 0.6, what  # independent fair coins differ half the time
    assert 0.4 < differing(others["seed 1"], others["offset 1"]) < 0.6


def test_index_gives_independent_bits():
    x = half_way_values(1 << 16)
    got = quantize(x, "e5m2", "stochastic", seed=11)
    up = (got == 1.25).double()
    assert abs(up.mean().item() - 0.5) < 5 * 0.5 / math.sqrt(up.numel())
    # neighbouring elements are not correlated
    corr = torch.corrcoef(torch.stack([up[:-1], up[1:]]))[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(up.numel())
    # a prefix of a tensor rounds as the tensor's first elements: bits depend on the index only
    assert torch.equal(quantize(x[:1000], "e5m2", "stochastic", seed=11), got[:1000])


@pytest.mark.parametrize("seed", [0, 7, 2**32 + 1, 2**62 + 12345, -1, -(2**40)])
def test_seed_int_or_tensor(seed):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    a = quantize(x, "e4m3", "stochastic", seed=seed, offset=3)
    b = quantize(x, "e4m3", "stochastic", seed=torch.tensor(seed, dtype=torch.int64), offset=3)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_sr_subnormal_spacing_below_fp32_normal_range():
    """A spacing below 2**-127 needs its reciprocal in two FP32 factors (no inf·0 = NaN)."""
    fmt = FloatFormat(7, 23, bias=126)
    assert fmt.min_subnormal == 2.0**-148
    x = torch.tensor([0.0, -0.0, 2.0**-148, 3 * 2.0**-149, 2.0**-130, 1.0])
    y = quantize(x, fmt, "stochastic", seed=3)
    assert not y.isnan().any()
    assert torch.equal(y[[0, 2, 4, 5]], x[[0, 2, 4, 5]]) and y[1].signbit()
    assert y[3].item() in (2.0**-148, 2 * 2.0**-148)


# ---------------------------------------------------------------- large inputs: one compiled kernel


def reference(x, fmt, seed, offset=0, scale=None, overflow="saturate"):
    """The operator's reference, op by op."""
    seed = seed if isinstance(seed, torch.Tensor) else torch.tensor(seed)
    scale = scale if scale is None or isinstance(scale, torch.Tensor) else torch.tensor(scale)
    return ops.quantize_reference(x, parse_format(fmt).name, "stochastic", overflow, seed, offset, scale)


def shaped(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "transposed":
        return x[: x.numel() // 8 * 8].view(8, -1).t()
    if layout == "strided":
        return torch.stack([x, -x], dim=1).reshape(-1)[::2]
    return x


LARGE_CASES = [  # each compiles once (seconds)
    pytest.param(
        "e5m2",
        torch.float32,
        torch.tensor(-(2**40) - 7),
        2**32 - 1,
        None,
        "saturate",
        "transposed",
        id="e5m2-tensor-seed-transposed",
    ),
    pytest.param("e4m3", torch.bfloat16, 5, 3, 3.0, "saturate", "strided", id="e4m3-bf16-scaled-strided"),
    pytest.param(
        FloatFormat(3, 2, special="finite"),
        torch.float16,
        7,
        1,
        torch.tensor(0.25),
        "inf",
        "contiguous",
        id="e3m2fn-fp16-scale-tensor",
    ),
    pytest.param("bf16", torch.float32, 0, 2**31, None, "inf", "contiguous", id="bf16-inf"),
]


@pytest.mark.parametrize("fmt,dtype,seed,offset,scale,overflow,layout", LARGE_CASES)
def test_large_inputs_have_the_operators_bits(
    fmt, dtype, seed, offset, scale, overflow, layout, monkeypatch, same_bits
):
    """From COMPILED_NUMEL elements the direct API runs a compiled kernel of the reference
    ops, keyed by the element's row-major index in the whole tensor: the same bits."""
    monkeypatch.setattr(ops, "COMPILED_NUMEL", 4096)
    x = shaped(sweep_inputs(parse_format(fmt), n=5003, seed=8).to(dtype), layout)
    assert x.numel() >= ops.COMPILED_NUMEL
    with monkeypatch.context() as patch:
        patch.setattr(rng, "index_bits", None)  # the bits come from the kernel, not op by op
        got = quantize(x, fmt, "stochastic", seed=seed, offset=offset, scale=scale, overflow=overflow)
    same_bits(got, reference(x, fmt, seed, offset, scale, overflow), x, f"{fmt} {dtype} {layout}")


def bitwise_ops_over(numel: int, fn) -> set[str]:
    """The names of the ATen bitwise ops that ``fn`` runs eagerly on ``numel`` elements or more."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return {
        event.name
        for event in prof.events()
        if "bitwise" in event.name and any(math.prod(shape) >= numel for shape in event.input_shapes if shape)
    }


def test_from_the_threshold_the_rounding_is_compiled(monkeypatch, same_bits):
    """At COMPILED_NUMEL elements (here one more: an odd length) no bitwise op runs over
    the whole tensor, nor ``rng.index_bits``: the kernel computes the bits. The operator,
    op by op, does both."""
    x = torch.randn(ops.COMPILED_NUMEL + 1, generator=torch.Generator().manual_seed(4)) * 100
    seed = torch.tensor(12)
    op_by_op = functools.partial(
        torch.ops.lowprec.quantize, x, "e5m2", "stochastic", "saturate", seed, 9, None
    )
    assert bitwise_ops_over(x.numel(), op_by_op)  # the check sees the op-by-op path
    want = op_by_op()
    with monkeypatch.context() as patch:
        patch.setattr(rng, "index_bits", None)
        got = quantize(x, "e5m2", "stochastic", seed=seed, offset=9)
        for rounding in ("stochastic", "nearest"):
            direct = functools.partial(quantize, x, "e5m2", rounding, seed=seed, offset=9)
            direct()  # compiled before the profile
            assert not bitwise_ops_over(x.numel(), direct), rounding
    same_bits(got, want, x, "at the threshold")


def test_one_compile_for_any_length_seed_offset_and_grad_mode(monkeypatch, same_bits):
    """Length and offset are symbolic, the seed a tensor: new lengths, seeds and offsets,
    views or not, gradients on or off reuse the kernel. A gradient passes straight through."""
    monkeypatch.setattr(ops, "COMPILED_NUMEL", 4096)
    x = torch.randn(30_000, generator=torch.Generator().manual_seed(5)) * 100
    quantize(x[:5000], "e4m3", "stochastic", seed=3, offset=2)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    calls = [(x[:4096], 0, 0), (x[1:7001], 1, 1), (x.clone(), torch.tensor(-9), 2**32 - 1)]
    for value, seed, offset in calls:
        got = quantize(value, "e4m3", "stochastic", seed=seed, offset=offset)
        same_bits(got, reference(value, "e4m3", seed, offset), value, f"{value.numel()} {seed} {offset}")
    with torch.no_grad():
        quantize(x[:6000], "e4m3", "stochastic", seed=4)
    leaf = x[:5000].clone().requires_grad_()
    grad = torch.randn(5000)
    quantize(leaf, "e4m3", "stochastic", seed=5).backward(grad)
    assert torch.equal(leaf.grad, grad)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
