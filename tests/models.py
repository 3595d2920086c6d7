"""Small models and a hand-written quantized reference for the backend tests.

The reference does not use the backend or its passes: it calls
``torch.ops.lowprec.quantize`` / ``quantize_grad`` by hand, at the places and
with the offsets that ``insert_quantize`` promises: for each
matmul/conv, in order, the activation (``quantize``), the weight gradient
(``quantize_grad`` on the parameter) then the weight (``quantize``), and the
error (``quantize_grad`` on the output); offsets count up from
``stream << 16`` (the record's ``stream``, a hash of the graph's code).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lpcompile.backend import REGISTRY, CompiledGraph

Q = torch.ops.lowprec.quantize
QG = torch.ops.lowprec.quantize_grad
LOWPREC_TARGETS = {
    torch.ops.lowprec.quantize.default: "quantize",
    torch.ops.lowprec.quantize_grad.default: "quantize_grad",
}

Spec = tuple[str, str, str]  # (fmt, rounding, overflow)

# What each recipe promises, written out independently of lpcompile.config:
# (weight/activation spec, error/weight-gradient spec).
RECIPE_SPECS: dict[str, tuple[Spec, Spec]] = {
    "fp8-e5m2": (("e5m2", "nearest", "saturate"), ("e5m2", "nearest", "inf")),
    "fp8-e5m2-sr": (("e5m2", "nearest", "saturate"), ("e5m2", "stochastic", "inf")),
    "fp8-hybrid": (("e4m3", "nearest", "saturate"), ("e5m2", "nearest", "inf")),
    "fp16": (("fp16", "nearest", "saturate"), ("fp16", "nearest", "inf")),
    "bf16": (("bf16", "nearest", "saturate"), ("bf16", "nearest", "inf")),
}


@dataclass
class Ref:
    """Quantizes one graph's layers by hand; ``offset`` counts sites from ``stream << 16``."""

    fwd: Spec
    bwd: Spec
    seed: torch.Tensor | None
    offset: int

    @classmethod
    def for_recipe(cls, recipe: str, seed: torch.Tensor | None, stream: int) -> Ref:
        fwd, bwd = RECIPE_SPECS[recipe]
        return cls(fwd, bwd, seed, stream << 16)

    def _next(self) -> int:
        self.offset += 1
        return self.offset - 1

    def _seed(self, spec: Spec) -> torch.Tensor | None:
        return self.seed if spec[1] == "stochastic" else None

    def q(self, x: torch.Tensor, spec: Spec | None = None) -> torch.Tensor:
        spec = spec or self.fwd
        return Q(x, *spec, self._seed(spec), self._next(), None)

    def qg(self, x: torch.Tensor) -> torch.Tensor:
        return QG(x, *self.bwd, self._seed(self.bwd), self._next())

    def layer(self, fn: Callable, x: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """``fn(x, weight, ...)`` with activation, weight grad, weight and error sites."""
        x = self.q(x)
        weight = self.q(self.qg(weight))
        return self.qg(fn(x, weight, *args, **kwargs))


class ResidualBlock(nn.Module):
    """``x + b(relu(a(x)))``: the block the checkpoint and nested-region tests repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def mlp(seed: int = 0) -> nn.Sequential:
    """Linear-ReLU-Linear: layers "0" and "2"."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def mlp_input(batch: int = 4) -> torch.Tensor:
    """The input ``mlp`` takes: ``batch`` rows of 6 features."""
    return torch.randn(batch, 6, generator=torch.Generator().manual_seed(3))


def mlp_ref(m: nn.Sequential, x: torch.Tensor, ref: Ref) -> torch.Tensor:
    h = ref.layer(F.linear, x, m[0].weight, m[0].bias).relu()
    return ref.layer(F.linear, h, m[2].weight, m[2].bias)


def convnet(seed: int = 0, groupnorm: bool = True) -> nn.Sequential:
    """conv2d, GroupNorm (optional), then two linears; input ``convnet_input``."""
    torch.manual_seed(seed)
    norm = [nn.GroupNorm(2, 4)] if groupnorm else []
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        *norm,
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 12),
        nn.ReLU(),
        nn.Linear(12, 5),
    )


def convnet_ref(m: nn.Sequential, x: torch.Tensor, ref: Ref) -> torch.Tensor:
    conv, *rest = m
    h = ref.layer(F.conv2d, x, conv.weight, conv.bias, conv.stride, conv.padding)
    if isinstance(rest[0], nn.GroupNorm):
        norm = rest.pop(0)
        h = F.group_norm(h, norm.num_groups, norm.weight, norm.bias, norm.eps)
    first, last = rest[2], rest[4]
    h = ref.layer(F.linear, h.relu().flatten(1), first.weight, first.bias).relu()
    return ref.layer(F.linear, h, last.weight, last.bias)


def convnet_input(batch: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 2, 5, 5, generator=torch.Generator().manual_seed(seed))


def step(model: nn.Module, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run ``fn`` (a forward through ``model``), backprop a fixed loss; output and grads."""
    model.zero_grad(set_to_none=True)
    y = fn()
    # A weighted sum, so that every output element gets a different error.
    weights = torch.linspace(-1.5, 2.0, y.numel(), device=y.device).reshape(y.shape)
    (y * weights).sum().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()]


def assert_close_through_rounding(
    got: torch.Tensor, expected: torch.Tensor, label: str, unrounded_rtol: float = 0.0
) -> None:
    """Equal up to FP32 sums in another order, seen through E5M2 rounding.

    A last-bit change that crosses a rounding boundary (or an SR threshold) of
    an E5M2 quantize downstream moves that value by one E5M2 step, at most 2**-2
    of its magnitude (2 mantissa bits), and the gradients computed from it by
    less. Such crossings are rare: at most 5% of the elements may differ, by at
    most ``rtol=0.25``. A tensor that is not rounded itself (an unrounded weight
    gradient) also shows the reordered sums: elements within ``unrounded_rtol`` of
    each other count as equal.
    """
    differ = int(((got - expected).abs() > unrounded_rtol * expected.abs()).sum())
    assert differ <= 0.05 * got.numel(), f"{label}: {differ} of {got.numel()} differ"
    torch.testing.assert_close(got, expected, rtol=0.25, atol=1e-6, msg=label)


def assert_same_step(got, expected, label: str = "") -> None:
    """Bitwise equality of two ``step`` results (output, then each parameter's grad)."""
    assert torch.equal(got[0], expected[0]), f"{label}: outputs differ"
    assert len(got[1]) == len(expected[1])
    for i, (a, b) in enumerate(zip(got[1], expected[1], strict=True)):
        assert torch.equal(a, b), f"{label}: grad of parameter {i} differs"


def lowprec_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target in LOWPREC_TARGETS]


def capture_dynamo_graphs(monkeypatch) -> list[torch.fx.GraphModule]:
    """Collect the rewritten Dynamo graphs the backend hands to its executor."""
    import lpcompile.backend.compile as backend

    graphs: list[torch.fx.GraphModule] = []
    execute = backend._execute

    def spy(gm, *args, **kwargs):
        graphs.append(gm)
        return execute(gm, *args, **kwargs)

    monkeypatch.setattr(backend, "_execute", spy)
    return graphs


class LinearFunction(torch.autograd.Function):
    """``x @ w.T`` with a hand-written backward, as a fused or custom layer is written."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


class LinearFunctionT(torch.autograd.Function):
    """``x @ w.T`` with the ``.T`` attribute: Dynamo passes the forward's ``w.T`` as an input
    of its own, which gets no gradient, and the gradient to ``w``, which the forward only
    saves."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.T

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.T @ x


class Records:
    """The ``CompiledGraph`` records made since this object was created."""

    def __init__(self) -> None:
        self.start = REGISTRY.graph_count

    @property
    def new(self) -> list[CompiledGraph]:
        return REGISTRY.records_since(self.start)

    def only(self) -> CompiledGraph:
        assert len(self.new) == 1, f"expected one compiled graph, got {len(self.new)}"
        return self.new[0]


def stand_in_for_inductor(monkeypatch, inner: Callable) -> None:
    """Make ``inner`` Inductor's ``compile_fx_inner``, which the backend's ``inner_compile``
    calls (it gets each AOT graph after lowprec's passes, under Inductor's patched config)."""
    import torch._inductor.compile_fx

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", inner)


def inductor_runs_fx(monkeypatch) -> dict:
    """Stand in for Inductor's compiler with one that runs the graph it gets as FX.

    The graphs Inductor would receive (after lowprec's passes) are checked and run
    without Inductor's C++; returns them by kind ("forward", "backward") as compiled.
    Callers turn AOT's cache off: on a hit no compiler runs.
    """
    from functorch.compile import make_boxed_func

    from lpcompile.backend.compile import inductor_graph_kind

    received = {}

    def inner(gm, example_inputs, *args, **kwargs):
        received[inductor_graph_kind(kwargs)] = gm
        return make_boxed_func(gm)

    stand_in_for_inductor(monkeypatch, inner)
    return received


def aot_cache_counts(make_model: Callable[[], nn.Module], x: torch.Tensor, options: dict) -> dict[str, int]:
    """AOT autograd's cache counters over two compiles of a fresh ``make_model()`` in an
    empty Inductor cache (Dynamo reset between them, as in two processes): a graph the
    cache keeps is saved once and then hit, one it cannot key is bypassed twice."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    counters.clear()
    with fresh_cache():
        for _ in range(2):
            torch._dynamo.reset()
            torch.compile(make_model(), backend="lowprec", options=options)(x).sum().backward()
    return dict(counters["aot_autograd"])
