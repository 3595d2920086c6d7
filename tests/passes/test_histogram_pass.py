"""``count_histograms_serially``: Inductor's histograms as one ``lowprec::count_bins`` call."""

import pytest
import torch
from devices import TEST_DEVICE
from torch import nn
from torch._functorch import config as functorch_config
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

import lpcompile  # noqa: F401  (registers the ops and the backend)
from lpcompile.backend import REGISTRY
from lpcompile.numerics.scale_grad import EXP_BINS, bin_counts_in_range
from lpcompile.passes.aot.histogram import count_histograms_serially

COUNT_BINS = torch.ops.lowprec.count_bins.default


def test_count_bins_counts_like_index_add():
    """On ``LOWPREC_TEST_DEVICE`` (a GPU counts with ``histc``), against the CPU's index_add;
    the GPU's form also on the CPU."""
    bins = torch.randint(-(2**20), 2**20, (37, 11), dtype=torch.int32) & 255
    bins[0, :5] = torch.tensor([0, 255, 255, 1, 254])  # both ends of the range
    want = torch.zeros(256).index_add(0, bins.view(-1).long(), torch.ones(bins.numel()))
    for got in (COUNT_BINS(bins.to(TEST_DEVICE), 256), bin_counts_in_range(bins, 256)):
        assert got.dtype == torch.float32 and torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="outside 0..255"):
        COUNT_BINS(torch.tensor([3, 256]), 256)


def _histograms(g, index):
    """An exponent histogram (bins masked into range) and a histogram of raw indices."""
    bins = (g.view(torch.int32) >> 23) & (EXP_BINS - 1)
    ones = torch.ones(g.numel())
    exponents = torch.zeros(EXP_BINS).index_put((bins.view(-1).long(),), ones, accumulate=True)
    raw = torch.zeros(8).index_put((index,), torch.ones(index.numel()), accumulate=True)
    return exponents, raw


def test_only_histograms_of_masked_bins_are_replaced():
    g = torch.randn(16, 9) * torch.logspace(-20, 20, 9)
    index = torch.tensor([0, -1, 3, 3, -8, 7])  # index_put wraps negative indices; bincount would refuse
    gm = make_fx(_histograms, decomposition_table=select_decomp_table())(g, index)
    count_histograms_serially(gm, None)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(COUNT_BINS) == 1
    assert targets.count(torch.ops.aten.index_put.default) == 1  # the raw-index histogram stays
    for got, want in zip(gm(g, index), _histograms(g, index), strict=True):
        assert torch.equal(got, want)


@pytest.mark.slow
def test_inductor_records_the_same_histograms_as_the_eager_executor():
    """On ``LOWPREC_TEST_DEVICE``."""

    def recorded(executor):
        torch._dynamo.reset()  # a compile, not a graph Dynamo kept from another test
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))
        model = model.to(TEST_DEVICE)
        options = {"recipe": "fp8-e5m2-als", "executor": executor, "matmul": "fp32", "loss_scale_interval": 1}
        run = torch.compile(model, backend="lowprec", options=options)
        torch.manual_seed(1)
        x = torch.randn(64, 12).to(TEST_DEVICE)
        # no cache hits: the pass runs (and is recorded) only when Inductor compiles
        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            functorch_config.patch(enable_autograd_cache=False),
        ):
            (run(x).square().mean() * 1e-3).backward()  # call 0 records
        (state,) = REGISTRY.adaptive_states(model)
        replaced = sum(  # in the backward; in "backward[stats]" where recording compiles a variant
            r.nodes_added
            for record in REGISTRY.records
            if state in REGISTRY.adaptive_states(graph_id=record.graph_id)
            for r in record.records
            if r.name == "count_histograms_serially" and r.graph.startswith("backward")
        )
        return state.hist.grad.cpu(), replaced

    (eager, _), (inductor, replaced) = recorded("eager"), recorded("inductor")
    assert replaced == 3, "one count_bins per layer's error"
    assert eager[:, :EXP_BINS].sum() > 0
    # counts are exact; the sums of |g| and g² may be added in another order
    assert torch.equal(inductor[:, :EXP_BINS], eager[:, :EXP_BINS]), (inductor - eager).abs().amax(1)
    torch.testing.assert_close(inductor[:, EXP_BINS:], eager[:, EXP_BINS:], rtol=1e-5, atol=0)
