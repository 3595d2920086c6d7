"""torch.distributed.pipelining's schedules over lowprec-compiled stages: gloo ranks,
spawned here, each holding one stage of an MLP. Every product of a stage, forward and
backward, runs on the E5M2 grid. Per-layer adaptive loss scaling across the stages
trains as the same stages chained in one process under one ``LossScaler("adaptive")``,
bit for bit; replicas of a stage sum their statistics, and stages whose layers have the
same names are refused."""

from __future__ import annotations

import pytest
import torch
from grid import GridCheck, watched_backend
from ranks import EAGER_ALS, EAGER_SR, WORLD, run_ranks
from torch import nn

import lpcompile
from lpcompile import LossScaler

# Stochastic rounding with rank 0's bits on every rank, as in the one-process reference.
ALS = {**EAGER_ALS, "seed_per_rank": False}
MICROBATCHES = 2
OVERFLOW_STEP = 6  # targets that overflow E5M2 in the last stage


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


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean() * 1e-6  # errors that underflow E5M2 at scale 1


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    return x, y * (1e9 if step == OVERFLOW_STEP else 1.0)


def _parts() -> tuple[nn.Module, nn.Module]:
    model = _mlp(4)
    return model[:4], model[4:]  # two linear layers each, named as in the model


def _summary(scaler: LossScaler, parts: list[nn.Module]) -> dict:
    return {
        "weights": [p.detach().clone() for part in parts for p in part.parameters()],
        # (without graph_id: each process numbers its own compiles)
        "telemetry": [
            {k: v for k, v in t.__dict__.items() if k != "graph_id"}
            for part in parts
            for t in lpcompile.stats(part)
        ],
        "skipped": scaler.skipped_steps,
        "calibration": scaler.calibration_steps,
    }


def _adaptive_stage(rank: int, schedule: str, steps: int) -> dict:
    part = _parts()[rank]
    compiled = torch.compile(part, backend="lowprec", options=ALS)
    scaler = LossScaler("adaptive")
    sched = _stage(rank, compiled, schedule, MICROBATCHES, lambda out, y: scaler.scale(_loss(out, y)))
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step)
        sched.step(x, target=y) if rank == 0 else sched.step(target=y)
        if schedule == "Schedule1F1B":  # as before clipping (the first stage scaled no loss)
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return _summary(scaler, [part])


def _one_process(steps: int, schedule: str) -> dict:
    """The two stages chained in one process, in the order the schedule runs each stage's
    calls: GPipe's stages run every microbatch's forward, then their backwards; 1F1B's last
    stage runs each microbatch's backward before the next forward (a stage refreshes its
    scales at its next forward). Gradients averaged over microbatches."""
    parts = _parts()
    first, last = (torch.compile(part, backend="lowprec", options=ALS) for part in parts)
    scaler = LossScaler("adaptive")
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        x, y = _batch(step)
        if step == 0:  # the schedule infers shapes by calling each stage once more
            h = last(torch.empty_like(first(x[:2])).requires_grad_())
            torch.autograd.grad(scaler.scale(_loss(h, y[:2])), h)
        flows = []
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
            h = first(xm)
            received = h.detach().requires_grad_()
            loss = scaler.scale(_loss(last(received), ym))
            if schedule == "Schedule1F1B":
                loss.backward()
            flows.append((h, received, loss))
        for h, received, loss in flows:
            if schedule == "ScheduleGPipe":
                loss.backward()
            h.backward(received.grad)
        for p in params:
            p.grad.div_(MICROBATCHES)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return _summary(scaler, parts)


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_adaptive_loss_scaling_across_stages_trains_as_one_process(tmp_path, schedule):
    """Each stage keeps its own layers' scales, calibrates (the first stage on errors that
    reach it only once the last stage's scales are set), skips the steps the other stage
    skips, and backs off where a step overflowed: weights, scales and telemetry as the
    stages chained in one process under one scaler."""
    steps = OVERFLOW_STEP + 2
    ranks = run_ranks(_adaptive_stage, tmp_path, schedule, steps).check()
    expected = _one_process(steps, schedule)
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == expected["skipped"]
    assert ranks[0]["calibration"] == expected["calibration"] >= 2  # the first stage calibrates later
    assert expected["skipped"] == expected["calibration"] + 1  # and the overflow
    weights = ranks[0]["weights"] + ranks[1]["weights"]
    assert all(torch.equal(a, b) for a, b in zip(weights, expected["weights"], strict=True))
    assert str(ranks[0]["telemetry"] + ranks[1]["telemetry"]) == str(expected["telemetry"])  # NaN: no errors
    first, last = expected["telemetry"][:2], expected["telemetry"][2:]
    assert all(t["cumulative"] > 1 for t in first)  # calibrated from the errors the last stage let through
    assert any(t["overflow"] for t in last)


def _same_names(rank: int, scaled: bool) -> None:
    part = _mlp(2)  # every stage's layers named 0 and 2
    compiled = torch.compile(part, backend="lowprec", options=ALS)
    scaler = LossScaler("adaptive")
    loss_fn = (lambda out, y: scaler.scale(_loss(out, y))) if scaled else _loss
    sched = _stage(rank, compiled, "ScheduleGPipe", MICROBATCHES, loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    x, y = _batch(0)
    sched.step(x, target=y) if rank == 0 else sched.step(target=y)
    scaler.step(opt)


@pytest.mark.slow
def test_stages_with_the_same_layer_names_or_no_scaled_loss_are_refused_on_every_rank(tmp_path):
    """Ranks whose layers have the same names are taken for replicas, whose statistics are
    summed: stages with such names, only one of which computes the loss, are refused. A
    pipeline whose loss was never scaled is refused too. Every rank raises: none waits."""
    said = {
        True: "ranks 0, 1 of the scaler's process_group step adaptive scales of layers with the same names",
        False: "step() called before scale() on every rank",
    }
    for scaled, message in said.items():
        (tmp_path / str(scaled)).mkdir()
        ranks = run_ranks(_same_names, tmp_path / str(scaled), scaled)
        assert ranks.exitcodes == [1, 1], ranks
        for error in ranks.errors:
            assert message in error, error


def _replicated_stage(rank: int, schedule: str) -> dict:
    """Rank ``rank`` of 2 pipelines of 2 stages: stage ``rank // 2``, replica ``rank % 2``,
    whose data differ in scale (so would their statistics, each alone)."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    stage, replica = divmod(rank, 2)
    pipes = [dist.new_group([r, r + 2]) for r in range(2)]  # every rank makes every group
    replicas = [dist.new_group([2 * s, 2 * s + 1]) for s in range(2)]
    part = _parts()[stage]
    compiled = torch.compile(part, backend="lowprec", options=ALS)
    scaler = LossScaler("adaptive")
    loss_fn = lambda out, y: scaler.scale(_loss(out, y))  # noqa: E731
    piped = pipelining.PipelineStage(compiled, stage, 2, torch.device("cpu"), group=pipes[replica])
    sched = getattr(pipelining, schedule)(piped, MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    for step in range(4):
        x, y = _batch(step)
        y = y * 64.0**replica
        sched.step(x, target=y) if stage == 0 else sched.step(target=y)
        for p in part.parameters():
            dist.all_reduce(p.grad, group=replicas[stage])
            p.grad.div_(2)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return _summary(scaler, [part])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_replicas_of_a_stage_sum_their_statistics(tmp_path, schedule):
    """Two stages, each on two data-parallel ranks: the replicas of a stage find each
    other by their layers' names and choose their scales from their summed statistics, so
    they keep the same scales and weights; the stages keep their own. Under 1F1B the last
    stage refreshes from its first microbatch before the first step tells the replicas
    apart: each from its own data, until they join the first replica's state."""
    ranks = run_ranks(_replicated_stage, tmp_path, schedule, world=4).check()
    for stage in (0, 1):
        one, other = ranks[2 * stage], ranks[2 * stage + 1]
        assert str(one["telemetry"]) == str(other["telemetry"])
        assert all(torch.equal(a, b) for a, b in zip(one["weights"], other["weights"], strict=True))
        assert [t["layer"] for t in one["telemetry"]] == [["0", "2"], ["4", "6"]][stage]
    histories = [t["history"] for t in ranks[0]["telemetry"] + ranks[2]["telemetry"]]
    assert all(len(h) >= 2 for h in histories), histories
    assert len({r["skipped"] for r in ranks}) == 1


def _interleaved_stages(rank: int) -> dict:
    """Stages ``rank`` and ``rank + 2`` of four, one linear layer each, under one scaler and
    one optimizer per rank."""
    from torch.distributed import pipelining

    model = _mlp(4)
    mine = [model[2 * stage : 2 * stage + 2] for stage in (rank, rank + 2)]
    scaler = LossScaler("adaptive")
    stages = [
        pipelining.PipelineStage(
            torch.compile(part, backend="lowprec", options=ALS), stage, 4, torch.device("cpu")
        )
        for part, stage in zip(mine, (rank, rank + 2), strict=True)
    ]
    loss_fn = lambda out, y: scaler.scale(_loss(out, y))  # noqa: E731
    sched = pipelining.ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for part in mine for p in part.parameters()], lr=0.1)
    for step in range(OVERFLOW_STEP):
        x, y = _batch(step)
        sched.step(x, target=y) if rank == 0 else sched.step(target=y)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return _summary(scaler, mine)


@pytest.mark.slow
def test_interleaved_stages_calibrate_under_one_scaler_per_rank(tmp_path):
    """Two stages per rank (interleaved 1F1B): each rank's scaler steps both stages'
    states; every stage calibrates, the first ones once errors reach them, and the ranks
    skip the same steps."""
    ranks = run_ranks(_interleaved_stages, tmp_path).check()
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == ranks[0]["calibration"] >= 2
    telemetry = ranks[0]["telemetry"] + ranks[1]["telemetry"]
    assert sorted(t["layer"] for t in telemetry) == ["0", "2", "4", "6"]
    assert all(t["cumulative"] > 1 for t in telemetry), telemetry
