"""Data parallelism: throughput and the communication share of a DDP training step.

The GPT-style model of ``examples/fsdp_gpt.py`` (``examples.models.TinyGPT``) is trained
with ``DDP(torch.compile(model, ...))`` on 1 and 2 ranks (``--ranks``), each rank a
process this script spawns (joined through a file store, so no port to race for, and
killed at a deadline). In each run, two models train side by side, in blocks of 10 steps
taken in turn (``benchmarks.common.interleaved_times``): fp32 Inductor
(``torch.compile(model)``) and lowprec ``fp8-e5m2-sr`` (Inductor executor). A step is
forward, cross-entropy on random bytes, backward and SGD; no loss scaler.

The communication is timed by a DDP comm hook that does what DDP's default hook does
(divide the bucket by the world size, all-reduce it) but blocking, between clock reads
(and ``torch.cuda.synchronize`` on a GPU): first a barrier, whose time is the wait for
the slowest rank to finish its backward, then the all-reduce itself. The model's
gradients fit in one bucket (under DDP's 25 MiB), which DDP can only reduce once the
backward has finished: there is no overlap for the blocking hook to take away. The
communication share is (wait + all-reduce) / step, from the medians over steps on rank 0.

On CPUs each rank runs ``--threads`` intra-op threads (1, as torchrun sets
``OMP_NUM_THREADS``); on a GPU host (``torch.cuda.is_available()``) rank r runs on GPU r with NCCL, and
the clocks are read after ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.common import interleaved_times, write_results
from examples.models import TinyGPT

VARIANTS = {
    "fp32 Inductor": None,
    "lowprec fp8-e5m2-sr": {"recipe": "fp8-e5m2-sr"},
}
BATCH, CONTEXT = 16, 128  # per rank, as in examples/fsdp_gpt.py


class CommTimer:
    """A DDP comm hook's state: the seconds each step waited for the other ranks and spent
    in the all-reduce."""

    def __init__(self, sync: Callable[[], object]) -> None:
        self.sync = sync
        self.wait = self.reduce = 0.0
        self.steps: list[tuple[float, float]] = []

    def end_step(self) -> None:
        self.steps.append((self.wait, self.reduce))
        self.wait = self.reduce = 0.0


def timed_allreduce(state: CommTimer, bucket):  # DDP refuses string annotations here (PEP 563)
    """DDP's default hook (mean over the ranks), blocking and timed."""
    buffer = bucket.buffer()
    state.sync()
    start = time.perf_counter()
    dist.barrier()
    state.sync()
    arrived = time.perf_counter()
    buffer.div_(dist.get_world_size())
    dist.all_reduce(buffer)
    state.sync()
    state.wait += arrived - start
    state.reduce += time.perf_counter() - arrived
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


def _rank(rank: int, world: int, folder: str, rounds: int, threads: int) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    store = dist.FileStore(os.path.join(folder, "store"), world)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout
    )
    g = torch.Generator(device).manual_seed(rank)  # each rank its own data
    x = torch.randint(0, 256, (BATCH, CONTEXT), device=device, generator=g)
    y = torch.randint(0, 256, (BATCH, CONTEXT), device=device, generator=g)
    steps, timers = {}, {}
    for name, options in VARIANTS.items():
        torch.manual_seed(0)
        model = TinyGPT(context=CONTEXT).to(device)
        compiled = (
            torch.compile(model)
            if options is None
            else torch.compile(model, backend="lowprec", options=options)
        )
        ddp = DDP(compiled, device_ids=[rank] if cuda else None)
        timers[name] = timer = CommTimer(sync)
        ddp.register_comm_hook(timer, timed_allreduce)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(ddp=ddp, opt=opt, timer=timer) -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            timer.end_step()

        steps[name] = step
    times = interleaved_times(steps, rounds, sync=sync)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        result = {"params": params}
        for name, ts in times.items():
            comm = timers[name].steps[-len(ts) :]
            result[name] = {
                "step": statistics.median(ts),
                "wait": statistics.median(w for w, _ in comm),
                "reduce": statistics.median(r for _, r in comm),
                # per step: quartiles of (wait + all-reduce) / step
                "shares": statistics.quantiles(
                    [(w + r) / t for (w, r), t in zip(comm, ts, strict=True)], n=4
                ),
            }
        torch.save(result, os.path.join(folder, "result.pt"))
    dist.destroy_process_group()


def _rank_main(rank: int, world: int, folder: str, rounds: int, threads: int) -> None:
    try:
        _rank(rank, world, folder, rounds, threads)
    except BaseException:
        Path(folder, f"error{rank}.txt").write_text(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)  # no process-group teardown waiting on a dead peer


def run_ranks(world: int, rounds: int, threads: int, deadline: float) -> dict:
    """Spawn ``world`` ranks of :func:`_rank`; rank 0's figures, or an error naming what failed."""
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            _rank_main, args=(world, folder, rounds, threads), nprocs=world, join=False, start_method="spawn"
        )
        start = time.monotonic()
        while time.monotonic() - start < deadline and any(p.exitcode is None for p in context.processes):
            time.sleep(0.1)
        for p in context.processes:
            if p.exitcode is None:
                p.kill()
            p.join()
        errors = sorted(Path(folder).glob("error*.txt"))
        if errors:
            raise RuntimeError(errors[0].read_text())
        if not Path(folder, "result.pt").exists():
            raise RuntimeError(f"{world} ranks: no result within {deadline:.0f} s")
        return torch.load(Path(folder, "result.pt"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank on the CPU")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds for one run of all ranks")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    load = os.getloadavg()[0]
    runs = {world: run_ranks(world, args.rounds, args.threads, args.deadline) for world in args.ranks}
    rows = [
        "| variant | ranks | step ms | samples/s (global) | × 1 rank | wait ms | all-reduce ms"
        " | comm share | per step: quartiles |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        for world, result in runs.items():
            r = result[name]
            rate = world * BATCH / r["step"]
            base = runs[min(runs)][name]
            scaling = rate / (min(runs) * BATCH / base["step"])
            share = (r["wait"] + r["reduce"]) / r["step"]
            low, mid, high = r["shares"]
            line = (
                f"| {name} | {world} | {r['step'] * 1e3:.2f} | {rate:.0f} | {scaling:.2f}"
                f" | {r['wait'] * 1e3:.2f} | {r['reduce'] * 1e3:.2f} | {share:.0%}"
                f" | {low:.0%}, {mid:.0%}, {high:.0%} |"
            )
            rows.append(line)
            print(line, flush=True)
    params = runs[min(runs)]["params"]
    command = "python -m benchmarks.bench_scaleout " + " ".join(sys.argv[1:])
    cores = os.cpu_count()
    where = (
        "NCCL, one GPU per rank"
        if cuda
        else f"gloo on the CPU, {args.threads} thread(s) a rank, {cores} cores, load {load:.1f} at start"
    )
    body = "\n".join(rows) + (
        f"\n\nCommand: `{command}` ({where}). Model: `TinyGPT` (width 64, 3 blocks, {params:,} parameters,"
        f" {params * 4 / 2**20:.2f} MiB of FP32 gradients in one DDP bucket), {BATCH} sequences of {CONTEXT}"
        " random bytes per rank; wrapping `DDP(torch.compile(model, ...))`; SGD with momentum, no loss"
        " scaler."
        f" Medians over {args.rounds} rounds of 10 steps per variant, the variants in turn, rank 0's clock."
        " samples/s: sequences per second over all ranks. Wait: the barrier before the all-reduce (the"
        " other ranks still in their backward); all-reduce: the gradient bucket's mean over the ranks;"
        " comm share: both over the step time (medians), and the quartiles of that share step by"
        " step. Measured by a blocking DDP comm hook (see the script's docstring). Both variants reduce"
        " the same FP32 bytes: a difference between their all-reduce times is noise."
    )
    if not cuda:
        body += (
            f"\n\nWhat a CPU host can show: the ranks share its {cores} cores, {args.threads} thread(s)"
            " each (one thread: two in one process ran slower than one on a 2-core machine shared with"
            " other jobs, OpenMP waiting at its barriers for a descheduled thread). samples/s at more"
            " ranks counts cores that fewer ranks left idle, when other jobs leave them free, less the"
            " contention between the ranks, and says nothing about scaling over devices; had the ranks"
            " split one rank's cores, more ranks could not be faster. The communication share is the"
            " figure that carries over: how much of a step the gradient all-reduce and the wait for the"
            " slower rank take for this model and batch, and how lowprec's shorter or longer step"
            " changes it. Over gloo on one host the all-reduce is a copy through loopback TCP, a lower"
            " bound for a network; the wait grows when a rank is descheduled."
        )
    print(body)
    write_results(
        "scaleout", "Data parallelism: throughput and communication share (bench_scaleout.py)", body
    )


if __name__ == "__main__":
    main()
