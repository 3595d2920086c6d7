"""Adaptive per-layer loss scaling: step-time overhead and per-layer underflow.

1. Overhead: mean step time (forward, backward, SGD) of the 784-1024-1024-10 MLP,
   batch 128, compiled with Inductor: fp8-e5m2-sr with a fixed loss scale vs
   fp8-e5m2-als refreshing every K steps. The mean over a multiple of K steps
   includes the refresh steps (a median would hide them).
2. The experiment of the slow test: a deep tanh MLP with E4M3 errors (round to
   nearest) on the digits set, fixed scales 1, 2^8, 2^16 vs adaptive.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.common import write_results
from lpcompile.experiments import compare_loss_scaling, format_runs
from lpcompile.models import MLP
from lpcompile.scaling import LossScaler


def make_step(options: dict, scaler_mode: str, warmup: int = 5):
    """A compiled training step of the MLP (compiled and warmed up here)."""
    torch.manual_seed(0)
    model = MLP(784, 1024, 1024, 10)
    run = torch.compile(model, backend="lowprec", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = (
        LossScaler(scaler_mode, init_scale=2.0**8) if scaler_mode == "static" else LossScaler(scaler_mode)
    )
    x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))

    def step():
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.cross_entropy(run(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(warmup):
        step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-experiment", action="store_true")
    args = parser.parse_args()
    variants = {"fixed scale 2^8": ({"recipe": "fp8-e5m2-sr"}, "static")}
    for interval in (1, 10, 100):
        variants[f"adaptive, K = {interval}"] = (
            {"recipe": "fp8-e5m2-als", "loss_scale_interval": interval},
            "adaptive",
        )
    steps = {name: make_step(*spec) for name, spec in variants.items()}
    totals = dict.fromkeys(steps, 0.0)
    for _ in range(args.rounds):  # round-robin, so drifts of a shared machine hit all alike
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            totals[name] += time.perf_counter() - start
    mean = {name: total / (args.rounds * args.steps) for name, total in totals.items()}
    fixed = mean["fixed scale 2^8"]
    rows = ["| variant | mean step ms | overhead vs fixed |", "|---|---|---|"]
    rows += [f"| {name} | {t * 1e3:.2f} | {100 * (t / fixed - 1):+.1f}% |" for name, t in mean.items()]
    print("\n".join(rows), flush=True)
    body = "## Overhead (MLP 784-1024-1024-10, batch 128, Inductor)\n\n" + "\n".join(rows)
    body += (
        f"\n\nMean over {args.rounds} round-robin rounds of {args.steps} steps each (after 5 warm-up"
        " steps). Target: ≤ 2% at K = 100.\n"
    )
    if not args.skip_experiment:
        runs = compare_loss_scaling()
        body += "\n## Deep tanh MLP, E4M3 errors, digits (the slow test's experiment)\n\n" + format_runs(runs)
        body += (
            "\n\nPer-layer scales at the end (adaptive): "
            + ", ".join(f"{s:g}" for s in runs[-1].scales)
            + "\n"
        )
    print(body)
    write_results("loss_scale", "Adaptive loss scaling (bench_loss_scale.py)", body)


if __name__ == "__main__":
    main()
