"""Gloo ranks spawned by a test, bounded by a deadline, and the models they train.

``run_ranks(fn, tmp_path, *args)`` starts ``world`` processes (spawn), each joining one
gloo process group through a file store in ``tmp_path`` (no port to race for on a shared
machine) and calling ``fn(rank, *args)``. What ``fn`` returns comes back through a file
per rank; an exception comes back as its traceback. Past the deadline every rank still
running is killed: a test fails, it never hangs. The functions a rank runs must be
importable by name (module level in a test module or here).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 2
# A rank's collectives give up after this long (init_process_group's timeout); the test's
# deadline for all ranks together is longer.
COLLECTIVE_TIMEOUT = 20.0
DEADLINE = 120.0
EAGER_SR = {"recipe": "fp8-e5m2-sr", "executor": "eager"}
EAGER_ALS = {"recipe": "fp8-e5m2-als", "executor": "eager"}


@dataclass
class Ranks:
    """What the ranks of one run did."""

    exitcodes: list[int | None]  # None: killed at the deadline
    results: list[Any]
    errors: list[str | None]  # a rank's traceback
    seconds: float
    finished: list[float] = field(default_factory=list)  # when each rank's process ended (monotonic)

    def check(self) -> list[Any]:
        """The results, after asserting that every rank returned one."""
        problems = [
            f"rank {r}: " + ("killed at the deadline" if code is None else f"exit {code}\n{self.errors[r]}")
            for r, code in enumerate(self.exitcodes)
            if code != 0
        ]
        assert not problems, "\n".join(problems)
        return self.results


def _rank_main(rank: int, fn: Callable, world: int, out: str, timeout: float, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    path = Path(out)
    try:
        store = dist.FileStore(str(path / "store"), world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
        )
        result = fn(rank, *args)
        torch.save({"result": result}, path / f"rank{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, path / f"rank{rank}.pt")
        sys.stdout.flush()
        os._exit(1)  # no process-group teardown waiting on a dead peer
    dist.destroy_process_group()
    # No interpreter teardown either: a C++ thread still joinable at exit aborted a rank
    # whose result was saved ("terminate called without an active exception", FSDP2 + DCP).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    fn: Callable,
    tmp_path: Path,
    *args: Any,
    world: int = WORLD,
    timeout: float = COLLECTIVE_TIMEOUT,
    deadline: float = DEADLINE,
) -> Ranks:
    """Run ``fn(rank, *args)`` on ``world`` spawned gloo ranks; kill them all at ``deadline`` seconds."""
    out = tmp_path / "ranks"
    out.mkdir()
    start = time.monotonic()
    context = mp.start_processes(
        _rank_main, args=(fn, world, str(out), timeout, args), nprocs=world, join=False, start_method="spawn"
    )
    processes = context.processes
    finished = [0.0] * world
    while time.monotonic() - start < deadline:
        for r, process in enumerate(processes):
            if process.exitcode is not None and not finished[r]:
                finished[r] = time.monotonic()
        if all(finished):
            break
        time.sleep(0.05)
    for process in processes:
        if process.exitcode is None:
            process.kill()
        process.join()
    exitcodes = [p.exitcode if finished[r] else None for r, p in enumerate(processes)]
    files = [out / f"rank{r}.pt" for r in range(world)]
    saved = [torch.load(f, weights_only=False) if f.exists() else {} for f in files]
    return Ranks(
        exitcodes,
        [s.get("result") for s in saved],
        [s.get("error") for s in saved],
        time.monotonic() - start,
        finished,
    )


# ---------------------------------------------------------------------------------- models


def mlp3(seed: int = 0) -> nn.Sequential:
    """The three-layer MLP: an ``nn.Sequential`` of torch layers, no forward of its own."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


class Block(nn.Module):
    """A block with a forward of its own (the unit FSDP2 shards in torchtitan)."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class Blocks(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([Block(8, 16), Block(16, 16)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x)


def wide_mlp(seed: int = 0) -> nn.Sequential:
    """Three 1 MiB layers: with DDP's 1 MiB buckets, Dynamo's DDPOptimizer splits the graph."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 4),
    )
