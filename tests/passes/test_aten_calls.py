"""Modules whose ``forward`` calls ATen operators (``torch.ops.aten.linear``, ``mm``,
``conv1d``, ``lstm``, ...), as the modules ``torch.export`` writes do, and the stages of
``torch.distributed.pipelining.pipeline()``: their products are rounded like the torch
functions', checked on the E5M2 grid by a dispatch mode; an ATen product lowprec does not
rewrite warns and has a coverage row."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from grid import SR_EVERYWHERE, GridCheck, watched_backend
from torch import nn
from torch.distributed.pipelining import pipe_split, pipeline

import lpcompile
from lpcompile.passes.dynamo.quantize import ATEN_OPAQUE

aten = torch.ops.aten


class Mixed(nn.Module):
    """A linear layer, attention (nn.MultiheadAttention, SDPA), einsum, matmul, a
    convolution, an LSTM and tensordot: what an exported model calls as ATen operators."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.c = nn.Conv1d(4, 4, 3, padding=1)
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        x = x + self.attn(x, x, x)[0]
        x = torch.einsum("bij,bkj->bik", x, x) @ x
        x = self.c(x) + F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None])[:, 0]
        return torch.tensordot(self.rnn(x)[0], self.w, dims=([2], [1]))


def on_grid(module: nn.Module, x: torch.Tensor) -> GridCheck:
    """One step of ``module`` (which takes its input by position) under the grid check."""
    check = GridCheck()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lowprec")
        out = torch.compile(module, backend=watched_backend(SR_EVERYWHERE, check))(x)
        with check:
            out.square().mean().backward()
    assert check.products and not check.off_grid, (dict(check.products), check.off_grid)
    return check


def test_an_exported_module_runs_its_products_on_the_grid():
    x = torch.randn(2, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export's about the LSTM's flat weights
        exported = torch.export.export(Mixed(), (x,)).module()
    calls = {n.target for n in exported.graph.nodes if n.op == "call_function"}
    assert {aten.linear.default, aten.conv1d.default, aten.lstm.input, aten.einsum.default} <= calls
    check = on_grid(exported, x)
    ran = {op for op, _ in check.products}
    assert {
        "convolution.default",
        "bmm.default",
        "_scaled_dot_product_flash_attention_for_cpu.default",
    } <= ran
    roles = {row.layer: set(row.quantized) for row in lpcompile.coverage(exported)}
    # named after the modules export recorded, as the live model's are (a root weight: itself)
    for layer in ("a", "attn#0", "attn#3", "c", "rnn.weight_ih_l0", "w"):
        assert {"weight", "weight_grad"} <= roles[layer], roles


def test_an_exported_module_inside_a_model_names_its_layers_from_the_model():
    x = torch.randn(2, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(Mixed(), (x,)).module()
    model = nn.Sequential(nn.Linear(8, 8), exported)
    check = GridCheck()
    torch._dynamo.reset()
    options = {**SR_EVERYWHERE, "exclude": ["1.a"]}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lowprec")
        out = torch.compile(model, backend=watched_backend(options, check))(x)
        with check:
            out.square().mean().backward()
    rows = {row.layer: row for row in lpcompile.coverage(model)}
    assert {"0", "1.attn#0", "1.c", "1#0"} <= set(rows), sorted(rows)  # 1#i: its forward's own
    assert rows["1.a"].kept and not rows["1.a"].quantized and rows["1.c"].quantized


def test_two_exported_modules_one_checkpointed_are_each_named_from_the_model():
    x = torch.randn(2, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enc, dec = (torch.export.export(Mixed(), (x,)).module() for _ in range(2))

    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.dec = enc, dec

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dec(torch.utils.checkpoint.checkpoint(self.enc, x, use_reentrant=False))

    model = EncoderDecoder()
    on_grid(model, x)
    layers = {row.layer for row in lpcompile.coverage(model)}
    # each module's layers under its own name, those reading no parameter too (attn#1: q @ k)
    named = {m: {layer.removeprefix(m) for layer in layers if layer.startswith(m)} for m in ("enc", "dec")}
    assert named["enc"] == named["dec"] and {".a", ".attn#1", ".c", "#0"} <= named["enc"], sorted(layers)
    assert len(layers) == 2 * len(named["enc"]), sorted(layers)


def test_pipeline_stages_run_their_products_on_the_grid():
    class TwoStages(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.b(torch.relu(self.a(x)))
            pipe_split()
            return self.c(torch.relu(x))

    x = torch.randn(2, 8)
    pipe = pipeline(TwoStages(), mb_args=(x,))
    on_grid(pipe.split_gm.submod_pp_0, x)
    on_grid(pipe.split_gm.submod_pp_1, x)
    assert [row.layer for row in lpcompile.coverage(pipe.split_gm.submod_pp_1)] == ["c"]


def test_an_aten_product_left_as_it_is_warns():
    class Convolution(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(2, 2, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return aten.convolution.default(x, self.weight, None, [1], [0], [1], False, [0], 1)

    model = Convolution()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2"})(torch.randn(1, 2, 5))
    assert any("aten::convolution" in str(w.message) for w in caught)
    rows = [(row.layer, row.op, row.kept) for row in lpcompile.coverage(model)]
    assert rows == [("weight", "aten::convolution", ATEN_OPAQUE)]


def test_calls_of_operator_packets_are_rounded():
    """``torch.ops.aten.mm(a, b)``, without an overload, as users write ATen calls."""

    class Packets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.w = nn.Parameter(torch.randn(8, 8) / 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return aten.mm(aten.linear(x, self.w), aten.t(self.w))

    model = Packets()
    check = on_grid(model, torch.randn(2, 8))
    assert sum(check.products.values()) == 5  # two products forward, three backward
    assert all(set(row.quantized) >= {"weight", "weight_grad"} for row in lpcompile.coverage(model))


def test_an_aten_matrix_power_warns():
    class Power(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ aten.matrix_power.default(self.w, 3)

    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="aten::matrix_power"):
        torch.compile(Power(), backend="lowprec", options={"recipe": "fp8-e5m2"})(torch.randn(2, 4))
