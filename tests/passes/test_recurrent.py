"""nn.LSTM / GRU / RNN and their cells under the lowprec backend: the recurrent call is
written out as its cells, and a cell call as its gate products, so the gate products are
rounded. The written-out math is checked against torch's own layers with every layer
excluded (no rounding), and the rounding with tests/grid.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from grid import GridCheck, grid_step, watched_backend
from models import Records
from torch import nn

EAGER = {"recipe": "fp8-e5m2-sr", "executor": "eager"}


class LanguageModel(nn.Module):
    """A recurrent layer, or a cell stepped over the sequence by a Python loop (as
    sequence-to-sequence decoders write it), between an embedding and a head."""

    def __init__(self, cell: type[nn.Module], **kwargs) -> None:
        super().__init__()
        torch.manual_seed(0)
        directions = 2 if kwargs.get("bidirectional") else 1
        self.embed = nn.Embedding(20, 8)
        self.rnn = cell(8, 12, **kwargs)
        self.head = nn.Linear((kwargs.get("proj_size") or 12) * directions, 20)
        self.batch_first = kwargs.get("batch_first", False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.rnn, nn.RNNCellBase):
            x, state, outputs = self.embed(ids), None, []
            for t in range(ids.shape[1]):
                state = self.rnn(x[:, t], state)
                outputs.append(state[0] if isinstance(state, tuple) else state)
            return self.head(torch.stack(outputs, 1))
        x = self.embed(ids if self.batch_first else ids.t())
        return self.head(self.rnn(x)[0])


CASES = [
    (nn.LSTM, dict(num_layers=2, batch_first=True)),
    (nn.LSTM, dict(bidirectional=True)),
    (nn.GRU, dict(batch_first=True, bidirectional=True, num_layers=2)),
    (nn.GRU, dict(bias=False)),
    (nn.RNN, dict(batch_first=True)),
    (nn.RNN, dict(nonlinearity="relu", num_layers=2)),
    (nn.LSTM, dict(proj_size=5, num_layers=2, bidirectional=True)),
    (nn.LSTM, dict(proj_size=4, bias=False, batch_first=True)),
    (nn.LSTMCell, {}),
    (nn.GRUCell, dict(bias=False)),
    (nn.RNNCell, dict(nonlinearity="relu")),
]
# the layers each case names, beside the head
LAYERS = {
    0: {"rnn.weight_ih_l0", "rnn.weight_hh_l0#0", "rnn.weight_hh_l0#4", "rnn.weight_ih_l1"},
    2: {"rnn.weight_ih_l1_reverse", "rnn.weight_hh_l1_reverse#0"},
    6: {"rnn.weight_hr_l0#0", "rnn.weight_hr_l1_reverse#4", "rnn.weight_ih_l1_reverse"},
    8: {"rnn.weight_ih#0", "rnn.weight_hh#0", "rnn.weight_ih#4", "rnn.weight_hh#4"},
    9: {"rnn.weight_ih#0", "rnn.weight_hh#4"},
}


@pytest.mark.parametrize(("cell", "kwargs"), CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_cells_match_torch_forward_and_backward(cell, kwargs):
    model = LanguageModel(cell, **kwargs)
    ids = torch.randint(0, 20, (3, 5))
    want = model(ids)
    want.square().sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    records = Records()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exclude=["*"]: every layer left alone
        options = {**EAGER, "exclude": ["*"]}
        got = torch.compile(model, backend="lowprec", options=options)(ids)
    assert any(r.name == "decompose_recurrent_layers" and r.nodes_removed for r in records.only().records)
    got.square().sum().backward()
    # FP32 reduction order differs from torch's fused cells: a tolerance relative to each
    # tensor's largest value
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for name, p in model.named_parameters():
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-4 * scale, msg=name)


@pytest.mark.parametrize("case", sorted(LAYERS))
def test_gate_products_run_on_the_grid(case):
    cell, kwargs = CASES[case]
    records = Records()
    check = grid_step(LanguageModel(cell, **kwargs), {"ids": torch.randint(0, 20, (3, 5))}, EAGER)
    assert check.off_grid == {} and check.count > 10, check.products
    layers = {s.layer for s in records.only().sites.values()}
    assert LAYERS[case] | {"head"} <= layers, sorted(layers)


def test_a_sequence_length_made_symbolic_keeps_the_gate_products_on_the_grid():
    """A language model trained over windows of 8 tokens and a shorter last one (as
    truncated back-propagation through time runs): at the second length Dynamo makes the
    sequence length symbolic, and the graph compiled for it is specialized to it. Every
    product runs on the grid at each length; the graph of one length never serves
    another."""
    model = LanguageModel(nn.LSTM, num_layers=2)
    check = GridCheck()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=watched_backend(EAGER, check))
    for length in (8, 5, 8, 6):
        check.products.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = compiled(torch.randint(0, 20, (3, length)))
            with check:
                out.square().mean().backward()
        assert out.shape == (length, 3, 20)
        assert check.off_grid == {} and check.count > 4 * length, (length, check.products)
        said = [str(w.message) for w in caught]
        symbolic = [m for m in said if "recurrent layer 'rnn' has a symbolic sequence length" in m]
        assert len(symbolic) == (length in (5, 6)), said


@pytest.mark.parametrize(
    ("executor", "recipe"),
    [
        pytest.param("eager", "fp32", marks=pytest.mark.slow),
        pytest.param("eager", "fp8-e5m2-sr", marks=pytest.mark.slow),
        pytest.param("inductor", "fp8-e5m2-sr", marks=pytest.mark.slow),
    ],
)
def test_a_layer_compiled_with_dynamic_shapes_computes_torch_lstm_at_each_length(executor, recipe):
    """``dynamic=True``, an LSTM fed the model's input (no gradient), every layer left
    unrounded: at each length, in any order, it computes torch's LSTM. Unrolled, or left
    whole by a recipe that rounds nothing: AOT autograd then traces torch's math, not
    oneDNN's kernel, which returned no workspace for the backward and failed."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 8, num_layers=2, batch_first=True)
    torch._dynamo.reset()
    options = {"recipe": recipe, "executor": executor, "exclude": ["*"]}
    compiled = torch.compile(lstm, backend="lowprec", options=options, dynamic=True)
    for length in (5, 7, 5, 6):
        x = torch.randn(2, length, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the specialization, exclude=["*"]
            out = compiled(x)[0]
        out.square().sum().backward()
        torch.testing.assert_close(out, lstm(x)[0], rtol=1e-5, atol=1e-6)
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in lstm.parameters())


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_a_data_dependent_sequence_length_is_refused_by_name():
    lstm = nn.LSTM(4, 4)

    def run(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return lstm(x[torch.nonzero(keep).squeeze(1)])[0]

    torch._dynamo.reset()
    compiled = torch.compile(run, backend="lowprec", options=EAGER)
    with pytest.raises(Exception, match="has a data-dependent sequence length"):
        compiled(torch.randn(6, 2, 4), torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool))
