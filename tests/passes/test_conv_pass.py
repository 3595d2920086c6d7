"""``im2col_conv2d`` and ``use_im2col_convs``: small quantized convolutions as im2col + matmul.

The function is checked against ``F.conv2d`` bit for bit on values whose sums
are exact in any order (multiples of 1/4 below 8: every product and partial sum
is a multiple of 1/16 far below 2^24). The pass is checked on the graphs
Inductor gets, run as FX (``inductor_runs_fx``), and once through Inductor itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import Records, aot_cache_counts, assert_close_through_rounding, inductor_runs_fx, step
from torch import nn

from lpcompile.backend import CompiledGraph
from lpcompile.passes.dynamo.conv import MAX_IM2COL, MAX_TAPS, TAPS_PER_GRAPH, im2col_conv2d

# (batch, in_channels, height, width, out_channels, kernel, stride, padding, dilation)
GEOMETRIES = [
    (4, 1, 8, 8, 5, 3, 1, 1, 1),
    (2, 1, 9, 7, 3, 3, 2, 1, 1),
    (3, 2, 6, 7, 4, (2, 3), (1, 2), (0, 1), (2, 1)),
    (2, 3, 5, 5, 2, 1, 1, 0, 1),
    (2, 1, 7, 6, 3, 3, 1, "same", 2),
    (2, 1, 6, 6, 3, (2, 2), 1, "same", 1),
    (2, 2, 6, 5, 3, 2, 1, "valid", 1),
    (2, 3, 8, 8, 4, 4, 4, 0, 1),  # non-overlapping patches: a permutation, no taps
    (2, 2, 9, 11, 3, (2, 3), (2, 3), 1, 1),  # patches, padded, the last partial ones dropped
]


def quarters(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-32, 33, shape, generator=g).float() / 4


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_im2col_conv2d_equals_conv2d_and_its_gradients(geometry, with_bias):
    n, c, h, w, o, kernel, stride, padding, dilation = geometry
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    x = quarters(n, c, h, w, seed=0).requires_grad_()
    weight = quarters(o, c, kh, kw, seed=1).requires_grad_()
    bias = quarters(o, seed=2).requires_grad_() if with_bias else None
    inputs = (x, weight, bias) if with_bias else (x, weight)
    results = []
    for conv in (F.conv2d, im2col_conv2d):
        y = conv(x, weight, bias, stride=stride, padding=padding, dilation=dilation)
        error = quarters(*y.shape, seed=3)
        grads = torch.autograd.grad(y, inputs, error)
        results.append((y, *grads))
    names = ("output", "x grad", "weight grad", "bias grad")[: 1 + len(inputs)]
    for name, got, want in zip(names, results[1], results[0], strict=True):
        assert got.shape == want.shape and torch.equal(got, want), name
    assert results[1][0].is_contiguous()  # as ATen's: user code may view it


class FirstConv(nn.Module):
    """A 1-channel 3x3 convolution, a 1x1 one over its 4 channels (its input needs a
    gradient), a strided 3x3 one over 8 channels, and a linear layer reading the first
    and the last; the first's output through ``view``, which needs the contiguous
    layout ATen's convolution returns."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Conv2d(1, 4, 3, padding=1)
        self.mix = nn.Conv2d(4, 8, 1)
        self.second = nn.Conv2d(8, 4, 3, stride=2, padding=1)
        self.head = nn.Linear(4 * 6 * 6 + 4 * 3 * 3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.first(x)
        b = self.second(self.mix(a.relu()).relu()).relu()
        return self.head(torch.cat([a.view(a.shape[0], -1), b.flatten(1)], 1))


def digits_like() -> torch.Tensor:
    return torch.rand(6, 1, 6, 6, generator=torch.Generator().manual_seed(4)).requires_grad_()


def compiled_step(options: dict, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    torch._dynamo.reset()
    model = FirstConv()
    compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr", **options})
    x.grad = None
    with torch._functorch.config.patch(enable_autograd_cache=False):
        out, grads = step(model, lambda: compiled(x))
    return out, grads, x.grad.clone()


def rewritten(records: Records) -> int:
    """How many convolutions the pass rewrote (0 where the options leave it out)."""
    return rewritten_in(records.only())


def im2col_record(record: CompiledGraph):
    """The pass's record in one compiled graph, or ``None`` where it did not run."""
    found = [r for r in record.records if r.name == "use_im2col_convs"]
    assert len(found) <= 1, found
    return found[0] if found else None


def rewritten_in(record: CompiledGraph) -> int:
    """How many convolutions the pass rewrote in one compiled graph."""
    rewrite = im2col_record(record)
    if rewrite is None:
        return 0
    assert rewrite.nodes_removed == rewrite.code_after.count("torch.ops.lowprec.realize(")  # one per im2col
    return rewrite.nodes_removed


@pytest.mark.parametrize(
    "options,count",
    [
        ({}, 3),
        ({"conv": "aten"}, 0),
        ({"executor": "eager"}, 0),
        ({"exclude": ["first"]}, 2),  # kept in FP32: not quantized, not rewritten
        ({"recipe": "fp32"}, 0),
    ],
)
def test_only_small_quantized_cpu_convolutions_are_rewritten(monkeypatch, options, count):
    inductor_runs_fx(monkeypatch)
    records = Records()
    compiled_step(options, digits_like())
    if options.get("recipe") == "fp32":  # nothing quantized: the passes do not run at all
        assert all(r.name != "use_im2col_convs" for r in records.only().records)
        return
    assert rewritten(records) == count


class TwoSizes(nn.Module):
    """On 64 images of 32x32: a 3x3 convolution over one channel (an im2col matrix of
    65536 x 9 elements) and a 1x1 one over its 4 channels (65536 x 4: the limit)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.large = nn.Conv2d(1, 4, 3, padding=1)
        self.at_limit = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.at_limit(self.large(x).relu()).sum((2, 3))


def compile_and_split(model: nn.Module, x: torch.Tensor) -> tuple[list[str], list[str]]:
    """One training step of ``model`` under ``fp8-e5m2-sr``; the lines of the rewritten
    graph that call ATen's convolution and those that store an im2col's input (one per
    convolution rewritten)."""
    records = Records()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr"})
    with torch._functorch.config.patch(enable_autograd_cache=False):
        step(model, lambda: compiled(x))
    lines = im2col_record(records.only()).code_after.splitlines()
    convs = [line for line in lines if "torch.conv2d(" in line]
    return convs, [line for line in lines if "torch.ops.lowprec.realize(" in line]


def test_convolutions_whose_im2col_exceeds_the_limit_keep_atens(monkeypatch):
    assert MAX_IM2COL == 64 * 32 * 32 * 4
    inductor_runs_fx(monkeypatch)
    x = torch.rand(64, 1, 32, 32, generator=torch.Generator().manual_seed(4))
    (conv,), (im2col,) = compile_and_split(TwoSizes(), x)
    assert "large_parameters_bias" in conv and im2col


class Kernels(nn.Module):
    """Small convolutions of three kernels: 5x5 (25 positions, gathered), 3x3 (9) and
    4x4 patches at stride 4 (16 positions, non-overlapping)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Conv2d(1, 4, 5, padding=2)
        self.small = nn.Conv2d(4, 4, 3, padding=1)
        self.patches = nn.Conv2d(4, 4, 4, stride=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.patches(self.small(self.wide(x).relu()).relu()).sum((2, 3))


@pytest.mark.slow
def test_aot_autograds_cache_keeps_a_graph_with_rewritten_convolutions():
    """The rewrite is inlined as torch's own functions: a call of lowprec's Python function
    in the graph made AOT autograd bypass its cache ("Unsupported call_function target")."""
    records = Records()
    aot = aot_cache_counts(FirstConv, digits_like(), {"recipe": "fp8-e5m2-sr"})
    assert [rewritten_in(record) for record in records.new] == [3, 3]
    assert aot.get("autograd_cache_bypass", 0) == 0 and aot.get("autograd_cache_hit", 0) == 1, aot


def test_kernels_of_more_positions_than_the_limit_keep_atens_unless_they_are_patches(monkeypatch):
    assert MAX_TAPS == 9
    inductor_runs_fx(monkeypatch)
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(4))
    (conv,), im2col = compile_and_split(Kernels(), x)
    assert "wide_parameters_bias" in conv and len(im2col) == 2


class ManySmall(nn.Module):
    """Four 3x3 convolutions (36 taps to gather) with a 1x1 one (patches: none) between."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1) for _ in range(4))
        self.mix = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x).relu()
            x = self.mix(x) if i == 1 else x
        return x.sum((2, 3))


def test_a_graph_gathers_at_most_its_budget_of_taps_fewest_first(monkeypatch):
    """Each gathered tap lengthens Inductor's compile: past the budget, convolutions keep
    ATen's (diffusers' UNet, nineteen 3x3 convolutions, compiled in twice Inductor's time)."""
    assert TAPS_PER_GRAPH == 24
    inductor_runs_fx(monkeypatch)
    x = torch.rand(2, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    convs, im2col = compile_and_split(ManySmall(), x)
    assert len(im2col) == 3  # the 1x1 and two 3x3, in graph order
    assert ["convs_modules_2_" in convs[0], "convs_modules_3_" in convs[1]] == [True, True], convs


def assert_close_steps(got, want) -> None:
    (out, grads, x_grad), (want_out, want_grads, want_x_grad) = got, want
    assert_close_through_rounding(out, want_out, "output")
    assert_close_through_rounding(x_grad, want_x_grad, "input grad")
    for i, (a, b) in enumerate(zip(grads, want_grads, strict=True)):
        assert_close_through_rounding(a, b, f"grad of parameter {i}")


def test_rewritten_step_matches_atens_convolution_in_the_graphs_inductor_gets(monkeypatch):
    """The same quantized step with the small convolutions as im2col + mm and as ATen's:
    FP32 sums in another order, and input gradients through the im2col's backward.
    The backward graph recomputes the NCHW copies of the matmuls' channels-last
    outputs; ``realize_transposed_copies`` has them stored once (not the forward's)."""
    received = inductor_runs_fx(monkeypatch)
    records = Records()
    got = compiled_step({}, digits_like())
    assert rewritten(records) == 3

    def stored_transposes(kind: str) -> int:
        graph = received[kind].graph
        realized = graph.find_nodes(op="call_function", target=torch.ops.lowprec.realize.default)
        return sum(node.args[0].target is torch.ops.aten.clone.default for node in realized)

    assert stored_transposes("forward") == 0 and stored_transposes("backward") >= 1
    assert_close_steps(got, compiled_step({"conv": "aten"}, digits_like()))


def test_rewritten_step_under_inductor_matches_the_eager_executor():
    """Inductor's own compile (lowprec::realize's lowering, the contiguous output
    a view needs, the 1x1 convolution's input gradient) against the eager executor,
    which keeps ATen's convolution."""
    records = Records()
    got = compiled_step({}, digits_like())
    assert rewritten(records) == 3
    assert_close_steps(got, compiled_step({"executor": "eager"}, digits_like()))
