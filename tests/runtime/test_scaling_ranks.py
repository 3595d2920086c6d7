"""Loss scaling under data parallelism: two gloo ranks, spawned here, agree on skipping
a step and on the adaptive per-layer scales. The models are not wrapped in DDP, whose
gradient all-reduce would spread an overflow by itself: the agreement tested is the
scaler's own."""

from __future__ import annotations

import datetime
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lpcompile import LossScaler, stats

WORLD = 2
TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, work, port: int, folder: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.save(work(rank), Path(folder) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _on_ranks(work, folder: Path) -> list:
    """Run ``work(rank)`` on each rank; its results, in rank order."""
    ctx = mp.start_processes(
        _entry, args=(work, _free_port(), str(folder)), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {TIMEOUT_S} s")
    return [torch.load(folder / f"rank{rank}.pt") for rank in range(WORLD)]


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
    results = _on_ranks(_overflow_on_rank_1, tmp_path)
    assert results == [{"unchanged": True, "scale": 2.0**7, "skipped": 1}] * WORLD


def _adaptive_scales(rank: int) -> dict:
    """Per-layer scales after a few steps on data of a rank-dependent magnitude, with the
    scaler agreeing over the ranks and without."""
    found = {}
    for group in ("auto", None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        run = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-als", "executor": "eager"})
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


def test_adaptive_scales_agree_over_the_ranks(tmp_path):
    first, second = _on_ranks(_adaptive_scales, tmp_path)
    assert first["auto"] == second["auto"]
    assert first["None"] != second["None"], "the ranks' data should ask for different scales"
