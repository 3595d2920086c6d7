"""Whole compiled graphs with ``codegen="triton"`` against ``executor="eager"``.

The same model, seed and inputs run twice: once with the AOT graphs as plain
FX over the reference ops (``executor="eager"``), once with the fusion groups
replaced by generated Triton (interpreted on CPU; compiled with
``LOWPREC_TEST_DEVICE=cuda``, both runs then on the GPU). Outputs and gradients must
be bit-identical, and the kernel count per graph is what the fusion promises,
read from the codegen's own record (``CompiledGraph.fused``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import interpreted  # noqa: F401
from devices import TEST_DEVICE
from models import assert_same_step, convnet, convnet_input, lowprec_nodes, mlp, step
from torch import nn

import lpcompile
from lpcompile import backend
from lpcompile.codegen import clear_memory_cache, compile_stats
from lpcompile.tools import dump

pytestmark = pytest.mark.usefixtures("interpreted")


class BiasMLP(nn.Module):
    """x @ W.T + b with the bias add visible in the graph (not folded into addmm)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(24, 12) / 4)
        self.b1 = nn.Parameter(torch.randn(24) / 4)
        self.w2 = nn.Parameter(torch.randn(5, 24) / 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(F.relu(torch.matmul(x, self.w1.t()) + self.b1), self.w2.t())


class Block(nn.Module):
    """A pre-norm transformer block: attention and an MLP with ReLU (GELU: see test_codegen_ops)."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj(torch.matmul(att, v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.relu(self.up(self.norm2(x))))


class ComplexMLP(nn.Module):
    """A complex product between two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(8, 8), nn.Linear(16, 4)
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.cfloat) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(torch.view_as_real(torch.complex(h, h.flip(-1)) @ self.w).flatten(-2))


def run(make, x, options, steps=2):
    torch._dynamo.reset()
    model = make().to(TEST_DEVICE)
    x = x.to(TEST_DEVICE)
    compiled = torch.compile(model, backend="lowprec", options=options)
    results = [step(model, lambda: compiled(x)) for _ in range(steps)]
    return results, backend.REGISTRY.records[-1], model


def compare(make, x, options, steps=2):
    expected, _, _ = run(make, x, {**options, "executor": "eager"}, steps)
    got, record, model = run(make, x, {**options, "codegen": "triton"}, steps)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_same_step(g, e, f"step {i}")
    return record, model


def kernels_by_graph(record) -> dict[str, list]:
    out: dict[str, list] = {}
    for k in record.fused:
        out.setdefault(k.graph, []).append(k)
    return out


def test_mlp_sr_bit_identical_and_kernel_count():
    record, _ = compare(mlp, torch.randn(7, 6), {"recipe": "fp8-e5m2-sr"})
    kernels = kernels_by_graph(record)
    fwd = [k.nodes for k in kernels["forward"]]
    # input quantize; each layer's weight path (quantize_grad copy + quantize) is one kernel;
    # the error copy + relu + next activation's quantize is one kernel.
    assert fwd == [
        ["quantize"],
        ["quantize_grad", "quantize_1"],
        ["quantize_grad_1", "relu", "detach", "quantize_2"],
        ["quantize_grad_2", "quantize_3"],
    ]
    # error and weight-gradient SR quantizes; relu's backward fuses into the error's quantize.
    bwd = [k.nodes for k in kernels["backward"]]
    assert len(bwd) == 4 and ["detach_1", "threshold_backward", "quantize_6"] in bwd
    assert all(k.exact for k in record.fused)
    # the fused graph calls the launchers (marked for lowprec dump) and no lowprec op is left
    # but the last layer's error copy (an identity, left as it is)
    forward = record.aten_graphs["forward"]
    calls = [n for n in forward.graph.nodes if dump.node_kind(n) == "fused_kernel"]
    assert len(calls) == 4
    left = [n.name for n in forward.graph.nodes if dump.lowprec_op(n) is not None]
    assert left == ["quantize_grad_3"]
    assert set(record.kernels) == {k.name for k in record.fused}


def test_bias_add_relu_quantize_fuse_in_the_graph():
    record, _ = compare(BiasMLP, torch.randn(9, 12), {"recipe": "fp8-hybrid"})
    fwd = {tuple(k.nodes) for k in kernels_by_graph(record)["forward"]}
    assert ("quantize_grad_1", "add", "relu", "detach", "quantize_2") in fwd


def test_convnet_and_transformer_block_bit_identical():
    record, _ = compare(convnet, convnet_input(), {"recipe": "fp8-e5m2-sr"})
    assert len(record.fused) >= 8
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    record, _ = compare(Block, x, {"recipe": "fp8-hybrid"}, steps=1)
    assert any("relu" in k.nodes for k in record.fused)


def test_complex_roundings_run_unfused_and_match():
    """Triton has no complex dtype: the complex product's roundings run as lowprec's
    operator, the real layers' in generated kernels."""
    record, _ = compare(ComplexMLP, torch.randn(4, 8), {"recipe": "fp8-e5m2-sr"})
    assert any(kernels_by_graph(record).values())
    graphs = record.aten_graphs.items()
    unfused = {kind: sum(n.meta["val"].is_complex() for n in lowprec_nodes(gm)) for kind, gm in graphs}
    # forward: the activation, the weight, the weight's and the output's quantize_grad;
    # backward: the error and the weight gradient
    assert unfused == {"forward": 4, "backward": 2}


def test_adaptive_loss_scaling_statistics_fuse_and_match():
    """lowprec.scale_grad's backward: error x scale, SR quantize and the histogram in one kernel."""
    options = {"recipe": "fp8-e5m2-als", "loss_scale_interval": 1}
    x = torch.randn(7, 6)
    expected, _, ref_model = run(mlp, x, {**options, "executor": "eager"}, steps=3)
    got, record, _ = run(mlp, x, {**options, "codegen": "triton"}, steps=3)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_same_step(g, e, f"step {i}")
    (ref_state,) = backend.REGISTRY.adaptive_states(graph_id=backend.REGISTRY.records[-2].graph_id)
    (state,) = backend.REGISTRY.adaptive_states(graph_id=record.graph_id)
    assert torch.equal(state.scales, ref_state.scales)
    assert [t.history for t in state.telemetry] == [t.history for t in ref_state.telemetry]
    stats = kernels_by_graph(record)["backward[stats]"]
    # each layer's error: histogram + sums + scaled SR quantize; each weight gradient:
    # SR quantize + unscale: one kernel each. The inf/NaN count is on the (smaller) bias
    # gradient, which stays with the ATen ops.
    assert len(stats) == 4
    with_hist = [k for k in stats if any(r.startswith("index_add") for r in k.reductions)]
    assert len(with_hist) == 2 and all(any(n.startswith("quantize") for n in k.nodes) for k in with_hist)
    unscale = [k for k in stats if k.nodes[0].startswith("quantize") and k.outputs[0].startswith("mul")]
    assert len(unscale) == 2 and not any(k.reductions for k in unscale)


def test_pipeline_predicted_weight_and_quantize_fuse():
    options = {"recipe": "fp8-hybrid", "pipeline": {"stages": 2, "prediction": "lwp_v"}}

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    record, _ = compare(make, torch.randn(5, 8), options, steps=1)
    fwd = [k.nodes for k in kernels_by_graph(record)["forward"]]
    assert ["predict_weight", "quantize_grad", "quantize_1"] in fwd
    # a kernel never spans two pipeline stages
    forward = record.aten_graphs["forward"]
    for node in forward.graph.nodes:
        if dump.node_kind(node) == "fused_kernel":
            assert node.meta.get("stage") is not None


def test_second_compile_compiles_no_kernel():
    x = torch.randn(7, 6)
    run(mlp, x, {"recipe": "fp8-e5m2-sr", "codegen": "triton"}, steps=1)
    before = compile_stats()
    assert set(before) == {"jit", "memory_hits", "written", "disk_hits", "launches", "relayouts"}
    _, record, _ = run(mlp, x, {"recipe": "fp8-e5m2-sr", "codegen": "triton"}, steps=1)
    after = compile_stats()
    assert record.fused and after["jit"] == before["jit"]
    assert after["memory_hits"] - before["memory_hits"] == len(record.fused)
    # a new process (here: the in-memory cache cleared) imports the cached files, writes none
    clear_memory_cache()
    run(mlp, x, {"recipe": "fp8-e5m2-sr", "codegen": "triton"}, steps=1)
    final = compile_stats()
    assert final["written"] == after["written"]
    assert final["disk_hits"] > after["disk_hits"]


def test_saturation_counts_match_the_eager_executor():
    """The gradient sites' counts (``count_grad``'s backward) come out of the Triton graph as
    the eager executor counts them, and the step is unchanged."""
    options = {"recipe": "fp8-e5m2-sr", "saturation": "count"}
    x = torch.randn(7, 6, generator=torch.Generator().manual_seed(5)) * 3e4
    expected, _, ref_model = run(mlp, x, {**options, "executor": "eager"})
    got, _, model = run(mlp, x, {**options, "codegen": "triton"})
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert_same_step(g, e, f"step {i}")

    def counts(m):
        return sorted(
            (r.layer, r.role, r.calls, r.saturated, r.nonfinite, r.nonzero, r.underflow)
            for r in lpcompile.saturation(m)
        )

    rows = counts(model)
    assert rows == counts(ref_model)
    assert any(role == "weight_grad" and big for _, role, _, big, *_ in rows), "x beyond E5M2: counted"
