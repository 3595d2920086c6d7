"""torch.distributed.pipelining's schedules over lowprec-compiled stages: two gloo ranks,
spawned here, each holding one stage of an MLP. Every product of a stage, forward and
backward, runs on the E5M2 grid; adaptive loss scaling, which sums each layer's
statistics over the scaler's ranks, refuses ranks that hold different layers instead of
summing them."""

from __future__ import annotations

import pytest
import torch
from grid import GridCheck, watched_backend
from ranks import EAGER_ALS, EAGER_SR, WORLD, run_ranks
from torch import nn

from lpcompile import LossScaler


def _mlp(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(8, 8), nn.ReLU())])


def _stage(rank: int, compiled: nn.Module, schedule: str, microbatches: int, loss_fn):
    """A schedule of ``microbatches`` over this rank's stage, ``compiled``."""
    from torch.distributed import pipelining

    stage = pipelining.PipelineStage(compiled, rank, WORLD, torch.device("cpu"))
    return getattr(pipelining, schedule)(stage, microbatches, loss_fn=loss_fn)


def _schedule_on_the_grid(rank: int, schedule: str) -> dict:
    import torch.distributed.pipelining.stage as stage_code

    check = GridCheck()
    backward = stage_code.stage_backward

    def watched_backward(*args, **kwargs):
        with check:
            return backward(*args, **kwargs)

    stage_code.stage_backward = watched_backward
    part = _mlp(3)[:2] if rank == 0 else _mlp(3)[2:]  # one linear layer, then two
    compiled = torch.compile(part, backend=watched_backend(EAGER_SR, check))
    sched = _stage(rank, compiled, schedule, 4, lambda out, target: (out - target).square().mean())
    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    sched.step(x, target=y) if rank == 0 else sched.step(target=y)
    trained = all(p.grad is not None for p in part.parameters())
    return {"off": check.off_grid, "count": check.count, "grads": trained}


def test_gpipe_and_1f1b_stages_run_every_product_on_the_grid(tmp_path):
    for schedule in ("ScheduleGPipe", "Schedule1F1B"):
        (tmp_path / schedule).mkdir()
        results = run_ranks(_schedule_on_the_grid, tmp_path / schedule, schedule).check()
        assert [r["off"] for r in results] == [{}, {}], results
        # forward: a product per linear layer per microbatch, and the schedule's first call
        # that infers the stage's shapes; backward: per layer and microbatch, the weight
        # gradient's product, and the input gradient's but for the model's input
        assert [r["count"] for r in results] == [5 + 4, 10 + 4 * 4], results
        assert all(r["grads"] for r in results), results


def _adaptive_across_stages(rank: int, first_scales: bool) -> None:
    part = _mlp(4)[:4] if rank == 0 else _mlp(4)[4:]  # two linear layers each
    compiled = torch.compile(part, backend="lowprec", options=EAGER_ALS)
    scaler = LossScaler("adaptive")
    loss_fn = lambda out, target: scaler.scale((out - target).square().mean())  # noqa: E731
    sched = _stage(rank, compiled, "ScheduleGPipe", 2, loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=0.01)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    sched.step(x, target=y) if rank == 0 else sched.step(target=y)
    if rank == 0 and first_scales:
        scaler.scale(torch.zeros(()))  # this stage computes no loss
    scaler.step(opt)


@pytest.mark.slow
def test_adaptive_loss_scaling_refuses_pipeline_stages_on_every_rank(tmp_path):
    """Two layers' statistics per rank, as many on each: summed over the ranks, each
    stage's scales would have been chosen from the other stage's errors too. The first
    stage, which computes no loss, calls no scale(): every rank raises, none waits for it."""
    said = {
        True: "they scale different layers",
        False: "step() called before scale() on rank 0 of the scaler's process_group",
    }
    for first_scales, message in said.items():
        (tmp_path / str(first_scales)).mkdir()
        ranks = run_ranks(_adaptive_across_stages, tmp_path / str(first_scales), first_scales)
        assert ranks.exitcodes == [1, 1], ranks
        for error in ranks.errors:
            assert message in error and "pipeline-parallel ranks" in error, error
