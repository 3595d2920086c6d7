"""FlexAttention (``torch.nn.attention.flex_attention``): one fused call whose Q, K, V and
error are rounded, as ``scaled_dot_product_attention``'s under ``attention="operands"``.

Torch runs FlexAttention's backward on GPUs only: on the CPU the forward is checked
against torch's own call on operands rounded by torch's float8 cast, and the backward's
nodes in the rewritten graph; the training step runs where ``LOWPREC_TEST_DEVICE=cuda``."""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
from devices import TEST_DEVICE
from grid import GridCheck, grid_step, on_e5m2_grid, watched_backend
from models import Records
from torch import nn
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import lpcompile
import lpcompile.backend.compile as backend

FLEX = torch.ops.higher_order.flex_attention
QUANTIZE = torch.ops.lowprec.quantize.default
QUANTIZE_GRAD = torch.ops.lowprec.quantize_grad.default
SCALE_GRAD = torch.ops.lowprec.scale_grad.default
RNE = {"recipe": "fp8-e5m2", "executor": "eager"}


def e5m2(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float8_e5m2).to(t.dtype)


def causal(b, h, q, k):
    return q >= k


class FlexBlock(nn.Module):
    """Projections and FlexAttention with a score_mod that reads a parameter (a per-head
    bias), a causal block mask and grouped query heads (4 query heads, 2 key/value)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(32, 32)
        self.kv = nn.Linear(32, 32)
        self.out = nn.Linear(32, 32)
        self.head_bias = nn.Parameter(torch.randn(4) / 4)

    def forward(self, x: torch.Tensor, block_mask) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, 2, 8).permute(2, 0, 3, 1, 4)
        y = flex_attention(
            q,
            k,
            v,
            score_mod=lambda score, b, h, qi, ki: score + self.head_bias[h],
            block_mask=block_mask,
            enable_gqa=True,
        )
        return self.out(y.transpose(1, 2).reshape(b, n, 32))


def _mask(device: torch.device | str = "cpu"):
    return create_block_mask(causal, None, None, 16, 16, device=str(device))


def attend(q, k, v, block_mask):
    return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5, block_mask=block_mask)


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_flex_attention_computes_torchs_call_on_rounded_operands(executor):
    """Forward (the CPU runs no FlexAttention backward): torch's FlexAttention of Q, K, V
    rounded to nearest by torch's float8 cast; bit for bit as FX, within FP32 reduction
    order under Inductor's FlexAttention kernel."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8) * 3 for _ in range(3))
    block_mask = _mask()
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(attend, backend="lowprec", options={**RNE, "executor": executor})(
            q, k, v, block_mask
        )
        want = attend(e5m2(q), e5m2(k), e5m2(v), block_mask)
        unrounded = attend(q, k, v, block_mask)
    assert not torch.equal(want, unrounded)
    if executor == "eager":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flex_attention_operands_are_on_the_grid():
    """The projections and FlexAttention, read by the grid check (tests/grid.py) inside the
    compiled graph; with attention='off' FlexAttention's operands are off the grid."""
    x = torch.randn(2, 16, 32)
    for attention, on_grid in (("operands", True), ("off", False)):
        check = GridCheck()
        torch._dynamo.reset()
        with torch.no_grad():
            options = {**RNE, "attention": attention}
            torch.compile(FlexBlock(), backend=watched_backend(options, check))(x, _mask())
        assert check.products[("flex_attention", on_grid)] == 1, check.products
        assert check.products[("addmm.default", True)] == 3, check.products


def _rewritten_graph(monkeypatch, options: dict) -> torch.fx.GraphModule:
    """The Dynamo graph of a training call of FlexBlock after lowprec's passes. Torch
    refuses FlexAttention inputs that need gradients on the CPU before Dynamo's graph has
    it: that check is lifted, and the graph taken before anything is compiled from it."""
    graphs = []

    def capture(gm, *args, **kwargs):
        graphs.append(gm)
        raise RuntimeError("captured")

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    monkeypatch.setattr(backend, "_execute", capture)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="captured"):
        torch.compile(FlexBlock(), backend="lowprec", options=options)(torch.randn(2, 16, 32), _mask())
    (gm,) = graphs
    return gm


def test_flex_attention_error_is_rounded_at_its_output(monkeypatch):
    """FlexAttention returns its output with the logsumexp: the error's quantize sits on
    the output item, and every reader of the output reads it."""
    records = Records()
    gm = _rewritten_graph(monkeypatch, {"recipe": "fp8-e5m2-sr"})
    (call,) = gm.graph.find_nodes(op="call_function", target=FLEX)
    (output,) = [u for u in call.users if u.target is operator.getitem and u.args[1] == 0]
    (error,) = output.users
    assert error.target is QUANTIZE_GRAD
    layer = error.meta["lowprec"]["layer"]
    roles = {(s.layer, s.role) for s in records.only().sites.values()}
    assert {(layer, "activation"), (layer, "error")} <= roles


def test_adaptive_scaling_unscales_a_score_mod_parameter(monkeypatch):
    """Adaptive loss scaling scales the error at FlexAttention's output and unscales the
    gradients of its inputs: Q, K, V and the score_mod's parameter, passed in a tuple."""
    gm = _rewritten_graph(monkeypatch, {"recipe": "fp8-e5m2-als"})
    (call,) = gm.graph.find_nodes(op="call_function", target=FLEX)
    (output,) = [u for u in call.users if u.target is operator.getitem and u.args[1] == 0]
    (error,) = output.users  # the error is scaled, then rounded (in the backward's order)
    assert error.target is QUANTIZE_GRAD and {u.target for u in error.users} == {SCALE_GRAD}
    for operand in call.args[:3]:  # rounded (the forward's quantize) from the unscaled value
        assert operand.target is QUANTIZE and operand.args[0].target is SCALE_GRAD
    (bias,) = call.args[7]  # score_mod_other_buffers
    assert bias.target is SCALE_GRAD and bias.args[0].target is not SCALE_GRAD


def test_attention_full_keeps_flex_probabilities_and_says_so():
    """attention='full' cannot write FlexAttention out: one warning naming the layer, and
    a coverage row for its probabilities."""
    model = FlexBlock()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.compile(model, backend="lowprec", options={**RNE, "attention": "full"})(
            torch.randn(2, 16, 32), _mask()
        )
    messages = [str(w.message) for w in caught if "FlexAttention" in str(w.message)]
    assert len(messages) == 1 and "probabilities are not" in messages[0], messages
    kept = [row for row in lpcompile.coverage(model) if row.kept]
    assert [row.op for row in kept] == ["flex_attention probabilities"], kept


@pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="torch runs FlexAttention's backward on GPUs only")
def test_flex_attention_trains_on_the_grid():
    """On ``LOWPREC_TEST_DEVICE=cuda``: a training step with every product's operands on
    the grid, FlexAttention's backward (its error) included."""
    model = FlexBlock().to(TEST_DEVICE)
    x = torch.randn(2, 16, 32, device=TEST_DEVICE)
    check = grid_step(model, {"x": x, "block_mask": _mask(TEST_DEVICE)}, {**RNE, "recipe": "fp8-e5m2-sr"})
    assert check.off_grid == {}, check.products
    assert check.products[("flex_attention", True)] == 1
    assert check.products[("flex_attention_backward", True)] == 1
    assert on_e5m2_grid(model.q.weight.grad)
