"""Generated Triton (interpreted on CPU, compiled on a GPU) against the reference ops, bit for bit.

Each test traces a small function to an ATen graph, runs ``fuse_lowprec_kernels``
on it and compares the fused graph's outputs with the same function run eagerly
(the reference operators of ``lpcompile.numerics.quantize`` and plain ATen ops). Shapes are
small (the interpreter costs ~0.7 us per element) and not multiples of the block.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import edge_values, fuse, interpreted, small_blocks, ulp_distance  # noqa: F401
from devices import TEST_DEVICE, on_test_device
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from lpcompile.codegen import CodegenDeviceError, fuse_lowprec_kernels, triton_ops
from lpcompile.numerics.formats import parse_format
from lpcompile.numerics.predict import predict_weight
from lpcompile.numerics.quantize import quantize_reference
from lpcompile.numerics.scale_grad import gradient_stats

pytestmark = pytest.mark.usefixtures("interpreted", "small_blocks", "single_thread")

Q = torch.ops.lowprec.quantize
QG = torch.ops.lowprec.quantize_grad
SEED = torch.tensor(0x1234_5678_9ABC_DEF0 - (1 << 63), dtype=torch.int64)

# Every kind of format the reference supports: IEEE inf/NaN, fn (no inf), finite,
# no mantissa bits, no subnormal branch (bf16, fp32), a non-default bias, and one
# whose subnormal constants leave FP32's range (e7m23-bias126).
FORMATS = [
    "e5m2", "e4m3", "fp16", "bf16", "fp32", "e3m2-finite", "e2m1-finite", "e4m3-ieee",
    "e5m2fn", "e8m0", "e6m9", "e5m2-bias16", "e7m23-bias126",
]  # fmt: skip


@pytest.mark.parametrize("overflow", ["saturate", "inf"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_alone_is_bit_identical(fmt, rounding, overflow, same_bits):
    x = edge_values(parse_format(fmt), random=3000, seed=len(fmt)).reshape(-1)[:2982].reshape(7, 3, -1)

    def f(x, seed):
        return Q(x, fmt, rounding, overflow, seed, 77, None)

    gm, kernels = fuse(f, x, SEED)
    assert len(kernels) == 1 and kernels[0].nodes == ["quantize"] and kernels[0].exact
    same_bits(gm(x, SEED), f(x, SEED), x, f"{fmt} {rounding} {overflow}")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_with_scale_and_short_inputs(rounding, same_bits):
    """A scale argument, FP16/BF16 inputs (the result cast rounds), 0-dim, empty and strided inputs."""
    fmt = parse_format("e4m3")
    base = edge_values(fmt, random=2000, seed=3)[:2000]
    scale = torch.tensor(3.0)

    def f(x, seed, s):
        return Q(x, "e4m3", rounding, "saturate", seed, 5, s)

    for x in (
        base.reshape(40, 50),
        base.to(torch.float16).reshape(40, 50),
        base.to(torch.bfloat16).reshape(40, 50),
        base.reshape(40, 50).t(),  # non-contiguous
        base.reshape(40, 50)[::3, 1::2],  # strided view
        base[:0].reshape(0, 7),  # empty
        base[7].reshape(()),  # 0-dim
    ):
        gm, kernels = fuse(f, x, SEED, scale)
        assert len(kernels) == 1
        expected = f(x, SEED, scale)
        out = gm(x, SEED, scale)
        same_bits(out, expected, x.to(torch.float32), f"{x.dtype} {tuple(x.shape)} {x.stride()}")
        # a contiguous input at run time where a strided one was traced, and the reverse
        if not x.is_contiguous():
            other = x.contiguous()
        else:
            other = x.mT.contiguous().mT if x.dim() == 2 and x.numel() else x
            assert other.dim() < 2 or not other.numel() or not other.is_contiguous()
        same_bits(gm(other, SEED, scale), expected, x.to(torch.float32), "relayout")


@pytest.mark.parametrize("shape", [(1,), (1023,), (1025,), (3, 1, 700), (2, 3, 4, 5, 6), (4096, 2)])
def test_quantize_shapes_around_the_block(shape, same_bits):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 1e-3

    def f(x, seed):
        return Q(x, "e5m2", "stochastic", "inf", seed, 1, None), (x * 2).sum()

    gm, kernels = fuse(f, x, SEED)
    assert len(kernels) == 1
    (q, total), (ref_q, ref_total) = gm(x, SEED), f(x, SEED)
    same_bits(q, ref_q, x, str(shape))
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-6)


def test_bias_add_relu_activation_quantize_is_one_kernel(same_bits):
    x = torch.randn(33, 70) * 4
    x.view(-1)[:6] = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1e-42])
    b = torch.randn(70)

    def f(h, b):
        r = F.relu(QG(h, "e5m2", "nearest", "inf", None, 1) + b)
        return r, Q(r, "e4m3", "nearest", "saturate", None, 2, None)

    gm, kernels = fuse(f, x, b)
    assert len(kernels) == 1
    assert set(kernels[0].nodes) == {"quantize_grad", "add", "relu", "quantize"}
    assert kernels[0].outputs == ["relu", "quantize"]
    for got, want in zip(gm(x, b), f(x, b), strict=True):
        same_bits(got, want, x, "bias+relu+quantize")


def test_weight_gradient_quantize_and_unscale_is_one_kernel(same_bits):
    """quantize(g) * (1/s) and the inf/NaN count of the quantized gradient: one read, one write."""
    g = (torch.randn(50, 90) * 2e4).t()  # transposed, as the AOT graph's weight gradient
    g[3, 4], g[5, 6] = float("inf"), float("nan")
    inv = torch.tensor(1 / 64)

    def f(g, inv, seed):
        q = Q(g, "e5m2", "stochastic", "inf", seed, 11, None)
        return q * inv, (~torch.isfinite(q)).sum().to(torch.float32)

    gm, kernels = fuse(f, g, inv, SEED)
    assert len(kernels) == 1 and kernels[0].outputs == ["mul"] and len(kernels[0].reductions) == 1
    got, want = gm(g, inv, SEED), f(g, inv, SEED)
    same_bits(got[0], want[0], g, "unscaled weight gradient")
    assert got[1].item() == want[1].item() > 2  # the overflow count, exactly


def test_error_scale_quantize_histogram_is_one_kernel(same_bits):
    """The lowprec.scale_grad backward: statistics of g, then quantize(g * s), reading g once."""
    fmt = parse_format("e5m2")
    edges = edge_values(fmt, random=5000, seed=9)[:5000].reshape(100, 50) * 0.01
    s = torch.tensor(256.0)

    def f(g, s, seed):
        return gradient_stats(g, "histogram"), Q(g * s, "e5m2", "stochastic", "inf", seed, 3, None)

    gm, kernels = fuse(f, edges, s, SEED)
    assert len(kernels) == 1, [k.nodes for k in kernels]
    assert kernels[0].inputs[0] == "g_1" and kernels[0].inputs.count("g_1") == 1
    assert len(kernels[0].reductions) == 3  # histogram, sum, sum of squares
    for g in (edges, torch.randn(100, 50) * 1e-3):
        (stats, q), (ref_stats, ref_q) = gm(g, s, SEED), f(g, s, SEED)
        same_bits(q, ref_q, g, "scaled SR quantize")
        assert torch.equal(stats[:256], ref_stats[:256])  # the exponent histogram: exact counts
    # Sum and sum of squares (of values without cancellation): summed per program, then
    # across programs, not in torch's order: equal to a few ulp, not bit for bit.
    torch.testing.assert_close(stats[256:], ref_stats[256:], rtol=1e-5, atol=0)


def _predict_and_quantize(w, v, lr, mode):
    return Q(predict_weight(w, v, lr, 3, mode), "e4m3", "nearest", "saturate", None, 4, None)


def test_predicted_weight_quantize_is_one_kernel(same_bits):
    w, v = torch.randn(64, 48), torch.randn(64, 48)
    lr = torch.tensor(0.05)

    for mode in ("lwp_v", "lwp_w"):
        f = functools.partial(_predict_and_quantize, mode=mode)
        gm, kernels = fuse(f, w, v, lr)
        assert len(kernels) == 1 and len(kernels[0].inputs) == (3 if mode == "lwp_v" else 2)  # w, v (, lr)
        assert kernels[0].outputs == ["quantize"]  # the predicted weight itself is not written
        same_bits(gm(w, v, lr), f(w, v, lr), w, mode)


def _division_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Numerators and denominators from subnormal to huge, where an approximate division differs."""
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(61, 70, generator=gen) * torch.pow(2.0, torch.randint(-140, 120, (61, 70), generator=gen))
    d = torch.randn(61, 70, generator=gen) * torch.pow(2.0, torch.randint(-140, 127, (61, 70), generator=gen))
    d.view(-1)[:4] = torch.tensor([0.0, -0.0, float("inf"), 3.0])
    return a, d


def _divisions(a, d, s):
    q = Q(a / d, "e5m2", "nearest", "inf", None, 0, None)
    return a / d, q / 3.0, a / s


def test_division_rounds_as_aten_on_the_device(same_bits):
    """Tensor / tensor, / a Python number and / a 0-dim CPU tensor around a quantize, against
    ATen on the test device: IEEE division (``tl.div_rn``: a GPU's fast division is off by
    up to 2 ulp); on CUDA ATen multiplies by a CPU scalar's reciprocal, and so must the
    kernel (the interpreter run of that form: the next test)."""
    a, d = map(on_test_device, _division_inputs())
    s = torch.tensor(7.0)  # a CPU scalar on every test device
    gm = make_fx(_divisions, tracing_mode="fake")(a, d, s)
    ctx = SimpleNamespace(kernels=[])
    fuse_lowprec_kernels(gm, ctx)
    assert len(ctx.kernels) == 1 and "tl.div_rn(" in ctx.kernels[0].source
    for got, expected in zip(gm(a, d, s), _divisions(a, d, s), strict=True):
        same_bits(got.cpu(), expected.cpu(), a.cpu(), "division")


@pytest.mark.skipif(TEST_DEVICE.type == "cuda", reason="the CUDA form run in the interpreter")
def test_cpu_scalar_divisor_multiplies_by_its_reciprocal_on_cuda(monkeypatch, same_bits):
    """On CUDA, ATen computes ``x / s`` for a CPU scalar ``s`` (a Python number, a 0-dim CPU
    tensor) as ``x * (1 / s)``, the reciprocal rounded to FP32 on the host. The kernel source
    for fake CUDA tensors takes that form; the same form, made for the CPU here, runs in
    the interpreter and must equal that product bit for bit."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        cuda = torch.empty(61, 70, device="cuda")
        gm = make_fx(_divisions)(cuda, cuda, mode.from_tensor(torch.tensor(7.0)))
    ctx = SimpleNamespace(kernels=[])
    fuse_lowprec_kernels(gm, ctx)
    source = ctx.kernels[0].source
    assert "0.3333333432674408" in source and "tl.div_rn(1.0," in source  # float32(1 / 3), 1 / s
    assert source.count("tl.div_rn(") == 3  # the two a / d nodes stay divisions; 1 / s

    monkeypatch.setattr(triton_ops, "reciprocal_divisor", lambda device: True)
    a, d = _division_inputs()
    s = torch.tensor(7.0)
    gm, kernels = fuse(_divisions, a, d, s)
    assert len(kernels) == 1
    got = gm(a, d, s)
    same_bits(got[0], a / d, a, "tensor divisor")
    third = torch.tensor(1.0) / torch.tensor(3.0)
    same_bits(got[1], Q(a / d, "e5m2", "nearest", "inf", None, 0, None) * third, a, "Python number divisor")
    same_bits(got[2], a * (torch.tensor(1.0) / s), a, "0-dim tensor divisor")
    assert not torch.equal(got[2], a / s)  # the two forms differ by an ulp here and there


def test_gelu_group_within_ulp_bound(same_bits):
    """gelu is not bit-identical: ATen evaluates erf with its own vectorised polynomial (one
    per vector ISA), the interpreter (and a GPU) with another erf. Bounds on gelu's value
    before the quantize: 8 ulp for x >= -1 (measured 4 on AVX512 CPUs, 7 on AVX2 ones);
    everywhere |error| <= 2**-21 * |x|, i.e. a few ulp of erf's value near -1, where
    1 + erf(x / sqrt(2)) cancels and no relative bound holds (measured 3.3e-7 * |x|). The
    quantize after it is then exact on the kernel's own gelu values."""
    x = torch.linspace(-8, 8, 12003).reshape(3, -1)

    def f(x):
        y = F.gelu(x)
        return y, Q(y, "e5m2", "nearest", "saturate", None, 0, None)

    gm, kernels = fuse(f, x)
    assert len(kernels) == 1 and not kernels[0].exact
    (y, q), (ref_y, _) = gm(x), f(x)
    assert ulp_distance(y, ref_y)[x >= -1].max().item() <= 8
    assert ((y - ref_y).abs() <= 2.0**-21 * x.abs()).all()
    same_bits(q, quantize_reference(y, "e5m2"), x, "quantize after gelu")


def test_amax_reductions_are_exact():
    x = torch.randn(30, 41)
    x[2, 3] = -7.5

    def f(x):
        q = Q(x, "e4m3", "nearest", "saturate", None, 0, None)
        return q, torch.amax(torch.abs(x)), torch.amax(x), torch.amax(q - 100.0)

    gm, kernels = fuse(f, x)
    assert len(kernels) == 1 and len(kernels[0].reductions) == 3
    for got, want in zip(gm(x), f(x), strict=True):
        assert torch.equal(got, want)
    x[0, 0] = float("nan")
    assert all(v.isnan() for v in gm(x)[1:])


def test_a_reduction_read_by_a_pointwise_op_is_not_fused_with_it():
    """``q - q.sum()``: the sum exists only after the kernel, so its reader cannot be in
    the same kernel (this made a cycle and failed to compile)."""
    x = torch.randn(6, 7)

    def f(x, seed):
        q = Q(x, "e5m2", "stochastic", "inf", seed, 3, None)
        return q - q.sum()

    gm, kernels = fuse(f, x, SEED)
    assert kernels
    torch.testing.assert_close(gm(x, SEED), f(x, SEED), rtol=1e-6, atol=1e-6)  # the sum's order may differ


def test_negation_keeps_the_sign_of_zero(same_bits):
    """Triton's unary minus is 0 - x: -(+0.0) came out +0.0 where torch gives -0.0."""
    x = torch.tensor([0.0, 1e-9, -1e-9, 1.5, -0.0])

    def f(x, seed):
        return -Q(x, "e5m2", "stochastic", "inf", seed, 3, None)

    gm, kernels = fuse(f, x, SEED)
    assert len(kernels) == 1
    same_bits(gm(x, SEED), f(x, SEED), x, "neg")


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8])
def test_a_seed_of_any_integer_dtype(dtype, same_bits):
    x = torch.randn(40)
    seed = torch.tensor(123, dtype=dtype)

    def f(x, seed):
        return Q(x, "e5m2", "stochastic", "inf", seed, 3, None) * 2

    gm, kernels = fuse(f, x, seed)
    assert len(kernels) == 1
    same_bits(gm(x, seed), f(x, seed), x, str(dtype))


def test_addresses_past_two_to_the_31(same_bits):
    """A strided input whose addresses pass 2**31 elements (12 elements over 2 GiB of
    storage, never touched): the offsets are int64 (in int32 they wrapped, and crashed)."""
    stride = 2**30 + 16
    mask = torch.empty(2 * stride + 8, dtype=torch.bool).as_strided((3, 4), (stride, 1))
    mask.copy_(torch.tensor([[False] * 4, [True, False] * 2, [True] * 4]))
    x = torch.randn(3, 4)

    def f(x, mask):
        return torch.where(mask, Q(x, "e5m2", "nearest", "inf", None, 0, None), -1.0)

    gm, kernels = fuse(f, x, mask)
    assert len(kernels) == 1
    same_bits(gm(x, mask), f(x, mask), x, "strided mask")


def test_a_cpu_seed_joins_a_cuda_kernel(same_bits):
    """On a GPU the step's seed is a 0-dim CPU tensor: SR quantizes must fuse all the same
    (they did not: on CUDA every backward SR quantize stayed an unfused op). Traced with fake
    CUDA tensors, so the fusion is checked without a GPU; on one, the kernel runs too."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def f(x, seed):
        return Q(x, "e5m2", "stochastic", "inf", seed, 3, None) * 2

    with mode:
        gm = make_fx(f)(torch.empty(50, 30, device="cuda"), mode.from_tensor(SEED))
    ctx = SimpleNamespace(kernels=[])
    fuse_lowprec_kernels(gm, ctx)
    assert [k.inputs for k in ctx.kernels] == [["x_1", "seed_1"]]
    with pytest.raises(ValueError, match="compiled for cuda tensors"):
        gm(torch.randn(50, 30), SEED)  # the kernel made for CUDA, called with CPU tensors
    if TEST_DEVICE.type == "cuda":
        x = torch.randn(50, 30) * 1e-3
        same_bits(gm(x.cuda(), SEED).cpu(), f(x, SEED), x, "CPU seed, CUDA kernel")


def test_identity_only_regions_are_left_alone():
    def f(x):
        return QG(x, "e5m2", "nearest", "inf", None, 0) * 2

    _, kernels = fuse(f, torch.randn(4, 4))
    assert kernels == []


def test_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # unset already on a GPU run
    x = torch.randn(8)
    gm = make_fx(lambda x: Q(x, "e5m2", "nearest", "inf", None, 0, None))(x)
    with pytest.raises(CodegenDeviceError, match="TRITON_INTERPRET=1"):
        fuse_lowprec_kernels(gm, None)
