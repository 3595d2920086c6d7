"""Pipelined backpropagation on torch.distributed ranks: throughput, utilisation, P2P time.

A tanh MLP of four ``Linear(W, W)`` layers (W = 1024 by default), one stage per layer
(S = 4), batch size 1, PB+SC+LWP^v: each stage's step (a matrix-vector forward, the
two products of its backward, the optimizer's update of W^2 weights) costs far more
than its message (W floats each way). The same pipeline runs on 1, 2 and 4 ranks
(4, 2 and 1 stages per rank), each rank a process on one thread, started by torchrun
(``python -m torch.distributed.run --standalone``); gloo on CPUs, NCCL on CUDA, as the
trainer chooses. Also the single-process simulator, for the cost of the rank machinery.

Measured after a warm-up, over ``--steps`` steps of a full pipeline:

* samples/s (one sample enters per step) and the speed-up over one rank;
* per rank, the utilisation: the share of the step spent in its stages (forwards,
  backwards, optimizer) against the ideal, the share it would have if messages cost
  nothing and were overlapped, i.e. its stage time over the slowest rank's;
* per rank, the time per step in messages (P2P): waiting for the neighbours' messages,
  packing and posting its own.

    python -m benchmarks.bench_pipeline_distributed [--ranks 1 2 4] [--width 1024] [--steps 400] [--repeats 3]

Times are host clocks: on CUDA the stage time is what the host spent launching and
waiting, not the device's busy time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import write_results

STAGES = 4


def build(width: int, distributed: bool):
    from lpcompile.runtime.pipeline import PipelinedTrainer

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(STAGES):
        layers += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*layers[:-1])
    trainer = PipelinedTrainer(
        model,
        torch.randn(1, width),
        stages="layer",
        lr=1e-4,
        momentum=0.9,
        spike_compensation=True,
        prediction="lwp_v",
        loss_fn=lambda out, target: ((out - target) ** 2).mean(),
        distributed=distributed,
    )
    return trainer


def measure(trainer, width: int, warmup: int, steps: int) -> dict:
    """Run ``warmup`` steps, then time ``steps`` steps of the full pipeline."""
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(64, 1, width, generator=g), torch.randn(64, 1, width, generator=g)
    for i in range(warmup):
        trainer.step(xs[i % 64], ys[i % 64])
    before = trainer.timings
    start = time.perf_counter()
    for i in range(steps):
        trainer.step(xs[i % 64], ys[i % 64])
    seconds = time.perf_counter() - start
    after = trainer.timings
    trainer.drain()
    delta = {k: after[k] - before[k] for k in ("steps", "step_s", "transport_s", "compute_s")}
    return {
        "rank": trainer.rank,
        "world": trainer.world_size,
        "stages": [stage.index for stage in trainer.stages],
        "samples_per_s": steps / seconds,
        "step_ms": 1e3 * delta["step_s"] / delta["steps"],
        "compute_ms": 1e3 * delta["compute_s"] / delta["steps"],
        "p2p_ms": 1e3 * delta["transport_s"] / delta["steps"],
        "device": str(next(trainer.model.parameters()).device),
    }


def ping_pong(width: int, rounds: int = 200) -> float:
    """Ranks 0 and 1: half the mean round trip (ms) of a message of ``width`` floats."""
    import torch.distributed as dist

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    buffer = torch.zeros(width, device=device)
    for i in range(rounds + 10):
        if i == 10:
            start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, dst=1)
            dist.recv(buffer, src=1)
        elif rank == 1:
            dist.recv(buffer, src=0)
            dist.send(buffer, dst=0)
    if device != "cpu":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / rounds / 2


def worker(folder: Path, width: int, warmup: int, steps: int) -> None:
    torch.set_num_threads(1)
    trainer = build(width, distributed=True)
    result = measure(trainer, width, warmup, steps)
    if trainer.world_size == 2:
        result["one_way_ms"] = ping_pong(width)
    (folder / f"rank{trainer.rank}.json").write_text(json.dumps(result))


def run_ranks(ranks: int, width: int, warmup: int, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            "-m",
            "benchmarks.bench_pipeline_distributed",
            "--worker",
            folder,
            f"--width={width}",
            f"--warmup={warmup}",
            f"--steps={steps}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{ranks} ranks failed:\n{done.stderr[-3000:]}")
        return [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(ranks)]


def row(name: str, results: list[dict], base: float | None) -> str:
    rate = statistics.fmean(r["samples_per_s"] for r in results)
    slowest = max(r["compute_ms"] for r in results)
    measured = " / ".join(f"{r['compute_ms'] / r['step_ms']:.2f}" for r in results)
    ideal = " / ".join(f"{r['compute_ms'] / slowest:.2f}" for r in results)
    compute = " / ".join(f"{r['compute_ms']:.2f}" for r in results)
    p2p = " / ".join(f"{r['p2p_ms']:.2f}" for r in results)
    speed = "1.00" if base is None else f"{rate / base:.2f}"
    step = statistics.fmean(r["step_ms"] for r in results)
    per_rank = len(results[0]["stages"])
    cells = [name, str(per_rank), f"{rate:.0f}", speed, f"{step:.2f}", compute, measured, ideal, p2p]
    return "| " + " | ".join(cells) + " |"


def _median_run(runs: list[list[dict]]) -> list[dict]:
    """Of repeated runs, the one with the median samples/s."""
    rates = [statistics.fmean(r["samples_per_s"] for r in run) for run in runs]
    return runs[sorted(range(len(runs)), key=rates.__getitem__)[len(runs) // 2]]


def side_by_side(width: int, warmup: int, steps: int) -> float:
    """The control: two simulators in two processes at once, no messages between them; the
    mean samples/s each gets. What two ranks could get from the machine at best, each
    doing all four stages' work instead of two."""
    command = [sys.executable, "-m", "benchmarks.bench_pipeline_distributed", "--control"]
    command += [f"--width={width}", f"--warmup={warmup}", f"--steps={steps}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pair = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    rates = [float(p.communicate(timeout=1800)[0].split()[-1]) for p in pair]
    return statistics.fmean(rates)


def table(width: int, ranks: list[int], warmup: int, steps: int, repeats: int) -> tuple[str, str]:
    """The rows of one width (each the median of ``repeats`` runs, taken in turn so that
    a shared machine's drift hits every configuration alike), and the ranks' device."""
    found: dict[int, list[list[dict]]] = {r: [] for r in [0, *ranks]}  # 0: the simulator
    controls = []
    for _ in range(repeats):
        found[0].append([measure(build(width, distributed=False), width, warmup, steps)])
        controls.append(side_by_side(width, warmup, steps))
        for r in ranks:
            found[r].append(run_ranks(r, width, warmup, steps))
    simulated = _median_run(found[0])[0]
    control = statistics.median(controls)
    runs = {r: _median_run(found[r]) for r in ranks}
    base = statistics.fmean(r["samples_per_s"] for r in runs[min(runs)])
    lines = [
        "| run | stages per rank | samples/s | speed-up | step ms | stage ms/step (per rank) "
        "| utilisation (per rank) | ideal utilisation | P2P ms/step (per rank) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        row("simulator (1 process)", [simulated], None),
        f"| control: 2 simulators side by side, no messages | 4 | {control:.0f} each | "
        f"{control / simulated['samples_per_s']:.2f} each | | | | | |",
    ]
    lines += [row(f"{r} rank{'s' * (r > 1)}", results, base) for r, results in runs.items()]
    if 2 in runs:
        latency = runs[2][0]["one_way_ms"]
        lines.append(
            f"\nA message of {width} floats between two ranks (ping-pong, half the round trip): "
            f"{latency:.3f} ms, measured right after the 2-rank run."
        )
    return "\n".join(lines), runs[min(runs)][0]["device"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--small", type=int, default=64, help="a width whose stages cost little (0: none)")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration, in turn")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--control", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.control:
        torch.set_num_threads(1)
        print(
            measure(build(args.width, distributed=False), args.width, args.warmup, args.steps)[
                "samples_per_s"
            ]
        )
        return 0
    if args.worker is not None:
        worker(args.worker, args.width, args.warmup, args.steps)
        return 0

    torch.set_num_threads(1)
    load = os.getloadavg()[0]  # what else the machine runs: ranks above the free cores take turns
    main_table, device = table(args.width, args.ranks, args.warmup, args.steps, args.repeats)
    print(main_table)
    cores = os.cpu_count()
    body = (
        f"A tanh MLP of {STAGES} `Linear(W, W)` layers, one stage per layer (S = {STAGES}, delays "
        "6, 4, 2, 0), batch size 1, PB+SC+LWP^v; every rank a process on one thread "
        f"({device}), started by torchrun; the simulator in one process for comparison. "
        f"{args.warmup} warm-up steps, then {args.steps} steps timed; each row the median (by "
        f"samples/s) of {args.repeats} runs taken in turn with the other rows'; per-rank columns "
        "list ranks 0, 1, ... . Speed-up: samples/s over the 1-rank run. Utilisation: the share of a rank's "
        "step spent in its stages (forwards, backwards, optimizer); ideal: its stage time over the "
        "slowest rank's, what it would be with free, overlapped messages (PB itself has no bubble "
        "once the pipeline is full: every stage works at every step). P2P: waiting for the "
        "neighbours' messages, packing and posting its own. Control: two simulators run at once "
        "in two processes, without messages: the samples/s each gets (and its ratio to one "
        "simulator alone) is what this machine gives two busy processes at that moment, so two "
        "ranks, each with half the stages, can reach about twice that ratio at best. Reproduce: "
        "`python -m benchmarks.bench_pipeline_distributed`."
        f"\n\n## W = {args.width}: the stages' compute dominates\n\n"
        f"Per stage and step: a {args.width}x{args.width} matrix-vector product forward, two "
        f"backward, the update of {args.width * args.width} weights; a message is {args.width} "
        f"floats.\n\n{main_table}\n"
    )
    if args.small:
        small_table, _ = table(args.small, args.ranks, args.warmup, args.steps, args.repeats)
        print(small_table)
        body += (
            f"\n## W = {args.small}: the stages cost little\n\nWhat the rank machinery and the "
            f"messages cost per step when there is almost nothing to overlap them with.\n\n"
            f"{small_table}\n"
        )
    body += (
        f"\n## What this run can and cannot show\n\nThis machine has {cores} cores, shared with "
        f"other jobs (load average {load:.1f} when the run started, {os.getloadavg()[0]:.1f} at its "
        "end, the run's own processes included). With more ranks than free cores the ranks take "
        "turns on the cores: samples/s "
        "cannot grow past the number of free cores, a rank's stage time stretches when it is "
        "descheduled mid-stage, and the time a rank waits for a descheduled neighbour counts as P2P "
        "time, so P2P time here measures scheduling as much as communication (the messages "
        "themselves are a few KiB through loopback TCP). The 4-rank rows therefore do not show "
        "what 4 stages on 4 cores or GPUs would give; the 2-rank row is the one with a core per "
        "rank, less what the other jobs take. Where each rank has a core or a GPU of its own, the "
        "speed-up over one rank approaches the ideal utilisation times the number of ranks, and "
        "the same script measures it there unchanged (NCCL and `cuda:LOCAL_RANK` on CUDA; host "
        "clocks, so on a GPU the stage time is what the host spent launching and waiting)."
    )
    path = write_results("pipeline_distributed", "Pipelined backpropagation on torch.distributed ranks", body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
