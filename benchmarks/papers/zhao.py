"""Zhao et al. 2019, "Adaptive Loss Scaling for Mixed Precision Training", at small scale.

A deep residual CNN without normalisation (:class:`examples.models.UnnormalizedResNet`)
trained on scikit-learn's digits with Adam, errors in FP16, E5M2 (stochastic rounding)
and E4M3 (round to nearest): no loss scaling, a sweep of fixed loss scales 2^0 … 2^24,
GradScaler's dynamic rule and adaptive per-layer scaling. Each cell is the mean ± std
over the seeds. Ablation: the deep tanh MLP whose backward is given an artificial decay
(``DECAYING_ERRORS``), E4M3 errors, the same schemes.

The runs are independent: ``--workers`` (default 2) of them at a time, each in its own
one-thread process; every run seeds itself, so the numbers are those of one process
running them one after another (``--workers 1``), only the wall time changes.

    python -m benchmarks.papers.zhao [--quick] [--workers N]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence

import torch

from benchmarks.papers.common import (
    PAPERS,
    cpu_seconds,
    mean_std,
    plot_curves,
    within_spread,
    worse_by,
    write_paper,
)
from examples.data import load_digits
from examples.experiments import (
    ADAPTIVE,
    DECAYING_ERRORS,
    FORMATS,
    GROWTH_INTERVAL,
    RESNET_TRAINING,
    ScalingRun,
    Scheme,
    by_variant,
    dynamic,
    fixed,
    loss_scaling_jobs,
    run_jobs,
    worst_underflow,
)
from examples.models import DeepTanhMLP, UnnormalizedResNet

N_UF = 1e-3  # loss_scale_underflow: the authors' code (the paper's text says 1%)
PAPER = {
    "accuracy": "adaptive ≥ best fixed and dynamic (direction)",
    "underflow": f"adaptive: ≤ n_uf in every layer (n_uf {N_UF:g} in the authors' code)",
    "time": "adaptive: +0.27% of training time at K = 100",
}
# The authors' repository (XBWGC/ada-loss, examples/adaptive_loss_scaling/ssd, README):
# SSD512 on PASCAL VOC, FP16 mixed precision, batch 8, validation mAP. Shown beside the
# matching FP16 rows for direction only: another model, task and metric.
SSD_VOC_MAP = {
    "fp32": "78.94 (FP32 baseline)",
    "fixed 2^0": "diverged (no loss scale)",
    "fixed 2^3": "78.83",
    "fixed 2^7": "78.71",
    "fixed 2^8": "78.36",
    "adaptive": "79.27; 79.24 refreshed every 10 iterations",
}


def schemes(step: int = 1) -> list[Scheme]:
    """Fixed scales 2^0, 2^step, … 2^24, GradScaler's rule and adaptive scaling."""
    return [*(fixed(k) for k in range(0, 25, step)), dynamic(GROWTH_INTERVAL), ADAPTIVE]


def sweep(step: int) -> str:
    return "at every power of two" if step == 1 else f"in steps of 2^{step}"


def worst_layer(run: ScalingRun) -> float:
    """The run's largest per-layer underflow at the last refresh (a layer that got no
    non-zero error counts as 1)."""
    return max(1.0 if math.isnan(u) else u for u in run.underflow)


def accuracies(runs: Sequence[ScalingRun]) -> list[float]:
    return [r.result.test_accuracy for r in runs]


def best_global(groups: dict[str, list[ScalingRun]]) -> str:
    """The global scheme (fixed or dynamic) with the highest mean accuracy."""
    names = [n for n in groups if n not in ("fp32", "adaptive")]
    return max(names, key=lambda n: statistics.fmean(accuracies(groups[n])))


def paper_column(ssd: bool) -> dict[str, str]:
    """The paper column: the direction of the claims beside adaptive, and with ``ssd`` the
    authors' SSD512/VOC mAP beside the rows their repository reports."""
    direction = f"{PAPER['accuracy']}; {PAPER['underflow']}"
    if not ssd:
        return {"adaptive": direction}
    column = {name: f"SSD512/VOC mAP: {value}" for name, value in SSD_VOC_MAP.items()}
    column["adaptive"] += f"; {direction}"
    return column


def table(runs: Sequence[ScalingRun], steps: int, paper: Mapping[str, str] | None = None) -> str:
    """One row per scheme: accuracy, worst layer's underflow, layers over n_uf, skips, time
    and ``paper``'s text for the scheme (default :func:`paper_column` without SSD)."""
    paper = paper_column(ssd=False) if paper is None else paper
    rows = [
        "| scheme | test acc % | worst layer's underflow | layers > n_uf (of the seeds' worst) |"
        " steps skipped | s per run (median) | paper |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, group in by_variant(runs).items():
        acc = mean_std(accuracies(group), 2)
        seconds = f"{statistics.median(r.seconds for r in group):.1f}"
        if name == "fp32":
            rows.append(f"| fp32 | {acc} | - | - | - | {seconds} | {paper.get(name, '')} |")
            continue
        worst = mean_std([100 * worst_layer(r) for r in group], 2) + "%"
        layers = worst_underflow(group)
        over = f"{sum(u > N_UF for u in layers)} of {len(layers)}"
        skipped = mean_std([r.result.skipped_steps for r in group], 1) + f" of {steps}"
        rows.append(f"| {name} | {acc} | {worst} | {over} | {skipped} | {seconds} | {paper.get(name, '')} |")
    return "\n".join(rows)


def per_layer(runs: Sequence[ScalingRun], names: Sequence[str]) -> str:
    """Each layer's underflow at the last refresh, mean over the seeds (input side first)."""
    groups = by_variant(runs)
    rows = ["| scheme | per-layer underflow %, input side first |", "|---|---|"]
    for name in dict.fromkeys(names):
        layers = zip(*(r.underflow for r in groups[name]), strict=True)
        means = [statistics.fmean(1.0 if math.isnan(u) else u for u in layer) for layer in layers]
        rows.append(f"| {name} | {' '.join(f'{100 * u:.2f}' for u in means)} |")
    scales = [f"2^{math.log2(s):g}" for s in groups["adaptive"][0].scales]
    return "\n".join(rows) + f"\n\nAdaptive cumulative scales at the end (seed 0): {', '.join(scales)}\n"


def verdicts(runs: Sequence[ScalingRun]) -> tuple[str, dict[str, bool]]:
    """The two claims, judged over the seeds at k = 2 standard errors."""
    groups = by_variant(runs)
    adaptive = groups["adaptive"]
    best = best_global(groups)
    worst = [worst_layer(r) for r in adaptive]
    in_range = all(u <= N_UF for u in worst)
    global_worst = [worst_layer(r) for r in groups[best]]
    a, b = accuracies(adaptive), accuracies(groups[best])
    behind = worse_by(a, b, k=2.0)
    matches = not behind
    lines = [
        f"- *Adaptive keeps every layer's underflow under n_uf = {N_UF:g}*:"
        f" {'supported' if in_range else 'not supported'}; the worst layer's underflow per seed"
        f" was {', '.join(f'{100 * u:.2f}%' for u in worst)}"
        f" ({sum(u <= 0.01 for u in worst)} of {len(worst)} seeds under the paper's 1%); the best"
        f" global scheme's: {', '.join(f'{100 * u:.2f}%' for u in global_worst)}.",
        f"- *Adaptive matches or beats the best global scheme* ({best}, {mean_std(b, 2)}%, chosen"
        f" after the fact, which favours it): {'supported' if matches else 'not supported'};"
        f" adaptive {mean_std(a, 2)}%"
        + (
            " (within 2 standard errors)"
            if within_spread(a, b, k=2.0)
            else (" (ahead)" if matches else " (behind by more than 2 standard errors)")
        )
        + ".",
    ]
    return "\n".join(lines), {"in_range": in_range, "matches": matches}


def curves(runs: Sequence[ScalingRun], names: Sequence[str], per_epoch: int) -> dict[str, list[list[float]]]:
    """Training loss per epoch (mean over the epoch's steps) of each named scheme's seeds."""
    groups = by_variant(runs)
    out = {}
    for name in names:
        out[name] = [
            [
                statistics.fmean(r.result.losses[i : i + per_epoch])
                for i in range(0, len(r.result.losses), per_epoch)
            ]
            for r in groups[name]
        ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="two seeds, a coarse sweep, one epoch; prints, writes nothing"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="runs at a time, each in a one-thread process (default 2)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    quick, workers = args.quick, max(args.workers, 1)
    seeds = (0, 1) if quick else (0, 1, 2, 3, 4)
    step = 12 if quick else 1
    data = load_digits()
    started, cpu = time.perf_counter(), cpu_seconds()
    resnet = {**RESNET_TRAINING, **({"epochs": 1} if quick else {})}
    per_epoch = len(data.train_y) // resnet["batch_size"]
    steps = per_epoch * resnet["epochs"]
    mlp = {"epochs": 2 if quick else 8, "batch_size": 128, "lr": 1e-3, "interval": 5}
    decaying = functools.partial(DeepTanhMLP, gain=2.0, width=64, error_decay=DECAYING_ERRORS["error_decay"])
    experiments = {
        **{
            fmt: loss_scaling_jobs(
                schemes(step), UnnormalizedResNet, errors, seeds=seeds, fp32=fmt == "fp16", **resnet
            )
            for fmt, errors in FORMATS.items()
        },
        "ablation": loss_scaling_jobs(
            schemes(step),
            decaying,
            FORMATS["e4m3"],
            seeds=seeds,
            options=DECAYING_ERRORS["options"],
            **mlp,
        ),
    }
    # one pool for every experiment's runs; each experiment's are taken as they finish, in order
    results = run_jobs([job for jobs in experiments.values() for job in jobs], data, workers)
    done = {}
    for name, jobs in experiments.items():
        done[name] = list(itertools.islice(results, len(jobs)))
        print(f"{name}: {len(jobs)} runs done at {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    results.close()  # the pool's processes end here, so their CPU time is counted below
    body = [
        "Claim tested: adaptive per-layer scaling keeps every layer's underflow under n_uf and"
        " matches or beats the best global loss scale. Model: a deep residual CNN without"
        " normalisation (`UnnormalizedResNet`: stem, 6 residual blocks of two 3x3 convolutions,"
        " width 16, a strided convolution and a linear head: 15 quantized layers) on"
        " scikit-learn digits (1437 training, 360 test images; one test image is 0.28 points),"
        f" Adam lr {resnet['lr']:g}, batch {resnet['batch_size']}, {resnet['epochs']} epochs"
        f" ({steps} steps), seeds {', '.join(map(str, seeds))} (initialisation and batch order)."
        " Weights and activations in the recipe's format (FP16, or E5M2), errors in the"
        " format named; weight gradients E5M2 with stochastic rounding in both FP8 rows."
        f" Fixed scales 2^0 … 2^24, {sweep(step)} (2^0 is no loss scaling; a scale at which every"
        " step overflows is listed too, its steps all skipped);"
        f" dynamic = GradScaler's rule from 2^16, growth every {GROWTH_INTERVAL} clean steps;"
        f" adaptive = the quantile rule, n_uf = {N_UF:g}, refreshed every"
        f" {resnet['interval']} steps. Every run records each layer's error histogram at the"
        " same refreshes, so underflow is measured alike for every scheme: the fraction of a"
        " layer's non-zero errors below the format's smallest subnormal at the last refresh."
        " Steps skipped: overflows, and adaptive's calibration steps. Seconds per run: the"
        f" median over the seeds, with {workers} run(s) at a time, each in its own one-thread"
        " process (a process's first run of a graph setting includes its compilation; later"
        " runs of that setting reuse it), on a machine shared with other jobs. The paper"
        " column gives the paper's direction (its models, ImageNet and VOC detectors, are not"
        " comparable in size); in the FP16 table it also gives, for direction only, the"
        " validation mAP of SSD512 on PASCAL VOC (FP16 mixed precision, batch 8) that the"
        " authors' repository reports (XBWGC/ada-loss, `examples/adaptive_loss_scaling/ssd`)"
        " beside the rows it has a number for: FP32, no loss scale (2^0), fixed 8, 128 and 256"
        " (2^3, 2^7, 2^8) and adaptive.",
    ]
    verdict_lines = []
    for fmt in FORMATS:
        runs = done[fmt]
        groups = by_variant(runs)
        text, _ = verdicts(runs)
        best = best_global(groups)
        body.append(
            f"## {fmt.upper()} errors\n\n{table(runs, steps, paper_column(fmt == 'fp16'))}\n\n{text}\n"
        )
        body.append(per_layer(runs, ["fixed 2^0", best, "adaptive"]))
        verdict_lines.append(f"**{fmt.upper()}**\n\n{text}\n")
        if not quick:  # a quick run leaves the results page and its curves alone
            png = plot_curves(
                curves(runs, list(dict.fromkeys(["fixed 2^0", best, "dynamic", "adaptive"])), per_epoch),
                PAPERS / f"zhao_{fmt}.png",
                f"UnnormalizedResNet on digits, {fmt.upper()} errors",
                "epoch",
                "training loss",
                log_y=True,
            )
            body.append(f"![training loss, {fmt}]({png.name})\n")
        print("\n\n".join(body[-3:]), flush=True)
    runs = done["ablation"]
    text, _ = verdicts(runs)
    mlp_steps = len(data.train_y) // mlp["batch_size"] * mlp["epochs"]
    body.append(
        "## Ablation: an artificial backward decay (E4M3 errors)\n\n"
        "A construct, not a natural spread: a deep tanh MLP (12 linear layers, width 64) whose"
        " error is multiplied by 2^-1.25 after each hidden layer in the backward only"
        " (`DeepTanhMLP(error_decay=2^-1.25)`), so the lowest layers' errors sit 2^13.75 below"
        f" the top ones'; Adam lr {mlp['lr']:g}, batch {mlp['batch_size']}, {mlp['epochs']} epochs,"
        f" refresh every {mlp['interval']} steps, adaptive's cumulative cap raised to 2^30;"
        f" fixed scales 2^0 … 2^24 {sweep(step)}.\n\n"
        f"{table(runs, mlp_steps)}\n\n{text}\n"
    )
    body.append(per_layer(runs, ["fixed 2^0", best_global(by_variant(runs)), "adaptive"]))
    verdict_lines.append(f"**Ablation (artificial decay, E4M3)**\n\n{text}\n")
    wall = time.perf_counter() - started
    cpu = cpu_seconds() - cpu
    n_runs = sum(len(jobs) for jobs in experiments.values())
    summary = (
        "## Verdicts\n\n"
        + "\n".join(verdict_lines)
        + f"\nWall time of the whole script: {wall / 60:.1f} min for {n_runs} runs, {workers} at a"
        f" time in one-thread processes, on a machine with {os.cpu_count()} cores shared with other"
        f" jobs; the script's processes used {cpu / 60:.1f} CPU-minutes"
        f" ({100 * cpu / (wall * workers):.0f}% of {workers} cores over the wall time).\n"
    )
    body.insert(1, summary)
    if quick:
        print(summary)
        return
    path = write_paper("zhao", "Adaptive loss scaling (Zhao et al. 2019)", "\n\n".join(body))
    print(f"wrote {path} in {wall / 60:.1f} min")


if __name__ == "__main__":
    main()
