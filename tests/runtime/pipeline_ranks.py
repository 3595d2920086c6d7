"""Pipeline ranks for the distributed tests: a launcher, and what each rank runs.

:func:`launch` starts ``world`` processes as torchrun would (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, the store hosted outside the ranks, as
torchrun's agent hosts it) and waits for them with a deadline, killing what is left
when it passes. The processes fork from a server that has imported torch and lpcompile
once (``forkserver`` with a preload): a fresh interpreter per rank spends seconds on
imports on a small machine. Ranks report through files in a folder.

The runs (:data:`CASES`) train a small tanh MLP cut into one stage per layer (four
stages) on random data, in the same sample order in the simulator and on the ranks.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lpcompile.runtime.scaler import LossScaleConfig

PRELOAD = ["torch", "lpcompile.runtime.pipeline", "lpcompile.runtime.pipeline.distributed"]
SAMPLES = 12


def small_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy whose errors underflow E5M2 at a loss scale of 1."""
    return torch.nn.functional.cross_entropy(output, target) * 2**-16


# name -> PipelinedTrainer settings
CASES: dict[str, dict[str, Any]] = {
    "pb": {},
    "sc-lwpv": {"spike_compensation": True, "prediction": "lwp_v"},
    "fp8-sr": {
        "spike_compensation": True,
        "prediction": "lwp_v",
        "compile": {"recipe": "fp8-e5m2-sr", "executor": "eager"},
    },
    # per-stage dynamic loss scales from a start whose errors overflow E5M2
    "fp8-sr-dynamic": {
        "compile": {"recipe": "fp8-e5m2-sr", "executor": "eager"},
        "loss_scale": LossScaleConfig("dynamic", init_scale=2.0**20, growth_interval=3),
    },
    # per-layer adaptive scales from a start whose errors overflow E5M2: checked, skipped,
    # backed off per stage
    "fp8-als-overflow": {
        "compile": {"recipe": "fp8-e5m2-als", "executor": "eager", "loss_scale_init": 2**20}
    },
    # per-layer adaptive scales from a start where the errors underflow: the samples
    # quantized while they calibrate are skipped per stage
    "fp8-als-calibrate": {
        "compile": {"recipe": "fp8-e5m2-als", "executor": "eager"},
        "loss_fn": small_cross_entropy,
    },
    # dropout after every tanh: each stage draws from a random stream of its own
    "fp8-sr-dropout": {"dropout": 0.25, "compile": {"recipe": "fp8-e5m2-sr", "executor": "eager"}},
    # slow tier
    "lwpw-stash": {"prediction": "lwp_w", "weight_stash": True},
    "fp8-sr-inductor": {
        "spike_compensation": True,
        "prediction": "lwp_v",
        "compile": {"recipe": "fp8-e5m2-sr"},
    },
    # each stage's operands and errors scaled per tensor, compiled by Inductor
    "fp8-tensorwise": {"prediction": "lwp_v", "compile": {"recipe": "fp8-tensorwise"}},
    # each matmul's operands scaled per row of the dimension it sums over
    "fp8-rowwise": {"prediction": "lwp_v", "compile": {"recipe": "fp8-rowwise"}},
    "mxfp8": {"prediction": "lwp_v", "compile": {"recipe": "mxfp8"}},
    "fp8-sr-inductor-dropout": {"dropout": 0.25, "compile": {"recipe": "fp8-e5m2-sr"}},
    "fp8-als": {
        "spike_compensation": True,
        "prediction": "lwp_v",
        "compile": {"recipe": "fp8-e5m2-als", "executor": "eager", "loss_scale_interval": 2},
    },
}


def model_and_data(dropout: float = 0.0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for width in (8, 16, 16):
        layers += [nn.Linear(width, 16), nn.Tanh(), *([nn.Dropout(dropout)] if dropout else [])]
    model = nn.Sequential(*layers, nn.Linear(16, 4))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)


def trainer(case: str, distributed: bool, **kwargs: Any):
    from lpcompile.runtime.pipeline import PipelinedTrainer

    settings = {"stages": "layer", "lr": 0.05, "momentum": 0.9, **CASES[case], **kwargs}
    model, x, y = model_and_data(settings.pop("dropout", 0.0))
    return PipelinedTrainer(model, x[:1], distributed=distributed, **settings), x, y


def train(case: str, distributed: bool, epochs: int = 2) -> dict[str, Any]:
    """A run of ``case``: its full state dict, losses, and its stages' call counts at the end."""
    from lpcompile.backend import stats
    from lpcompile.backend.state import REGISTRY, fingerprint

    pipeline, x, y = trainer(case, distributed)
    pipeline.fit(x, y, epochs=epochs)
    # the call counts of this model's stage graphs (not of other models alive in the process)
    counts = [(fingerprint(p), REGISTRY.entry(p).steps) for p in pipeline.model.parameters()]
    return {
        "state": pipeline.full_state_dict(),
        "losses": pipeline.losses,
        "streams": [(digest, sorted(steps.items())) for digest, steps in counts if steps],
        "steps": pipeline.steps,
        "timings": pipeline.timings,
        "loss_scales": pipeline.loss_scales,
        "skipped": pipeline.skipped_samples,
        "calibration": pipeline.calibration_samples,
        # the layers' adaptive scales, overflows and recording calls (of this rank's stages)
        "adaptive": {t.layer: (t.cumulative, t.overflow, t.history) for t in stats(pipeline.model)},
    }


# -- what the ranks run -----------------------------------------------------------------------


def rank_train(rank: int, folder: Path, cases: list[str]) -> None:
    for case in cases:
        torch.save(train(case, distributed=True), folder / f"{case}-rank{rank}.pt")


def resumable(case: str, phase: str, distributed: bool, folder: Path, rank: int = 0) -> dict | None:
    """``full``: A samples, drain, B samples, drain. ``first``: A samples, drain, save each
    rank's state; ``rest``: fresh processes load it and run B samples, drain. ``rest-old``:
    the same from the state without the stream call counts (the SR streams restart);
    ``rest-unseeded``: with the stages' random streams at their start (dropout repeats).
    Returns the final full state dict."""
    pipeline, x, y = trainer(case, distributed=distributed)
    half = SAMPLES // 2
    if phase in ("full", "first"):
        pipeline.fit(x[:half], y[:half], seed=3)
    if phase == "first":
        torch.save(pipeline.state_dict(), folder / f"ckpt-rank{rank}.pt")
        return None
    if phase.startswith("rest"):
        state = torch.load(folder / f"ckpt-rank{rank}.pt")
        if phase == "rest-old":
            state["streams"] = []
        if phase == "rest-unseeded":
            state["random"] = pipeline.state_dict()["random"]
        if phase == "rest" and distributed:  # a bad state dict changes nothing, weights included
            before = [p.detach().clone() for p in pipeline.model.parameters()]
            zeros = {name: torch.zeros_like(p) for name, p in state["params"].items()}
            try:
                pipeline.load_state_dict({**state, "params": zeros, "adaptive": [{"bogus": 1}]})
            except ValueError:
                pass
            else:
                raise AssertionError("a bad 'adaptive' entry was loaded")
            assert all(torch.equal(a, b) for a, b in zip(before, pipeline.model.parameters(), strict=True))
        pipeline.load_state_dict(state)
    pipeline.fit(x[half:], y[half:], seed=4)
    return pipeline.full_state_dict()


def rank_resume(rank: int, folder: Path, case: str, phase: str) -> None:
    state = resumable(case, phase, True, folder, rank)
    if state is not None:
        torch.save(state, folder / f"{phase}-rank{rank}.pt")


def rank_fault(rank: int, folder: Path, victim: int, how: str, timeout: float) -> None:
    """Train; at step 6 the victim kills itself (``kill``) or stops (``stop``, a hang)."""
    pipeline, x, y = trainer("pb", distributed=True, timeout=timeout)
    for step in range(40):
        if rank == victim and step == 6:
            (folder / "fault-time").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        i = step % SAMPLES
        pipeline.step(x[i : i + 1], y[i : i + 1])
    pipeline.drain()


def rank_example(rank: int, folder: Path, argv: list[str]) -> None:
    from examples.pipeline_distributed import main

    main(argv)


# -- the launcher -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, folder: str, target: str, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the store is the launcher's, as torchrun's agent's
    )
    torch.set_num_threads(1)  # as the simulator in the test process: same bits, no oversubscription
    out = Path(folder)
    try:
        globals()[target](rank, out, *args)
        report: dict[str, Any] = {"ok": True}
    except BaseException as error:
        report = {
            "ok": False,
            "type": type(error).__name__,
            "message": str(error),
            "lost": getattr(error, "rank", None),
            "time": time.time(),
            "traceback": traceback.format_exc(),
        }
    (out / f"report-rank{rank}.json").write_text(json.dumps(report))
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(
    target: str, world: int, folder: Path, *args: Any, deadline: float = 120.0, victim: int | None = None
) -> list[int | None]:
    """Run ``target(rank, folder, *args)`` on ``world`` ranks; the exit codes (``None``:
    still running at the deadline, then killed). A stopped ``victim`` is killed once the
    others have ended."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=True, wait_for_workers=False)
    processes = mp.start_processes(
        _rank_main,
        args=(world, port, str(folder), target, args),
        nprocs=world,
        join=False,
        start_method="forkserver",
    ).processes
    end = time.monotonic() + deadline
    others = [p for rank, p in enumerate(processes) if rank != victim]
    while any(p.is_alive() for p in others) and time.monotonic() < end:
        time.sleep(0.05)
    codes = [p.exitcode for p in processes]
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
    del store
    return codes


def reports(folder: Path, world: int) -> list[dict[str, Any] | None]:
    found = []
    for rank in range(world):
        path = folder / f"report-rank{rank}.json"
        found.append(json.loads(path.read_text()) if path.exists() else None)
    return found
