"""Kosson et al. 2020, "Pipelined Backpropagation at Scale", at small scale on the digits set.

The paper's claim: fine-grained pipelined backpropagation (PB) at batch size 1, with
Spike Compensation (SC) and Linear Weight Prediction (LWP), matches SGD at the
original batch size with the original hyper-parameters, scaled to batch 1 by
``lr' = lr/B``, ``m' = m**(1/B)``. Each recipe (lr, momentum, batch size B) trains
eight rows: SGD at batch B (the baseline, unscaled), SGD at batch 1 (scaled), and at
batch 1 with one pipeline stage per layer: PB, PB+SC, PB+LWP^v, PB+LWP^w, PB+SC+LWP^v
and PB with weight stashing. Every row runs on a deep GroupNorm ResNet
(:class:`examples.models.DigitsDeepResNet`, S = 11, delays up to 20) and, for contrast,
on the shallow DigitsCNN (S = 4, delays up to 6). Every run: the same epochs, the
learning rate decaying linearly to 0, one thread, seeded, so its result depends on
the run alone; ``--workers`` runs (default 2) go at a time, each in its own process,
which changes the wall time only (:func:`examples.experiments.map_runs`).

Writes ``benchmarks/results/papers/kosson.md`` and ``kosson_<network>_b<B>.png``
(training loss). ``--quick``: the batch-32 recipe, 2 seeds, 1 epoch; prints the page
and writes the curves to a temporary folder only.

    python -m benchmarks.papers.kosson [--quick] [--workers N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from torch import nn

from benchmarks.papers.common import (
    PAPERS,
    cpu_seconds,
    mean_std,
    plot_curves,
    standard_error,
    within_spread,
    worse_by,
    write_paper,
)
from examples.data import Split, load_digits
from examples.experiments import map_runs
from examples.models import DigitsCNN, DigitsDeepResNet
from examples.pipeline_digits import DigitsRun, run_digits
from lpcompile.runtime.pipeline import scale_hyperparameters

# recipe: (lr, momentum, batch size B) of minibatch SGD, scaled to batch 1 for the other rows
RECIPES: dict[str, tuple[float, float, int]] = {"b32": (0.016, 0.9, 32), "b10": (0.01, 0.9, 10)}

# row -> (run_digits variant, at batch B?); "SGD, batch B" is the paper's baseline
ROWS: dict[str, tuple[str, bool]] = {
    "SGD, batch B": ("SGD", True),
    "SGD, batch 1": ("SGD", False),
    "PB": ("PB", False),
    "PB+SC": ("PB+SC", False),
    "PB+LWP^v": ("PB+LWPv", False),
    "PB+LWP^w": ("PB+LWPw", False),
    "PB+SC+LWP^v": ("PB+SC+LWPv", False),
    "PB+stash": ("PB+stash", False),
}

# the paper's CIFAR-10 ResNet-20 results (test accuracy, %) or the direction it reports
PAPER: dict[str, str] = {
    "SGD, batch B": "91.63",
    "SGD, batch 1": "≈ SGD (the scaling rule)",
    "PB": "below SGD",
    "PB+SC": "between PB and SGD",
    "PB+LWP^v": "between PB and SGD",
    "PB+LWP^w": "between PB and SGD",
    "PB+SC+LWP^v": "91.69 (matches SGD)",
    "PB+stash": "below PB+SC+LWP",
}


@dataclass(frozen=True)
class Network:
    title: str
    model: Callable[[], nn.Module]


NETWORKS: dict[str, Network] = {
    "deep": Network("DigitsDeepResNet (GroupNorm, 10 convolutions and a linear layer)", DigitsDeepResNet),
    "shallow": Network("DigitsCNN (GroupNorm, 2 convolutions and 2 linear layers)", DigitsCNN),
}

Results = dict[str, list[DigitsRun]]  # row -> one run per seed


@dataclass(frozen=True)
class Job:
    """One run: a row of :data:`ROWS` on a network and recipe, at one seed."""

    network: str
    recipe: str
    row: str
    seed: int
    epochs: int


@cache
def _data() -> Split:
    return load_digits()  # once per process


def run_job(job: Job) -> DigitsRun:
    """Train ``job`` on one thread; the result depends on the job alone, not on the process."""
    lr, momentum, batch = RECIPES[job.recipe]
    variant, at_batch = ROWS[job.row]
    if not at_batch:
        lr, momentum = scale_hyperparameters(lr, momentum, batch, 1)
    return run_digits(
        variant,
        lr=lr,
        momentum=momentum,
        epochs=job.epochs,
        seed=job.seed,
        data=_data(),
        threads=1,
        model=NETWORKS[job.network].model,
        batch_size=batch if at_batch else 1,
    )


def run_all(
    cells: Sequence[tuple[str, str]], seeds: Sequence[int], epochs: int, workers: int
) -> dict[tuple[str, str], Results]:
    """Every row on every seed of every (network, recipe) cell, printing each run."""
    jobs = [Job(name, recipe, row, seed, epochs) for name, recipe in cells for row in ROWS for seed in seeds]
    results: dict[tuple[str, str], Results] = {}
    for job, run in zip(jobs, map_runs(run_job, jobs, workers), strict=True):
        results.setdefault((job.network, job.recipe), {}).setdefault(job.row, []).append(run)
        print(
            f"{job.network} {job.recipe} {job.row:13s} seed {job.seed}: {run.test_accuracy:5.1f}%  "
            f"loss {run.final_loss:.3f}  {run.seconds:.0f}s",
            flush=True,
        )
    return results


def accuracies(runs: list[DigitsRun]) -> list[float]:
    return [r.test_accuracy for r in runs]


def table(results: Results) -> list[str]:
    """The results table of one network and recipe, the paper's result beside each row."""
    lines = [
        "| row | test accuracy (%) | diverged | final-epoch training loss | per seed (%) | s/run "
        "| paper (CIFAR-10 ResNet-20) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row, runs in results.items():
        acc = accuracies(runs)
        diverged = sum(a < 20.0 for a in acc)
        seconds = statistics.fmean(r.seconds for r in runs)
        lines.append(
            f"| {row} | {mean_std(acc)} | {diverged}/{len(acc)} "
            f"| {mean_std([r.final_loss for r in runs], 3)} | {', '.join(f'{a:.1f}' for a in acc)} "
            f"| {seconds:.0f} | {PAPER[row]} |"
        )
    return lines


def compare(results: Results, a: str, b: str) -> str:
    """``mean(a) - mean(b)`` and two standard errors of that difference."""
    x, y = accuracies(results[a]), accuracies(results[b])
    diff = statistics.fmean(x) - statistics.fmean(y)
    two_se = 2 * standard_error(x, y)
    return f"{a} {mean_std(x)} vs {b} {mean_std(y)}: difference {diff:+.1f}, 2 SE = {two_se:.1f}"


def verdicts(results: Results, resolution: float = 3.0) -> list[str]:
    """The paper's claims checked on one network and recipe, at 2 standard errors.

    A "matches" claim whose two standard errors exceed ``resolution`` points is
    inconclusive: the seeds spread too widely to tell a match from a gap.
    """
    lines = ["| claim | verdict | numbers (test accuracy, %) |", "| --- | --- | --- |"]

    def check(claim: str, a: str, b: str, match: bool) -> None:
        if a not in results or b not in results:
            return
        x, y = accuracies(results[a]), accuracies(results[b])
        if match:
            holds = within_spread(x, y)
            verdict = "supported" if holds else "not supported"
            if holds and 2 * standard_error(x, y) > resolution:
                verdict = f"inconclusive (2 SE > {resolution:g} points)"
        else:
            verdict = "supported" if worse_by(x, y) else "not supported"
        lines.append(f"| {claim} | {verdict} | {compare(results, a, b)} |")

    check("PB+SC+LWP^v at batch 1 matches SGD at batch B (the headline)", "PB+SC+LWP^v", "SGD, batch B", True)
    check(
        "SGD at batch 1 (scaled) matches SGD at batch B (the scaling rule)",
        "SGD, batch 1",
        "SGD, batch B",
        True,
    )
    check("PB+SC+LWP^v matches SGD at batch 1 (same hyper-parameters)", "PB+SC+LWP^v", "SGD, batch 1", True)
    check("plain PB is worse than SGD at batch 1", "PB", "SGD, batch 1", False)
    check("PB+SC+LWP^v improves on plain PB", "PB", "PB+SC+LWP^v", False)
    check("SC alone improves on plain PB", "PB", "PB+SC", False)
    check("LWP^v alone improves on plain PB", "PB", "PB+LWP^v", False)
    check("LWP^w alone improves on plain PB", "PB", "PB+LWP^w", False)
    check("PB+SC+LWP^v beats weight stashing", "PB+stash", "PB+SC+LWP^v", False)
    return lines


def curves(results: Results, chunk: int = 100) -> dict[str, list[list[float]]]:
    """Training loss per run, averaged over consecutive chunks of ``chunk`` samples."""
    return {
        row: [
            [statistics.fmean(r.losses[i : i + chunk]) for i in range(0, len(r.losses) - chunk + 1, chunk)]
            for r in runs
        ]
        for row, runs in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="one recipe, 2 seeds, 1 epoch; write no results page"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="runs at a time, each in a one-thread process (default 2)"
    )
    args = parser.parse_args()
    seeds, epochs = ((0, 1), 1) if args.quick else ((0, 1, 2, 3, 4), 3)
    recipes = list(RECIPES)[:1] if args.quick else list(RECIPES)
    folder = Path(tempfile.mkdtemp(prefix="kosson-")) if args.quick else PAPERS
    cells = [(name, recipe) for name in NETWORKS for recipe in recipes]
    start, cpu = time.perf_counter(), cpu_seconds()
    everything = run_all(cells, seeds, epochs, args.workers)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    sections: list[str] = []
    for name, recipe in cells:
        results = everything[name, recipe]
        lr, momentum, batch = RECIPES[recipe]
        lr1, momentum1 = scale_hyperparameters(lr, momentum, batch, 1)
        delays = next(r.delays for runs in results.values() for r in runs if len(r.delays) > 1)
        png = plot_curves(
            curves(results),
            folder / f"kosson_{name}_b{batch}.png",
            f"{name} network, S = {len(delays)}, batch-{batch} recipe",
            "samples (hundreds)",
            "training loss (mean over 100 samples)",
            log_y=True,
        )
        sections += [
            f"## {NETWORKS[name].title}, batch-{batch} recipe",
            "",
            f"S = {len(delays)} stages, delays {delays}. SGD at batch {batch}: lr {lr}, "
            f"momentum {momentum}; every batch-1 row: lr {lr1:.4g}, momentum {momentum1:.4f}. "
            f"Epochs: {epochs}; seeds {list(seeds)}; mean ± std over the seeds. A run that diverged "
            f"scores about 10% (chance). Training loss: `{png.name}`.",
            "",
            *table(results),
            "",
            "Claims, at 2 standard errors (SE) of the difference of the means (Welch):",
            "",
            *verdicts(results),
            "",
        ]
    workers = max(args.workers, 1)
    share = cpu / (wall * min(workers, os.cpu_count() or 1))
    how = (
        "one run at a time"
        if workers == 1
        else f"{workers} runs at a time, each in its own one-thread process (a run's result does "
        "not depend on the process it ran in)"
    )
    intro = INTRO.format(minutes=wall / 60, how=how, cpu=cpu / 60, share=100 * share)
    body = "\n".join([intro, "", *sections])
    if args.quick:
        print(body)
        print(f"curves in {folder}")
    else:
        print(
            write_paper(
                "kosson", "Pipelined backpropagation (Kosson et al. 2020), small scale", body
            ).read_text()
        )


INTRO = """\
Digits (1,437 training and 360 test images of 8x8; one test image is 0.28 points). Every
run lasts the same number of epochs with the learning rate decaying linearly to 0 and uses
one thread. "SGD, batch B" is the paper's baseline: minibatch SGD with momentum at the
recipe's batch size and hyper-parameters. Every other row runs at batch size 1 with the
recipe scaled by the paper's rule (lr/B, momentum^(1/B)): "SGD, batch 1" is one pipeline
stage (no delay); the PB rows cut the model into one stage per layer (the paper's
fine-grained pipeline), stage s applying gradients 2(S-1-s) steps late, no flush. SC: Spike
Compensation; LWP^v / LWP^w: linear weight prediction from the velocity / from the last
weight change; stash: the backward reads the weights its forward read (PipeDream). The
paper's column is its CIFAR-10 ResNet-20 result where it gives one, else the direction it
reports: for direction only, the setups differ (see docs/papers.md). A "matches" claim is
inconclusive where two standard errors of the difference exceed 3 points.

Run time: {minutes:.0f} minutes wall clock, {how}; {cpu:.0f} CPU-minutes in all: the runs
got {share:.0f}% of the cores they could use. What they did not get went to other jobs on the
machine (or to a worker idle at the end), which lengthened the wall time and the seconds per
run in the tables."""


if __name__ == "__main__":
    main()
