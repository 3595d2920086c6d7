"""Pipelined backpropagation on the digits set: accuracy of the delay mitigations.

DigitsCNN (GroupNorm), batch size 1, one stage per layer (S = 4, delays
6, 4, 2, 0), the same per-sample hyperparameters for every variant, learning
rate decaying linearly to zero. Two recipes scaled to batch 1 by
``scale_hyperparameters``: batch 32 (lr 0.016, momentum 0.9 -> 0.0005,
0.9967: aggressive momentum, the slow test's setting) and batch 10 (lr 0.01,
momentum 0.9 -> 0.001, 0.9895). Variants: SGD (one stage: no delay), PB,
PB+SC, PB+LWP^v, PB+SC+LWP^v, PB+weight stash. Writes
``benchmarks/results/pipeline.md`` (mean ± std over seeds) and
``benchmarks/results/pipeline_loss.png`` (training loss, moving average).

    python -m benchmarks.bench_pipeline [--seeds 0 1 2 3 4] [--epochs 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import RESULTS, write_results
from examples.data import load_digits
from examples.pipeline_digits import VARIANTS, DigitsRun, run_digits
from lpcompile.runtime.pipeline import scale_hyperparameters

# recipe name -> (lr, momentum, batch size) of the batch-B recipe scaled to batch 1
RECIPES = {"batch-32 recipe": (0.016, 0.9, 32), "batch-10 recipe": (0.01, 0.9, 10)}


def moving_average(values: list[float], window: int) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    kernel = torch.ones(1, 1, window, dtype=torch.float64) / window
    return torch.nn.functional.conv1d(t.view(1, 1, -1), kernel).view(-1).tolist()


def plot(results: dict[str, dict[str, list[DigitsRun]]], path, window: int = 200) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, (recipe, runs) in zip(axes[0], results.items(), strict=True):
        for name, variant_runs in runs.items():
            curves = [moving_average(r.losses, window) for r in variant_runs]
            length = min(len(c) for c in curves)
            mean = [statistics.fmean(c[i] for c in curves) for i in range(length)]
            ax.plot(range(window, window + length), mean, label=name, linewidth=1.2)
        lr, momentum = variant_runs[0].lr, variant_runs[0].momentum
        ax.set_title(f"{recipe}: lr {lr:.4g}, momentum {momentum:.4f}")
        ax.set_xlabel("samples (= pipeline steps)")
        ax.set_ylabel(f"training loss (moving average of {window}, mean over seeds)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle("Pipelined backpropagation, DigitsCNN, batch size 1, S = 4 (delays 6, 4, 2, 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mean_std(values: list[float], digits: int = 1) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {std:.{digits}f}"


def table(recipe: str, runs: dict[str, list[DigitsRun]], seeds: list[int], epochs: int) -> list[str]:
    first = next(iter(runs.values()))[0]
    base_lr, base_m, batch = RECIPES[recipe]
    lines = [
        f"## {recipe}: lr {first.lr:.4g}, momentum {first.momentum:.4f}",
        "",
        f"The batch-{batch} recipe (lr {base_lr}, momentum {base_m}) scaled to batch 1 "
        f"(`scale_hyperparameters`); {epochs} epochs, seeds {seeds}, mean ± std over the seeds. "
        "A run that diverged scores about 10% (chance).",
        "",
        "| variant | test accuracy (%) | final-epoch training loss | diverged | per seed (%) | seconds/run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, variant_runs in runs.items():
        accuracies = [r.test_accuracy for r in variant_runs]
        losses = [r.final_loss for r in variant_runs]
        diverged = sum(a < 20.0 for a in accuracies)
        per_seed = ", ".join(f"{a:.1f}" for a in accuracies)
        seconds = statistics.fmean(r.seconds for r in variant_runs)
        lines.append(
            f"| {name} | {mean_std(accuracies)} | {mean_std(losses, 3)} | {diverged}/{len(accuracies)} "
            f"| {per_seed} | {seconds:.0f} |"
        )
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    args = parser.parse_args()
    data = load_digits()
    results: dict[str, dict[str, list[DigitsRun]]] = {}
    for recipe in args.recipes:
        base_lr, base_m, batch = RECIPES[recipe]
        lr, momentum = scale_hyperparameters(base_lr, base_m, batch, 1)
        for name in args.variants:
            for seed in args.seeds:
                run = run_digits(name, lr=lr, momentum=momentum, epochs=args.epochs, seed=seed, data=data)
                results.setdefault(recipe, {}).setdefault(name, []).append(run)
                print(
                    f"{recipe} {name:12s} seed {seed}: {run.test_accuracy:5.1f}%  "
                    f"loss {run.final_loss:.3f}  {run.seconds:.0f}s",
                    flush=True,
                )
    delays = next(
        r.delays for runs in results.values() for rs in runs.values() for r in rs if len(r.delays) > 1
    )
    lines = [
        "DigitsCNN (GroupNorm) on the digits set, batch size 1, the learning rate decaying linearly "
        f"to 0. SGD: one stage (no delay, plain SGD with momentum). PB variants: one stage per layer, "
        f"S = {len(delays)}, delays {delays}, the same hyperparameters. SC: Spike Compensation. LWPv: "
        "linear weight prediction from the velocity. stash: the backward reads the weights its forward "
        "read (PipeDream) instead of the current ones. Every PB variant keeps the pipeline full: no "
        "flush between epochs. Each run uses one thread (batch 1 gains nothing from more); "
        "seconds/run depend on what else the machine runs. Loss curves: `pipeline_loss.png`. "
        "Reproduce: `python -m benchmarks.bench_pipeline`.",
        "",
    ]
    for recipe, runs in results.items():
        lines += table(recipe, runs, args.seeds, args.epochs)
    path = write_results("pipeline", "Pipelined backpropagation on digits", "\n".join(lines))
    plot(results, RESULTS / "pipeline_loss.png")
    print(path.read_text())


if __name__ == "__main__":
    main()
