"""Attention (option ``attention``): nn.MultiheadAttention becomes its projections and
attention, and ``"full"`` writes scaled_dot_product_attention as explicit products.

The rewrites are checked against torch's own functions with every layer excluded
(nothing rounded: only the rewrite's arithmetic differs), and the rounding with the
independent grid check of tests/grid.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from grid import GridCheck, grid_step, watched_backend
from models import Records
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import lpcompile

EAGER = {"recipe": "fp8-e5m2-sr", "executor": "eager"}
UNROUNDED = {**EAGER, "exclude": ["*"]}  # the rewrites run, no layer is rounded


def _outputs_and_grads(fn, inputs: list[torch.Tensor]):
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*inputs)
    out = out[0] + (0 if out[1] is None else out[1].sum()) if isinstance(out, tuple) else out
    out.square().sum().backward()
    return out.detach(), [x.grad for x in inputs if x.grad is not None]


def assert_rewrite_matches(fn, inputs: list[torch.Tensor], options: dict, rewrite: str) -> None:
    torch._dynamo.reset()
    records = Records()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exclude=["*"] says it leaves every layer alone
        got = _outputs_and_grads(torch.compile(fn, backend="lowprec", options=options), inputs)
    (record,) = [r for r in records.only().records if r.name == rewrite]
    assert record.nodes_removed >= 1, "the rewrite did not run"
    want = _outputs_and_grads(fn, inputs)
    # FP32 reduction order differs (three in-projection GEMMs against torch's one packed
    # GEMM): a tolerance relative to each tensor's largest value
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5 * want[0].abs().max().item())
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())


def _mha(batch_first: bool = True, **kwargs) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(8, 2, batch_first=batch_first, **kwargs)


MASK = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)  # True: not allowed (MHA's convention)


@pytest.mark.parametrize(
    "case",
    [
        dict(need_weights=False),
        dict(need_weights=True),
        dict(need_weights=True, average_attn_weights=False),
        dict(need_weights=False, attn_mask=MASK),
        dict(need_weights=False, attn_mask=MASK, is_causal=True),
        dict(need_weights=True, attn_mask=torch.randn(5, 5, generator=torch.Generator().manual_seed(0))),
        dict(need_weights=False, key_padding_mask=torch.tensor([[False] * 4 + [True], [False] * 5])),
        dict(
            need_weights=True,
            attn_mask=MASK,
            key_padding_mask=torch.tensor([[False] * 4 + [True], [False] * 5]),
        ),
    ],
    ids=lambda case: "-".join(f"{k}" for k in case),
)
def test_multihead_attention_rewrite_matches_torch(case):
    mha = _mha()
    x = torch.randn(2, 5, 8)

    def fn(x):
        return mha(x, x, x, **case)

    assert_rewrite_matches(fn, [x], UNROUNDED, "decompose_multihead_attention")


def test_multihead_attention_unbatched_and_separate_projections():
    mha = _mha(batch_first=False, kdim=6, vdim=4)
    q, k, v = torch.randn(5, 8), torch.randn(7, 6), torch.randn(7, 4)
    assert_rewrite_matches(
        lambda q, k, v: mha(q, k, v), [q, k, v], UNROUNDED, "decompose_multihead_attention"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(is_causal=True),
        dict(attn_mask=~MASK),
        dict(attn_mask=torch.randn(5, 5, generator=torch.Generator().manual_seed(1))),
        dict(scale=0.3),
        dict(enable_gqa=True),
        # a query that sees no key (left padding under a causal mask) attends to nothing
        dict(attn_mask=~MASK & torch.arange(5).ge(2)),
        dict(attn_mask=torch.zeros(5, 5).masked_fill(torch.arange(5)[:, None].lt(2), float("-inf"))),
    ],
    ids=["plain", "causal", "bool-mask", "float-mask", "scale", "gqa", "bool-masked-row", "float-masked-row"],
)
def test_full_attention_matches_sdpa(kwargs):
    kv_heads = 2 if kwargs.get("enable_gqa") else 4
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, kv_heads, 5, 8), torch.randn(2, kv_heads, 5, 8)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    assert_rewrite_matches(fn, [q, k, v], {**UNROUNDED, "attention": "full"}, "decompose_attention")


class Block(nn.Module):
    """nn.MultiheadAttention, then SDPA of a projection, as user code writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _mha()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x, need_weights=False)
        q = self.proj(y).view(2, 5, 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


class DroppingAttention(nn.Module):
    """SDPA of a projection with its dropout rate a float attribute, as HF's attention
    modules keep it: under dynamic shapes Dynamo makes the rate a graph input."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(x.size(0), x.size(1), 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=self.rate, is_causal=True)


class WeighingAttention(nn.Module):
    """nn.MultiheadAttention with dropout, returning its weights (torch's explicit path)."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.attn = _mha(dropout=rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.attn(x, x, x, need_weights=True)
        return out + weights.sum()


@pytest.mark.parametrize("attention", [DroppingAttention, WeighingAttention], ids=["sdpa", "mha-weights"])
def test_full_attention_with_dynamic_shapes_reads_the_dropout_rate_from_the_graph(attention):
    """``dynamic=True`` (as automatic dynamic shapes do at a second sequence length) makes
    the sequence length and the dropout rate symbolic: ``"full"`` writes the attention
    out with both (it stopped at a Python branch on the rate). Every product is on the
    grid at two lengths, the dropout draws (two calls differ), and at rate 0 the
    unrounded rewrite equals torch's attention at both lengths."""
    xs = [torch.randn(2, length, 8) for length in (5, 7)]
    check = GridCheck()
    torch._dynamo.reset()
    model = attention(0.25)
    compiled = torch.compile(
        model, backend=watched_backend({**EAGER, "attention": "full"}, check), dynamic=True
    )
    for x in xs:
        out = compiled(x)
        assert not torch.equal(out, compiled(x))  # dropout: another draw
        with check:
            out.square().mean().backward()
    assert check.off_grid == {} and check.count >= 2 * 8, check.products
    assert not any("scaled_dot_product" in name for name, _ in check.products)
    model = attention(0.0)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exclude=["*"] says it leaves every layer alone
        compiled = torch.compile(
            model, backend="lowprec", options={**UNROUNDED, "attention": "full"}, dynamic=True
        )
        for x in xs:
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


def test_operands_rounds_q_k_v_and_the_error_and_keeps_the_fused_kernel():
    records = Records()
    check = grid_step(Block(), {"x": torch.randn(2, 5, 8)}, EAGER)
    assert check.off_grid == {}, check.products
    fused = {name for name, _ in check.products if "scaled_dot_product" in name}
    assert len(fused) == 2, check.products  # forward and backward kernels, on grid operands
    layers = {s.layer for s in records.only().sites.values()}
    assert {"attn.in_proj_q", "attn.in_proj_k", "attn.in_proj_v", "attn.attention", "attn.out_proj"} <= layers


def test_full_puts_every_gemm_input_on_the_grid():
    check = grid_step(Block(), {"x": torch.randn(2, 5, 8)}, {**EAGER, "attention": "full"})
    assert check.off_grid == {} and check.count > 20, check.products
    assert not any("scaled_dot_product" in name for name, _ in check.products)


def test_off_leaves_attention_alone_and_rounds_the_projections():
    records = Records()
    check = grid_step(Block(), {"x": torch.randn(2, 5, 8)}, {**EAGER, "attention": "off"})
    assert any("scaled_dot_product" in name for name in check.off_grid), check.products
    layers = {s.layer for s in records.only().sites.values()}
    assert "attn.out_proj" in layers and not any("attention" in layer for layer in layers)


def test_unsupported_multihead_attention_warns_by_name():
    mha = _mha(add_bias_kv=True)
    x = torch.randn(2, 5, 8)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="MultiheadAttention .* \\['bias_k', 'bias_v'\\] stays in higher"):
        torch.compile(lambda x: mha(x, x, x)[0], backend="lowprec", options=EAGER)(x)


def test_attention_option_is_validated():
    from lpcompile import LowPrecConfig

    with pytest.raises(ValueError, match="attention must be one of"):
        LowPrecConfig.from_options({"recipe": "fp8-e5m2", "attention": "flash"})


# -- torch's fused inference paths (eval() without gradients) ------------------------------------


class _Ops(TorchDispatchMode):
    """The names of the ATen ops that ran."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__)
        return func(*args, **(kwargs or {}))


def _encoder(norm_first: bool, activation: str) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        8, 2, 16, activation=activation, norm_first=norm_first, batch_first=True
    )
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


PADDING = torch.tensor([[False] * 4 + [True], [False] * 5])


@pytest.mark.parametrize(
    ("norm_first", "activation", "masks"),
    [
        (False, "relu", {}),
        (True, "gelu", {"mask": MASK}),
        (False, "gelu", {"src_key_padding_mask": PADDING}),
        (True, "relu", {"mask": MASK, "src_key_padding_mask": PADDING}),
    ],
)
def test_encoder_layers_fast_path_is_written_out_as_torch_runs_it(norm_first, activation, masks):
    """In eval() without gradients torch runs each nn.TransformerEncoderLayer as one fused
    op, whose products nothing rounded; it becomes the layer's own path. Checked against
    that fused op, unrounded."""
    model = _encoder(norm_first, activation)
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), _Ops() as ops:
        want = model(x, **masks)
    assert "_transformer_encoder_layer_fwd.default" in ops.names  # the reference is the fused op
    torch._dynamo.reset()
    records = Records()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.compile(model, backend="lowprec", options=UNROUNDED)(x, **masks)
    # a mask makes TransformerEncoder's forward break its graph (Tensor.item): then each
    # layer compiles as a frame of its own
    rewrites = [r for g in records.new for r in g.records if r.name == "decompose_multihead_attention"]
    assert sum(r.nodes_removed for r in rewrites) >= 1  # (identical layers: one graph)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        dict(need_weights=False),
        dict(need_weights=True, average_attn_weights=False, key_padding_mask=PADDING),
        dict(need_weights=False, attn_mask=MASK, key_padding_mask=PADDING),
    ],
    ids=lambda case: "-".join(case),
)
def test_multihead_attentions_fast_path_is_written_out_as_torch_runs_it(case):
    mha = _mha().eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), _Ops() as ops:
        want = mha(x, x, x, **case)
    assert "_native_multi_head_attention.default" in ops.names
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.compile(lambda x: mha(x, x, x, **case), backend="lowprec", options=UNROUNDED)(x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masks", [{}, {"mask": MASK}], ids=["unmasked", "masked"])
def test_an_evaluated_encoder_runs_its_products_on_the_grid_named_as_in_training(masks):
    """Masked, TransformerEncoder's forward breaks its graph before the layers, whose
    forward (torch.nn code, with no parameters of its own) Dynamo would skip: lowprec has
    it traced, as a module whose fused path multiplies its children's weights."""
    model = _encoder(norm_first=False, activation="relu")
    check = GridCheck()
    records = Records()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=watched_backend(EAGER, check))(torch.randn(2, 5, 8), **masks)
    assert check.count >= 12 and check.off_grid == {}, check.products
    assert len(records.new) >= 1
    named = {"self_attn.in_proj_q", "self_attn.out_proj", "linear1", "linear2"}
    layers = {row.layer for row in lpcompile.coverage(model)}
    assert {f"layers.{i}.{name}" for i in (0, 1) for name in named} <= layers, sorted(layers)
