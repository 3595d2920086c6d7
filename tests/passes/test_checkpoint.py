"""Activation-checkpoint bodies: the quantize pass enters them, and the recomputation in
the backward rounds exactly as the forward did (stochastic rounding included)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from grid import SR_EVERYWHERE, Calls, grid_step, watched_backend
from models import Records, ResidualBlock, aot_cache_counts
from torch import nn
from torch._higher_order_ops.map import map as map_over
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import lpcompile
from lpcompile.backend import lowprec


class Checkpointed(nn.Module):
    """A residual MLP whose blocks are checkpointed, as memory-bound training does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([ResidualBlock(), ResidualBlock()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


class CheckpointedAttention(nn.Module):
    """Scaled-dot-product attention with dropout in a checkpoint body: only the explicit
    form (``attention="full"``) runs its products on the grid on the CPU."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(16, 48)
        self.dropout = dropout

    def body(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        return out.transpose(1, 2).reshape(2, 8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=False)


class CheckpointedLayer(nn.Module):
    """A layer the passes write out (nn.MultiheadAttention, nn.LSTM) in a checkpoint body."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = checkpoint(self.layer, x, use_reentrant=False)
        return out[0] if isinstance(out, tuple) else out


BODIES = {
    "sdpa": (CheckpointedAttention, "out#0"),  # the attention's first product, named after its node
    "multihead": (
        lambda: CheckpointedLayer(nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True)),
        "layer.self_attn.in_proj_q",
    ),
    "lstm": (lambda: CheckpointedLayer(nn.LSTM(16, 16, batch_first=True)), "layer"),
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_layers_the_passes_write_out_are_written_out_in_bodies_too(name):
    """Attention (``attention="full"``), nn.MultiheadAttention and recurrent layers inside a
    checkpoint body ran as one FP32 call before."""
    make, layer = BODIES[name]
    records = Records()
    check = grid_step(
        make(),
        {"x": torch.randn(2, 8, 16)},
        {"recipe": "fp8-e5m2-sr", "executor": "eager", "attention": "full"},
    )
    assert check.count >= 8 and check.off_grid == {} and not check.unknown, check.products
    assert any(s.layer.startswith(layer) for s in records.only().sites.values())


def test_checkpoint_bodies_are_quantized():
    records = Records()
    check = grid_step(
        Checkpointed(), {"x": torch.randn(4, 8)}, {"recipe": "fp8-e5m2-sr", "executor": "eager"}
    )
    assert check.off_grid == {} and check.count >= 14, check.products
    layers = {s.layer for s in records.only().sites.values()}
    assert layers == {"blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.1.b", "head"}


def test_random_operators_in_bodies_compile_with_inductors_python_wrapper():
    """AOT autograd runs a body's random operators that Inductor does not lower (CPU's
    fused SDPA, which may drop out) from a saved generator state, so that the
    recomputation draws what the forward drew; Inductor's C++ wrapper cannot call those.
    ``wrapper="auto"`` writes such graphs' wrapper in Python (HF models under
    ``gradient_checkpointing_enable()`` failed to compile), ``"cpp"`` is refused."""
    x = torch.randn(2, 8, 16)
    uncached = {"enable_autograd_cache": False}  # a graph loaded from the cache compiles nothing
    with torch._functorch.config.patch(uncached), torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        model = CheckpointedAttention(dropout=0.0)
        run = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr"})
        run(x).square().sum().backward()
        assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        torch._dynamo.reset()
        options = {"recipe": "fp8-e5m2-sr", "wrapper": "cpp"}
        run = torch.compile(CheckpointedAttention(dropout=0.0), backend="lowprec", options=options)
        with pytest.raises(
            Exception, match=r"wrapper='cpp': Inductor's C\+\+ wrapper cannot call the random"
        ):
            run(x)


def test_the_recomputation_rounds_as_the_forward_did():
    calls = Calls(torch.ops.lowprec.quantize.default)
    torch._dynamo.reset()
    out = torch.compile(Checkpointed(), backend=watched_backend(SR_EVERYWHERE, calls))(torch.randn(4, 8))
    with calls:
        out.square().sum().backward()
    outputs = defaultdict(list)  # each site's outputs, by its offset, in call order
    for _, args, rounded in calls.calls:
        outputs[args[5]].append(rounded)
    recomputed = {offset: seen for offset, seen in outputs.items() if len(seen) == 2}
    assert len(recomputed) >= 8, "the bodies' forward quantizes did not run again in the backward"
    for offset, (forward, again) in recomputed.items():
        assert torch.equal(forward, again), f"site {offset:#x} rounded differently when recomputed"


class Plain(Checkpointed):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_adaptive_loss_scaling_scales_layers_in_bodies_as_without_checkpointing():
    """Round-to-nearest everywhere, so the bits do not depend on the sites' offsets: three
    steps of the checkpointed model equal three of the same model without checkpoints."""
    options = {"recipe": "fp8-e5m2", "loss_scale": "adaptive", "loss_scale_interval": 1, "executor": "eager"}
    x = torch.randn(4, 8) * 1e-3
    results = []
    for cls in (Checkpointed, Plain):
        model = cls()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="lowprec", options=options)
        for _ in range(3):
            model.zero_grad()
            (compiled(x).square().sum() * 1e-4).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((grads, [(t.layer, t.cumulative) for t in lpcompile.stats(model)]))
    (grads, stats), (plain_grads, plain_stats) = results
    assert [layer for layer, _ in stats] == ["blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.1.b", "head"]
    assert stats == plain_stats and any(scale > 1 for _, scale in stats), stats
    for got, want in zip(grads, plain_grads, strict=True):
        assert torch.equal(got, want)


def test_dynamos_own_checkpoint_bodies_are_left_unchanged():
    """The passes work on a copy: Dynamo keeps using the graph (and bodies) it handed over."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return lowprec(gm, example_inputs, {"recipe": "fp8-e5m2-sr", "executor": "eager"})

    torch._dynamo.reset()
    torch.compile(Checkpointed(), backend=backend)(torch.randn(4, 8)).sum().backward()
    (gm,) = seen
    bodies = [m for m in gm.modules() if m is not gm and isinstance(m, torch.fx.GraphModule)]
    assert len(bodies) == 2
    for body in bodies:
        assert "lowprec" not in body.code, body.code


@pytest.mark.slow
def test_aot_autograds_cache_keeps_a_checkpointed_graph():
    """The passes' links from a body to its parent graph are cyclic: left in the body's meta,
    AOT autograd could not pickle its cache key, logged the error and compiled again in every
    process. A second compile of the model is now a cache hit."""
    aot = aot_cache_counts(Checkpointed, torch.randn(4, 8), {"recipe": "fp8-e5m2-sr", "executor": "inductor"})
    assert aot.get("autograd_cache_bypass", 0) == 0 and aot.get("autograd_cache_hit", 0) == 1, aot


def test_products_in_other_higher_order_subgraphs_warn_by_name():
    """``map``'s body is a subgraph the pass does not enter: never silently FP32."""

    class Mapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return map_over(lambda row: self.a(row), x)

    model = Mapped()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2", "executor": "eager"})
    with pytest.warns(UserWarning, match=r"subgraphs stay in higher precision: linear in 'a'"):
        compiled(torch.randn(3, 2, 4))
    kept = {row.layer: row.kept for row in lpcompile.coverage(model)}
    assert kept == {"a": "in a higher-order op's subgraph"}
