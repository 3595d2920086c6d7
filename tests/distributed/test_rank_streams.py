"""Stochastic rounding on data-parallel ranks, and where DDP reduces the gradients.

Each rank folds its rank into the seed (``step_seed(seed, step, rank)``): on identical
inputs the ranks draw different bits, and each rank's bits are those of a hand-written
reference with that rank's seed. Under DDP the weight gradient is quantized on each rank
(its local gradient is on the E5M2 grid), then reduced in FP32: the averaged gradient is
the FP32 mean of the ranks' quantized gradients, not quantized again.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from grid import on_e5m2_grid
from models import Records, Ref, assert_same_step, mlp, mlp_input, mlp_ref, step
from ranks import EAGER_SR, run_ranks
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from lpcompile.backend import step_seed


def _reference(model, x, call: int, rank: int, stream: int):
    ref = Ref.for_recipe("fp8-e5m2-sr", step_seed(0, call, rank), stream)
    return step(model, lambda: mlp_ref(model, x, ref))


def streams_and_reduction(rank: int) -> dict:
    """The same model and input on every rank: compiled alone (each rank's bits against
    its reference), then under DDP with a communication hook that keeps the local gradients."""
    torch._dynamo.reset()
    model, x, records = mlp(), mlp_input(), Records()
    compiled = torch.compile(model, backend="lowprec", options=EAGER_SR)
    grads = []
    for call in range(2):
        got = step(model, lambda: compiled(x))  # noqa: B023
        stream = records.only().stream
        assert_same_step(got, _reference(model, x, call, rank, stream), f"rank {rank}, call {call}")
        other = _reference(model, x, call, 1 - rank, stream)
        assert not torch.equal(got[1][0], other[1][0]), "the other rank's seed gives the same bits"
        grads.append(got[1])

    torch._dynamo.reset()
    model = mlp()
    ddp = DDP(torch.compile(model, backend="lowprec", options=EAGER_SR))
    local: dict[int, torch.Tensor] = {}
    index = {id(p): i for i, p in enumerate(model.parameters())}

    def keep_local(state, bucket):
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            local[index[id(param)]] = grad.clone()
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, keep_local)
    ddp(x).square().mean().backward()
    dist.barrier()
    reduced = {i: p.grad.clone() for i, p in enumerate(model.parameters())}
    return {"grads": grads, "local": local, "reduced": reduced}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(streams_and_reduction, tmp_path_factory.mktemp("streams")).check()


def test_each_rank_draws_its_own_reproducible_bits(runs):
    """Identical inputs, different bits; each rank matched its reference in the rank."""
    for call in range(2):
        for first, second in zip(runs[0]["grads"][call], runs[1]["grads"][call], strict=True):
            assert not torch.equal(first, second), f"call {call}: the ranks drew the same bits"


def test_ddp_reduces_the_quantized_weight_gradients_in_fp32(runs):
    weights = [i for i, g in runs[0]["local"].items() if g.dim() == 2]
    assert weights
    for i in weights:
        local = [run["local"][i] for run in runs]
        assert all(map(on_e5m2_grid, local)), f"parameter {i}: a local weight gradient is off the grid"
        assert not torch.equal(*local), f"parameter {i}: the ranks' stochastic rounding agreed"
        mean = local[0] / 2 + local[1] / 2
        for rank, run in enumerate(runs):
            assert torch.equal(run["reduced"][i], mean), f"rank {rank}, parameter {i}: not the FP32 mean"
        assert not on_e5m2_grid(mean), f"parameter {i}: the reduced gradient was quantized again"


def test_rank_zero_keeps_the_seed_and_no_two_ranks_share_one():
    assert torch.equal(step_seed(1234, 5, 0), step_seed(1234, 5))
    seeds = {int(step_seed(1234, 5, rank)) for rank in range(4096)}
    assert len(seeds) == 4096
