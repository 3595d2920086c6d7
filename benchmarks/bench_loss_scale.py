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


def mean_step(options: dict, scaler_mode: str, steps: int, warmup: int) -> float:
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
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip-experiment", action="store_true")
    args = parser.parse_args()
    fixed = mean_step({"recipe": "fp8-e5m2-sr"}, "static", args.steps, warmup=5)
    rows = [
        "| variant | mean step ms | overhead vs fixed |",
        "|---|---|---|",
        f"| fixed scale 2^8 | {fixed * 1e3:.2f} | - |",
    ]
    for interval in (1, 10, 100):
        torch._dynamo.reset()
        t = mean_step(
            {"recipe": "fp8-e5m2-als", "loss_scale_interval": interval}, "adaptive", args.steps, warmup=5
        )
        rows.append(f"| adaptive, K = {interval} | {t * 1e3:.2f} | {100 * (t / fixed - 1):+.1f}% |")
        print(rows[-1], flush=True)
    body = "## Overhead (MLP 784-1024-1024-10, batch 128, Inductor)\n\n" + "\n".join(rows)
    body += f"\n\nMean over {args.steps} steps after 5 warm-up steps. Target: ≤ 2% at K = 100.\n"
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
