"""The operators under torch.compile, opcheck, and their gradients.

Inductor compiles cost seconds each on these CPUs, so one compiled function
covers many cases (formats, roundings, layouts, a 16-bit input and a backward).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from devices import TEST_DEVICE
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

import lpcompile  # noqa: F401  (registers torch.ops.lowprec)
from lpcompile import quantize

q = torch.ops.lowprec.quantize
qg = torch.ops.lowprec.quantize_grad


@pytest.fixture(autouse=True)
def no_stale_aot_cache():
    """AOTAutograd's cache keys on the graph *before* our decompositions and autograd
    formulas are applied, so after an edit to lpcompile/ops.py it can serve a stale
    compiled graph (seen: a changed backward went unnoticed). Inductor's own FX graph
    cache keys on the decomposed graph and stays on, keeping warm runs fast."""
    with torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        yield
        torch._dynamo.reset()


def mixed_inputs(n: int = (1 << 15) + 3) -> torch.Tensor:
    """Values over many binades, e5m2/e4m3 ties and specials; odd length for a vector tail."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * torch.pow(2.0, torch.randint(-30, 20, (n,), generator=g).float())
    ties = torch.tensor([1.125, 1.375, 2.0**-17, 3 * 2.0**-17, 61440.0, 464.0, 2.0**-10, 3 * 2.0**-10])
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e38, -1e-40])
    x[: len(ties)] = ties
    x[len(ties) : len(ties) + len(specials)] = specials
    return x


def many_cases(x, xt, xb, seed, scale):
    """Forward cases: both fp8 formats, both roundings, both overflow policies, a scale,
    a transposed input and a bf16 input, plus a quantize_grad for the backward."""
    return (
        q(x, "e5m2", "nearest", "saturate", None, 0, None),
        q(x, "e4m3", "nearest", "inf", None, 0, None),
        q(x, "e5m2", "stochastic", "inf", seed, 0, None),
        q(x, "e4m3", "stochastic", "saturate", seed, 7, scale),
        q(xt, "e5m2", "stochastic", "saturate", seed, 3, None),
        q(xb, "e4m3", "stochastic", "saturate", seed, 1, None),
        qg(x, "e5m2", "stochastic", "saturate", seed, 11),
    )


def fresh_args(seed_value: int, device: str | torch.device = "cpu"):
    x = mixed_inputs().to(device).requires_grad_()
    xt = (x.detach()[: 64 * 48].reshape(48, 64) * 3).t()
    xb = x.detach()[:5000].to(torch.bfloat16)
    seed = torch.tensor(seed_value, dtype=torch.int64, device=device)
    return x, xt, xb, seed, torch.tensor(4.0, device=device)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, label: str):
    assert a.dtype == b.dtype and a.shape == b.shape, label
    same = (bits(a) == bits(b)) | (a.isnan() & b.isnan())
    bad = torch.nonzero(~same.reshape(-1)).reshape(-1)
    assert bad.numel() == 0, f"{label}: {bad.numel()} of {a.numel()} differ, e.g. " + ", ".join(
        f"#{i}: {a.reshape(-1)[i].item()!r} vs {b.reshape(-1)[i].item()!r}" for i in bad[:6].tolist()
    )


def run_with_backward(fn, args):
    """Outputs and the input's gradient, on the CPU."""
    outs = fn(*args)
    x = args[0]
    x.grad = None
    gout = torch.linspace(-1e3, 1e3, x.numel(), device=x.device) * 0.37  # many e5m2 rounding decisions
    # quantize_grad's output gets gout (its gradient is SR of gout); the nearest
    # quantize passes a second gradient straight through.
    loss = (outs[-1] * gout).sum() + (outs[0] * 0.5).sum()
    loss.backward()
    return [o.detach().cpu() for o in outs], x.grad.cpu()


def test_dynamo_traces_with_fake_tensors():
    """fullgraph=True through Dynamo's fake-tensor tracing, without Inductor (cheap)."""
    counter = CompileCounter()
    compiled = torch.compile(many_cases, backend=counter, fullgraph=True)
    args = fresh_args(5)
    got = compiled(*args)
    want = many_cases(*args)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_bits_equal(a, b, f"output {i}")
    assert counter.frame_count == 1 and counter.op_count >= 7


def test_fake_kernels():
    with FakeTensorMode():
        x = torch.empty(4, 5, dtype=torch.bfloat16).t()
        out = q(x, "e5m2", "stochastic", "saturate", torch.tensor(3), 0, None)
        assert out.shape == (5, 4) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert qg(x, "e4m3", "nearest", "inf", None, 0).shape == (5, 4)
        with pytest.raises(ValueError):
            q(x, "fp16", "nearest", "saturate", None, 0, None)  # fp16 values do not fit bf16


def test_inductor_matches_eager():
    """One Inductor compile (forward and backward, on the test device) against the reference
    ops on the CPU; a second seed must not recompile."""
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(many_cases, backend=counter, fullgraph=True)
    for seed_value in [2**40 + 3, -17]:
        got, got_grad = run_with_backward(compiled, fresh_args(seed_value, TEST_DEVICE))
        want, want_grad = run_with_backward(many_cases, fresh_args(seed_value))
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_bits_equal(a, b, f"seed {seed_value}: output {i}")
        assert_bits_equal(got_grad, want_grad, f"seed {seed_value}: gradient")
    assert counter.frame_count == 1, "a new seed value must not recompile"


def test_a_symbolic_offset_compiles():
    """An offset Dynamo makes symbolic (a function argument under dynamic=True) has the
    bits of the constant, in one compile: the key takes it as an integer tensor (as a
    symbolic int it entered Inductor's C++ as a float, which did not build)."""
    counter = CompileCounterWithBackend("inductor")

    def fn(x, seed, offset):
        return q(x, "e5m2", "stochastic", "saturate", seed, offset, None)

    compiled = torch.compile(fn, backend=counter, dynamic=True, fullgraph=True)
    x, seed = mixed_inputs(5000), torch.tensor(9)
    for offset in [0, 5, 2**32 - 1]:
        got = compiled(x.to(TEST_DEVICE), seed.to(TEST_DEVICE), offset).cpu()
        assert_bits_equal(got, fn(x, seed, offset), f"offset {offset}")
    assert counter.frame_count == 1


def test_inductor_fuses_the_lowering():
    """Inductor compiles the operator into its own kernel: no call back into the custom op."""

    def f(x, seed):
        return q(x, "e5m2", "stochastic", "saturate", seed, 0, None) * 2

    x = mixed_inputs(4096)
    got, (code, *_) = run_and_get_code(torch.compile(f, fullgraph=True), x, torch.tensor(9))
    assert_bits_equal(got, f(x, torch.tensor(9)), "compiled")
    assert "lowprec" not in code.replace("cpp_fused_quantize", ""), "the custom op was not lowered"


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_inductor_builds_each_rounding_op_once(monkeypatch, rounding):
    """The lowering issues the rounding's and the generator's ops once per kernel body.
    Decomposed into ATen ops, each value read twice was traced again per read: one
    stochastic quantize cost Inductor over 5000 op calls (compile time), now about 330."""
    from torch._inductor.codegen.common import CSEProxy

    calls = []
    default = CSEProxy._default

    def counted(self, name, args, kwargs):
        calls.append(name)
        return default(self, name, args, kwargs)

    monkeypatch.setattr(CSEProxy, "_default", counted)

    def f(x, seed):
        return q(x, "e5m2", rounding, "saturate", seed if rounding == "stochastic" else None, 0, None)

    x = mixed_inputs(4096)
    with torch._inductor.config.patch(fx_graph_cache=False):
        got = torch.compile(f, fullgraph=True)(x, torch.tensor(9))
    assert_bits_equal(got, f(x, torch.tensor(9)), "compiled")
    assert 0 < len(calls) < (150 if rounding == "nearest" else 600), len(calls)


def test_stochastic_sites_share_their_seeds_digest():
    """A key is two hash rounds of the seed alone (the only code that reads the seed salt)
    and one of the offset. Each stochastic site of a model's backward once computed all
    three into a 0-dim buffer of its own; the seed is now digested once per graph."""
    from models import mlp, mlp_input

    from lpcompile.numerics.rng import SEED_HI_SALT, to_int32

    model, x = mlp(), mlp_input()
    compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr"})
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        _, (forward, backward) = run_and_get_code(lambda: compiled(x).sum().backward())
    salt = str(to_int32(SEED_HI_SALT))
    assert backward.count(salt) == 1, backward.count(salt)
    assert forward.count(salt) == 0  # the recipe rounds weights and activations to nearest


@pytest.mark.parametrize(("scaling", "shape"), [("tensorwise", (0, 4)), ("rowwise", (3, 0)), ("mx", (2, 0))])
def test_an_empty_tensor_scaled_compiles(scaling, shape):
    """No largest magnitude to scale by: Inductor's reduction of nothing would fail."""

    def fn(x):
        return q(x * 2, "e4m3", "nearest", "saturate", None, 0, None, scaling)

    with torch._inductor.config.patch(fx_graph_cache=False):
        assert torch.compile(fn, backend="inductor", fullgraph=True)(torch.empty(shape)).shape == shape


def test_the_lowering_refuses_a_scale():
    """A scale is taken out by the decomposition; a scaled quantize reaching the lowering
    (a decomposition table without lowprec's) must fail, not drop the scale."""
    from lpcompile.numerics import lowering

    with pytest.raises(NotImplementedError, match="scaled lowprec::quantize"):
        lowering._lower_quantize(None, "e5m2", "nearest", "saturate", None, 0, torch.tensor(2.0))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_into_a_convolution_stores_no_bit_patterns(rounding):
    """GroupNorm, ReLU and a quantize feeding a convolution that Inductor runs
    channels-last on CPUs: the kernel writes the quantized floats in the
    convolution's layout and no int32 buffer. (The sign once went back on as
    bits before an int32 -> float32 view; Inductor then stored those bits
    contiguous and transposed them into the convolution's layout.)"""
    seed = torch.tensor(7) if rounding == "stochastic" else None

    def f(x, w1, w2, gamma, beta):
        h = F.relu(F.group_norm(F.conv2d(x, w1, padding=1), 2, gamma, beta))
        return F.conv2d(q(h, "e5m2", rounding, "saturate", seed, 0, None), w2)

    g = torch.Generator().manual_seed(0)
    shapes = [(2, 3, 16, 16), (8, 3, 3, 3), (8, 8, 3, 3), (8,), (8,)]
    args = [torch.randn(s, generator=g) for s in shapes]
    got, (code, *_) = run_and_get_code(torch.compile(f, fullgraph=True), *args)
    activation = "empty_strided_cpu((2, 8, 16, 16)"
    int32_buffers = [line.strip() for line in code.splitlines() if activation in line and "int32" in line]
    assert not int32_buffers, int32_buffers
    # Only the convolutions' summation order may differ from eager's.
    torch.testing.assert_close(got, f(*args), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- opcheck


OPCHECK_CASES = [
    (q, lambda: (torch.randn(8, 6), "e5m2", "nearest", "saturate", None, 0, None)),
    (q, lambda: (torch.randn(8, 6).t(), "e4m3", "stochastic", "inf", torch.tensor(3), 5, torch.tensor(2.0))),
    (
        q,
        lambda: (
            torch.randn(16, requires_grad=True),
            "e5m2",
            "stochastic",
            "saturate",
            torch.tensor(1),
            0,
            None,
        ),
    ),
    (q, lambda: (torch.randn(3, 4).half(), "e5m2", "nearest", "inf", None, 0, None)),
    (
        qg,
        lambda: (torch.randn(8, 6, requires_grad=True), "e5m2", "stochastic", "saturate", torch.tensor(2), 4),
    ),
    (qg, lambda: (torch.randn(6, 8).t(), "e4m3", "nearest", "inf", None, 0)),
    (
        q,
        lambda: (
            torch.randn(8, 6, requires_grad=True),
            "e4m3",
            "nearest",
            "saturate",
            None,
            0,
            None,
            "tensorwise",
        ),
    ),
    (
        qg,
        lambda: (
            torch.randn(8, 6, requires_grad=True),
            "e5m2",
            "stochastic",
            "inf",
            torch.tensor(2),
            4,
            "tensorwise_pow2",
        ),
    ),
]


@pytest.mark.parametrize("op,make_args", OPCHECK_CASES)
def test_opcheck(op, make_args):
    torch.library.opcheck(op.default, make_args())


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_is_straight_through(rounding):
    x = mixed_inputs(1000).requires_grad_()
    g = torch.randn(1000)
    quantize(x, "e5m2", rounding, seed=3, scale=8.0).backward(g)
    assert torch.equal(x.grad, g)
    xb = x.detach().to(torch.bfloat16).requires_grad_()
    quantize(xb, "e4m3", rounding, seed=3).backward(g.bfloat16())
    assert torch.equal(xb.grad, g.bfloat16())


@pytest.mark.parametrize(
    "fmt,rounding,overflow,seed,offset",
    [
        ("e5m2", "stochastic", "saturate", 7, 0),
        ("e5m2", "stochastic", "inf", 2**40 + 1, 9),
        ("e4m3", "stochastic", "saturate", -3, 2),
        ("e4m3", "nearest", "inf", None, 0),
        ("bf16", "nearest", "saturate", None, 0),
    ],
)
def test_quantize_grad(fmt, rounding, overflow, seed, offset):
    """Identity forward; backward = quantize of the incoming gradient with the same settings."""
    x = mixed_inputs(5000).requires_grad_()
    seed_t = None if seed is None else torch.tensor(seed)
    y = qg(x, fmt, rounding, overflow, seed_t, offset)
    assert_bits_equal(y, x.detach(), "forward")
    g = mixed_inputs(5000).flip(0) * 50
    y.backward(g)
    want = quantize(g, fmt, rounding, seed=seed if seed is not None else 0, offset=offset, overflow=overflow)
    assert_bits_equal(x.grad, want, "backward")
    if rounding == "stochastic":  # it really is stochastic: another offset differs
        other = quantize(g, fmt, rounding, seed=seed, offset=offset + 1, overflow=overflow)
        assert not torch.equal(bits(x.grad), bits(other))
