"""``lowprec::mm_bf16`` and ``bmm_bf16`` (the AVX512-BF16 kernel) and the joint-graph pass that uses them.

The kernel's results are held to the error bound of any FP32-accumulated dot
product, |error| <= K * 2^-24 * (|A| @ |B|): it adds the same exact products as
an FP32 GEMM, in another order. Where every partial sum is exact, it must equal
``torch.mm`` bit for bit.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from models import Records, Ref, inductor_runs_fx, mlp_ref, step
from torch import nn

from lpcompile import quantize
from lpcompile.backend import step_seed
from lpcompile.kernels.cpu import gemm as cpu_gemm
from lpcompile.numerics.formats import parse_format
from lpcompile.passes.joint.matmul import MIN_MACS, exact_in_bf16_products

needs_kernel = pytest.mark.skipif(
    cpu_gemm.unavailable() is not None, reason=f"bf16 matmul kernel: {cpu_gemm.unavailable()}"
)
MM_BF16 = torch.ops.lowprec.mm_bf16.default


def on_e5m2(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(*shape, generator=g) * 10, "e5m2")


def operands(m: int, k: int, n: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """E5M2-valued (m, k) and (k, n) operands, transposed ("t") or strided as named."""
    if layout == "strided":  # every other row and column of bigger tensors
        return on_e5m2(2 * m, 2 * k, seed=1)[::2, ::2], on_e5m2(2 * k, 2 * n, seed=2)[::2, ::2]
    a = on_e5m2(k, m, seed=1).t() if layout[0] == "t" else on_e5m2(m, k, seed=1)
    b = on_e5m2(n, k, seed=2).t() if layout[1] == "t" else on_e5m2(k, n, seed=2)
    return a, b


SHAPES = [(1, 1, 1), (7, 5, 3), (8, 2, 32), (9, 3, 33), (64, 64, 64), (33, 1000, 65)]


@needs_kernel
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("layout", ["nn", "tn", "nt", "tt", "strided"])
def test_kernel_is_within_the_error_bound_of_an_fp32_gemm(m, k, n, layout):
    a, b = operands(m, k, n, layout)
    got = cpu_gemm.mm(a, b)
    assert got.shape == (m, n) and got.dtype == torch.float32 and got.is_contiguous()
    exact = a.double() @ b.double()
    bound = k * 2.0**-24 * (a.double().abs() @ b.double().abs())
    worst = ((got.double() - exact).abs() - bound).max().item()
    assert worst <= 0, f"error exceeds the FP32 dot-product bound by {worst:.3g}"
    assert ((a @ b).double() - exact).abs().le(bound).all()  # the bound holds for torch too


@needs_kernel
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded"])
def test_batched_kernel_is_within_the_error_bound(layout):
    a, b = on_e5m2(5, 9, 70, seed=1), on_e5m2(5, 70, 33, seed=2)
    if layout == "transposed":
        a, b = on_e5m2(5, 70, 9, seed=1).transpose(1, 2), on_e5m2(33, 70, 5, seed=2).permute(2, 1, 0)
    elif layout == "expanded":  # batch stride 0, as matmul's broadcasting leaves it
        b = on_e5m2(1, 70, 33, seed=2).expand(5, 70, 33)
    got = cpu_gemm.bmm(a, b)
    assert got.shape == (5, 9, 33) and got.is_contiguous()
    exact = a.double() @ b.double()
    bound = 70 * 2.0**-24 * (a.double().abs() @ b.double().abs())
    assert ((got.double() - exact).abs() <= bound).all()


@needs_kernel
def test_kernel_equals_torch_where_every_sum_is_exact():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-4, 5, (37, 70), generator=g).float()  # integers E5M2 holds
    b = torch.randint(-4, 5, (70, 45), generator=g).float() * 0.25
    assert torch.equal(cpu_gemm.mm(a, b), a @ b)
    assert torch.equal(cpu_gemm.mm(b.t(), a.t()), b.t() @ a.t())


@needs_kernel
@pytest.mark.parametrize("n", [528, 520])
def test_kernel_streams_a_large_output_to_memory(n):
    """Outputs of 2^17 floats or more go out with non-temporal stores where a block is
    whole and aligned (n=528: a row is 33 vectors; the last 16 columns and the last 5
    rows take ordinary stores); with n=520 rows are not 64-byte aligned and every store
    is ordinary. Exact sums, so equal to torch; batched as well."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-4, 5, (517, 70), generator=g).float()
    b = torch.randint(-4, 5, (70, n), generator=g).float() * 0.25
    assert a.shape[0] * n >= 1 << 17
    assert torch.equal(cpu_gemm.mm(a, b), a @ b)
    a3, b3 = a[:512].reshape(2, 256, 70), torch.stack([b, b.flip(1)])
    assert torch.equal(cpu_gemm.bmm(a3, b3), a3 @ b3)


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(0, 5, 3), (4, 0, 3), (4, 5, 0)])
def test_kernel_with_an_empty_dimension(m, k, n):
    a, b = torch.ones(m, k), torch.ones(k, n)
    assert torch.equal(cpu_gemm.mm(a, b), torch.zeros(m, n))


@needs_kernel
def test_kernel_frees_a_large_scratch_and_packs_into_a_fresh_one():
    """Packed operands over 32 MiB are freed after the call (here 100 MiB)."""
    k = 1 << 20
    a, b = torch.ones(16, k), torch.full((k, 20), 0.5)
    for _ in range(2):
        assert torch.equal(cpu_gemm.mm(a, b), torch.full((16, 20), k / 2))
        small_a, small_b = torch.full((9, 3), 2.0), torch.full((3, 33), -0.25)
        assert torch.equal(cpu_gemm.mm(small_a, small_b), torch.full((9, 33), -1.5))


@needs_kernel
def test_kernel_propagates_inf_and_nan_as_an_fp32_gemm_does():
    a, b = on_e5m2(6, 40), on_e5m2(40, 20, seed=3)
    a[0, 3] = float("inf")
    a[1, 4] = float("nan")
    a[2, 5] = float("-inf")
    b[5, 7] = 0.0  # -inf * 0: NaN in that column only
    # A NaN whose payload is in the low 16 bits only: bfloat16's truncation would make it inf.
    a[3, 6] = torch.tensor(0x7F800001, dtype=torch.int32).view(torch.float32)
    got, want = cpu_gemm.mm(a, b), a @ b
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isinf()], want[want.isinf()])
    assert got[3].isnan().all()


def test_kernel_refuses_what_it_cannot_multiply():
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.mm(torch.ones(2, 3, dtype=torch.float64), torch.ones(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(M, K\) @ \(K, N\)"):
        cpu_gemm.mm(torch.ones(2, 3), torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"\(M, K\) @ \(K, N\)"):
        cpu_gemm.mm(torch.ones(1, 2, 3), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"\(B, M, K\) @ \(B, K, N\)"):
        cpu_gemm.bmm(torch.ones(2, 2, 3), torch.ones(3, 3, 2))


def test_which_formats_multiply_exactly_in_bf16():
    assert exact_in_bf16_products(parse_format("e5m2")) and exact_in_bf16_products(parse_format("e4m3"))
    for name in ("fp16", "bf16", "fp32"):  # fp16: 10 mantissa bits; bf16: subnormals flushed
        assert not exact_in_bf16_products(parse_format(name)), name


WIDTH, BATCH = 192, 256


def wide_mlp(seed: int = 0) -> nn.Sequential:
    """Two 192-wide layers: with a batch of 256 every matmul has over MIN_MACS multiply-adds."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


def wide_input() -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(5))


def compiled_step(model: nn.Module, options: dict, x: torch.Tensor | None = None):
    x = wide_input() if x is None else x
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return step(model, lambda: torch.compile(model, backend="lowprec", options=options)(x))


def count(gm: torch.fx.GraphModule, target) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=target))


def assert_close_step(got, expected) -> None:
    """Output and grads agree up to FP32 reassociation: within 2e-5 of each tensor's
    largest magnitude (the MLP's sums have K ≤ 256 products: K * 2^-24 = 1.5e-5 of the
    operands' magnitudes; the Scores projection's weight gradient sums 2048, whose
    reassociation errors, of either sign, stay inside the same bound on these inputs).

    A sum reassociated just at a rounding boundary could quantize one E5M2 step
    apart downstream; the comparison would show it (these fixed inputs hit none).
    """
    pairs = [("output", got[0], expected[0])]
    pairs += [(f"grad {i}", g, e) for i, (g, e) in enumerate(zip(got[1], expected[1], strict=True))]
    for name, a, b in pairs:
        worst = (a - b).abs().max().item() / b.abs().max().item()
        assert worst <= 2e-5, f"{name}: {worst:.3g} of its largest magnitude"


@needs_kernel
def test_quantized_matmuls_run_on_the_kernel_in_the_graphs_inductor_gets(monkeypatch):
    """fp8-e5m2: both layers' forward matmuls, the second layer's error matmul and both
    weight-gradient matmuls take two quantized operands, and become ``mm_bf16``."""
    received = inductor_runs_fx(monkeypatch)
    records = Records()
    model = wide_mlp()
    assert BATCH * WIDTH**2 >= MIN_MACS
    got = compiled_step(model, {"recipe": "fp8-e5m2-sr"})
    record = records.only()
    rewritten = {(r.name, r.graph): r.nodes_removed for r in record.records}
    assert rewritten[("use_bf16_matmuls", "joint")] == 5
    assert count(received["forward"], MM_BF16) == 2 and count(received["backward"], MM_BF16) == 3
    for gm in received.values():  # no FP32 GEMM is left
        assert count(gm, torch.ops.aten.mm.default) == count(gm, torch.ops.aten.addmm.default) == 0
    ref = Ref.for_recipe("fp8-e5m2-sr", step_seed(0, 0), record.stream)
    assert_close_step(got, step(model, lambda: mlp_ref(model, wide_input(), ref)))


@pytest.mark.parametrize("options", [{"recipe": "fp8-e5m2-sr", "matmul": "fp32"}, {"recipe": "fp16"}])
def test_matmul_fp32_and_formats_bf16_does_not_hold_keep_the_fp32_gemm(monkeypatch, options):
    received = inductor_runs_fx(monkeypatch)
    records = Records()
    model = wide_mlp()
    got = compiled_step(model, options)
    assert all(count(gm, MM_BF16) == 0 for gm in received.values())
    record = records.only()
    ref = Ref.for_recipe(record.config.recipe, step_seed(0, 0), record.stream)
    assert torch.equal(got[0], step(model, lambda: mlp_ref(model, wide_input(), ref))[0])


class Scores(nn.Module):
    """Attention-like scores ``q @ q^T`` of a projection: a bmm of two activations."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)
        return torch.matmul(q, q.transpose(1, 2))


@needs_kernel
def test_a_batched_matmul_of_quantized_activations_runs_on_the_kernel(monkeypatch):
    """Forward ``q @ q^T`` and both of its backward products (32 x 64 x 64 x 64 each)."""
    received = inductor_runs_fx(monkeypatch)
    x = torch.randn(32, 64, 64, generator=torch.Generator().manual_seed(2))
    assert 32 * 64**3 >= MIN_MACS
    results = []
    for matmul in ("auto", "fp32"):
        torch._dynamo.reset()
        results.append(compiled_step(Scores(), {"recipe": "fp8-e5m2-sr", "matmul": matmul}, x))
        bmm = torch.ops.lowprec.bmm_bf16.default
        kernels = [count(received[kind], bmm) for kind in ("forward", "backward")]
        assert kernels == ([1, 2] if matmul == "auto" else [0, 0]), matmul
    assert_close_step(*results)


@needs_kernel
def test_a_batch_of_small_matrices_keeps_atens_bmm(monkeypatch):
    """2048 products of 16x16x16: 2^23 multiply-adds in all, but 2^12 per matrix."""
    received = inductor_runs_fx(monkeypatch)
    x = torch.randn(2048, 16, 16, generator=torch.Generator().manual_seed(2))
    assert 2048 * 16**3 >= MIN_MACS
    compiled_step(Scores(width=16), {"recipe": "fp8-e5m2-sr"}, x)
    assert count(received["forward"], torch.ops.aten.bmm.default) == 1
    assert all(count(gm, torch.ops.lowprec.bmm_bf16.default) == 0 for gm in received.values())


@needs_kernel
def test_an_inference_graph_gets_the_kernel_too(monkeypatch):
    received = inductor_runs_fx(monkeypatch)
    records = Records()
    model = wide_mlp()
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
        out = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2"})(wide_input())
    assert count(received["inference"], MM_BF16) == 2
    assert ("use_bf16_matmuls", "inference") in {(r.name, r.graph) for r in records.only().records}
    ref = Ref.for_recipe("fp8-e5m2", None, records.only().stream)
    with torch.no_grad():
        assert_close_step((out, []), (mlp_ref(model, wide_input(), ref), []))


def test_without_the_kernel_auto_keeps_fp32_and_bf16_says_why(monkeypatch):
    received = inductor_runs_fx(monkeypatch)
    monkeypatch.setattr(cpu_gemm, "unavailable", lambda: "this CPU has no AVX512-BF16 instructions")
    compiled_step(wide_mlp(), {"recipe": "fp8-e5m2"})
    assert all(count(gm, MM_BF16) == 0 for gm in received.values())
    torch._dynamo.reset()
    with pytest.raises(Exception, match="matmul='bf16'.*no AVX512-BF16"):
        compiled_step(wide_mlp(), {"recipe": "fp8-e5m2", "matmul": "bf16"})


def kernel_calls(fn) -> int:
    """How many times ``fn()`` calls ``lowprec::mm_bf16`` (the profiler sees every op call)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "lowprec::mm_bf16")


def inductor_step(model: nn.Module, options: dict):
    """Compile under real Inductor, then one profiled step: its result and ``mm_bf16`` calls.

    Inductor's and AOT autograd's caches stay on: a compile with another ``matmul``
    must not be served the other's graphs.
    """
    torch._dynamo.reset()
    x = wide_input()
    compiled = torch.compile(model, backend="lowprec", options=options)
    step(model, lambda: compiled(x))  # compiles both graphs: fake-tensor runs would count too
    result = []
    calls = kernel_calls(lambda: result.append(step(model, lambda: compiled(x))))
    return result[0], calls


@needs_kernel
def test_the_kernel_under_real_inductor():
    """Inductor calls ``mm_bf16`` as an extern kernel between its own C++ kernels."""
    model = wide_mlp()
    got, calls = inductor_step(model, {"recipe": "fp8-e5m2-sr"})
    assert calls == 5
    want, calls = inductor_step(model, {"recipe": "fp8-e5m2-sr", "matmul": "fp32"})
    assert calls == 0
    assert_close_step(got, want)


@pytest.mark.parametrize("scale", [None, 8.0])
def test_only_an_unscaled_quantize_names_a_grid(scale):
    """Inductor's table keeps an unscaled quantize one node (its values lie on the format's
    grid); a scaled one decomposes around an unscaled one, and its values are grid / scale."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from lpcompile.numerics import lowering  # noqa: F401  (registers the decompositions)
    from lpcompile.passes.joint.matmul import grid_of

    def fn(x):
        return torch.ops.lowprec.quantize(x, "e4m3", "nearest", "saturate", None, 0, scale)

    if scale is not None:
        scale = torch.tensor(scale)
    gm = make_fx(fn, decomposition_table=select_decomp_table())(torch.randn(4))
    output = gm.graph.find_nodes(op="output")[0].args[0]
    output = output[0] if isinstance(output, (tuple, list)) else output
    quantizes = gm.graph.find_nodes(op="call_function", target=torch.ops.lowprec.quantize.default)
    assert len(quantizes) == 1
    assert grid_of(output) == (parse_format("e4m3") if scale is None else None)


def test_a_damaged_cached_kernel_is_rebuilt(tmp_path, monkeypatch):
    """A zero-byte .so in the cache (a crash mid-write) was loaded forever: matmul="auto"
    fell back to FP32 GEMMs silently. Now it is rebuilt once; if that fails, it warns."""
    if not torch.cpu._is_avx512_bf16_supported() or not shutil.which("gcc"):
        pytest.skip("the kernel needs AVX512-BF16 and GCC")
    monkeypatch.setattr(cpu_gemm, "_cache_dir", lambda: tmp_path)
    monkeypatch.setenv("CC", "gcc")  # the compiler command is part of the file's name
    cpu_gemm._library.cache_clear()
    try:
        built = cpu_gemm._build(["gcc"])
        built.write_bytes(b"")  # damaged
        assert cpu_gemm.unavailable() is None  # rebuilt and loaded
        assert built.stat().st_size > 0
        cpu_gemm._library.cache_clear()
        monkeypatch.setattr(cpu_gemm, "FLAGS", (*cpu_gemm.FLAGS, "-no-such-flag"))  # the build fails
        with pytest.warns(UserWarning, match="bf16 matmul kernel is off"):
            assert cpu_gemm.unavailable() is not None
    finally:
        cpu_gemm._library.cache_clear()


def test_a_graph_off_the_cpu_never_builds_the_kernel(monkeypatch):
    """A GPU graph's compile does not wait for the CPU kernel's build (nor asks if it could)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lpcompile.backend.compile import JointPasses, on_cpu
    from lpcompile.config import LowPrecConfig
    from lpcompile.passes.driver import CompileContext
    from lpcompile.passes.joint import bf16_applies

    def build(*args):
        raise AssertionError("the CPU kernel was asked for")

    monkeypatch.setattr(cpu_gemm, "unavailable", build)
    ctx = CompileContext(LowPrecConfig.from_recipe("fp8-e5m2"), graph_id=0, stream=0)
    meta = [torch.ones(4, 4, device="meta"), torch.ones(4, 4, device="meta")]
    assert not on_cpu(meta)
    assert JointPasses(ctx, "", on_cpu(meta)).uuid().endswith("bf16-matmuls-False")
    assert not bf16_applies(make_fx(torch.mm)(*meta), ctx, "joint")
    with pytest.raises(AssertionError, match="was asked"):  # a CPU graph asks
        bf16_applies(make_fx(torch.mm)(torch.ones(4, 4), torch.ones(4, 4)), ctx, "joint")
