"""Loss scaling under data parallelism: two gloo ranks, spawned here, agree on skipping
a step and on the adaptive per-layer scales. The models are not wrapped in DDP, whose
gradient all-reduce would spread an overflow by itself: the agreement tested is the
scaler's own."""

from __future__ import annotations

import pytest
import torch
from ranks import EAGER_ALS, WORLD, run_ranks
from torch import nn

from lpcompile import LossScaler, stats
from lpcompile.backend.state import REGISTRY


def _overflow_on_rank_1(rank: int) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler("dynamic", init_scale=2.0**8)
    loss = model(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))).sum()
    if rank == 1:
        loss = loss * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return {
        "unchanged": torch.equal(model.weight, before),
        "scale": scaler.get_scale(),
        "skipped": scaler.skipped_steps,
    }


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    results = run_ranks(_overflow_on_rank_1, tmp_path).check()
    assert results == [{"unchanged": True, "scale": 2.0**7, "skipped": 1}] * WORLD


def _adaptive_scales(rank: int, per_layer: bool = False) -> dict:
    """Per-layer scales after a few steps on data of a rank-dependent magnitude, with the
    scaler agreeing over the ranks and without; ``per_layer``: each layer compiled on its
    own, so that every graph names its one layer ``""``."""
    found = {}
    for group in ("auto", None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        if per_layer:
            for name, layer in list(model.named_children())[::2]:
                model.register_module(name, torch.compile(layer, backend="lowprec", options=EAGER_ALS))
        run = model if per_layer else torch.compile(model, backend="lowprec", options=EAGER_ALS)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = LossScaler("adaptive", process_group=group)
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(3):
            x = torch.randn(16, 8, generator=g)
            opt.zero_grad()
            loss = run(x).square().mean() * (1e-6 if rank else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        found[str(group)] = [t.cumulative for t in stats(model)]
    return found


@pytest.mark.parametrize("per_layer", [False, True], ids=["one-graph", "graph-per-layer"])
def test_adaptive_scales_agree_over_the_ranks(tmp_path, per_layer):
    first, second = run_ranks(_adaptive_scales, tmp_path, per_layer).check()
    assert first["auto"] == second["auto"]
    assert first["None"] != second["None"], "the ranks' data should ask for different scales"


def _clipped_on_rank_0(rank: int) -> dict:
    """Adaptive scaling where only rank 0 unscales to clip its gradients before stepping
    (as a pipeline stage may), the other steps straight away."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    run = torch.compile(model, backend="lowprec", options=EAGER_ALS)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = LossScaler("adaptive")
    g = torch.Generator().manual_seed(10 + rank)
    for step in range(3):
        opt.zero_grad()
        loss = run(torch.randn(16, 8, generator=g)).square().mean()
        scaler.scale(loss * (float("inf") if step == 2 and rank == 1 else 1.0)).backward()
        if rank == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    return {"skipped": scaler.skipped_steps, "scales": [t.cumulative for t in stats(model)]}


def test_ranks_that_unscale_apart_agree(tmp_path):
    """``unscale_`` is this rank's alone (as GradScaler's is): the ranks agree on inf/NaN
    in ``step``, which all of them call, so a rank that clips and one that does not step
    together, and the overflow on one of them skips the step on both."""
    first, second = run_ranks(_clipped_on_rank_0, tmp_path, timeout=30.0, deadline=120.0).check()
    assert first == second and first["skipped"] >= 1, first  # the overflow, on both


def _adaptive(model: nn.Module, rank: int) -> tuple:
    """``model`` compiled for adaptive scaling, its SGD optimizer, an adaptive scaler, and
    the generator of the rank's batches."""
    run = torch.compile(model, backend="lowprec", options=EAGER_ALS)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return run, opt, LossScaler("adaptive"), torch.Generator().manual_seed(10 + rank)


def _warmed_up(rank: int) -> list[list[float]]:
    """Per-layer scales after a backward outside the scaler (a warm-up) on data of a
    rank-dependent magnitude, then a few steps; between two of them rank 0 alone runs an
    ``eval()`` forward with grad on (a graph, and a state, the other rank lacks)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Dropout(), nn.Linear(16, 4))
    run, opt, scaler, g = _adaptive(model, rank)
    scales = []
    for step in range(5):
        if step == 3 and rank == 0:
            model.eval()
            run(torch.randn(16, 8))
            model.train()
        opt.zero_grad()
        loss = run(torch.randn(16, 8, generator=g)).square().mean() * (1e-6 if rank else 1.0)
        scaler.scale(loss).backward()
        if step > 0:  # the first backward's statistics set each rank's scales by themselves
            scaler.step(opt)
            scaler.update()
            scales.append([t.cumulative for t in stats(model)][:3])  # the training graph's
    return scales


def test_ranks_that_refreshed_apart_before_the_first_step_agree_from_it_on(tmp_path):
    """The scaler takes the first rank's per-layer state at its first step, keeping each
    rank's statistics since: the ranks then hold the same scales and calibrate together. A
    state one rank alone holds joins nothing (no collective the other rank lacks)."""
    first, second = run_ranks(_warmed_up, tmp_path).check()
    assert first == second


def _recompiled_on_rank_1(rank: int) -> dict:
    """Per-layer scales over a few steps where rank 1 alone gets a batch of another size at
    the second step (dynamic padding): it recompiles, and trains on the new graph from then
    on, while rank 0 keeps its first one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    run, opt, scaler, g = _adaptive(model, rank)
    scales = []
    for step in range(5):
        rows = 12 if rank == 1 and step > 0 else 16
        opt.zero_grad()
        loss = run(torch.randn(rows, 8, generator=g)).square().mean() * (1e-6 if rank else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append([t.cumulative for t in stats(model)])
    return {"scales": scales, "graphs": len({id(s) for s in REGISTRY.adaptive_states()})}


def test_ranks_that_recompile_apart_keep_agreeing(tmp_path):
    """The graphs of the same layers share one adaptive state: a replica that recompiled
    (a new shape) agrees with one that did not, at the same collectives, and both hold the
    same scales throughout."""
    first, second = run_ranks(_recompiled_on_rank_1, tmp_path, timeout=30.0, deadline=150.0).check()
    assert first["scales"] == second["scales"]
    assert first["graphs"] == second["graphs"] == 1


def _gan(rank: int) -> dict:
    """A GAN's two models, each with its adaptive scaler and optimizer, over a few steps
    on data of a rank-dependent magnitude: the generator's backward runs through the
    discriminator too, whose statistics its own scaler agrees at its next step. The
    discriminator's scales are read at each of its backwards, before its step."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    run_gen, opt_gen, scaler_gen, g = _adaptive(gen, rank)
    run_disc, opt_disc, scaler_disc, _ = _adaptive(disc, rank)
    magnitude = 1e-6 if rank else 1.0
    scales = []
    for _ in range(5):
        fake = run_gen(torch.randn(16, 4, generator=g))
        real = torch.randn(16, 8, generator=g)
        loss = (run_disc(fake.detach()) - run_disc(real)).square().mean() * magnitude
        scaler_disc.scale(loss).backward()
        scales.append([t.cumulative for t in stats(disc)])
        scaler_disc.step(opt_disc)
        scaler_disc.update()
        opt_disc.zero_grad()
        scaler_gen.scale(-run_disc(fake).mean() * magnitude).backward()
        scaler_gen.step(opt_gen)
        scaler_gen.update()
        opt_gen.zero_grad()
    return {"disc": scales, "gen": [t.cumulative for t in stats(gen)]}


def test_two_scalers_keep_their_replicas_agreeing(tmp_path):
    """One scaler's ``update`` leaves the replica groups of the other's states alone: the
    discriminator's scales agree over the ranks at every backward, not only after its
    scaler's steps."""
    first, second = run_ranks(_gan, tmp_path, timeout=30.0, deadline=150.0).check()
    assert first == second
    assert len(set(map(tuple, first["disc"]))) > 1, "the scales should change over the steps"


def _optimizers(rank: int) -> dict:
    """The statistics an adaptive state holds after each step over data of a rank-dependent
    magnitude (every call records them), stepped by one optimizer and by two (one per
    layer: both step the state)."""
    found = {}
    for optimizers in (1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        run = torch.compile(model, backend="lowprec", options={**EAGER_ALS, "loss_scale_interval": 1})
        scaler, g = LossScaler("adaptive"), torch.Generator().manual_seed(10 + rank)
        groups = [model.parameters()] if optimizers == 1 else [model[0].parameters(), model[2].parameters()]
        opts = [torch.optim.SGD(group, lr=0.01) for group in groups]
        found[optimizers] = []
        for _ in range(6):  # calibrating steps refresh in step(), the later ones at the next call
            loss = run(torch.randn(16, 8, generator=g)).square().mean() * (1e-3 if rank else 1.0)
            scaler.scale(loss).backward()
            for opt in opts:
                scaler.step(opt)
            (state,) = REGISTRY.adaptive_states(model)
            found[optimizers].append(None if state.hist.grad is None else state.hist.grad.clone())
            scaler.update()
            for opt in opts:
                opt.zero_grad()
    return found


def test_a_second_optimizer_sums_the_statistics_once(tmp_path):
    """Two optimizers stepping the layers of one adaptive state sum its statistics over the
    replicas once, as one optimizer does."""
    first, second = run_ranks(_optimizers, tmp_path).check()
    held = [i for i, stats in enumerate(first[1]) if stats is not None]
    assert held, "no step held statistics"
    for i in held:
        assert all(run[i] is not None for run in (second[1], first[2], second[2])), f"step {i}"
        assert torch.equal(first[1][i], second[1][i]), f"step {i}"  # summed over the ranks
        assert torch.equal(first[2][i], first[1][i]) and torch.equal(second[2][i], second[1][i]), f"step {i}"
