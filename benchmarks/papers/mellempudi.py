"""Mellempudi et al. 2019, "Mixed Precision Training With 8-bit Floating Point", at small scale.

Variants: FP32; FP8-E5M2 with round-to-nearest-even everywhere; FP8-E5M2 with stochastic
rounding of errors and weight gradients; the paper's full recipe (that, FP16 master weights
rounded stochastically and enhanced loss scaling with a floor schedule); the same with FP16
master weights rounded to nearest (the paper's stagnation case); the full recipe without loss
scaling; the full recipe with its floors one binade higher, where they bind; and
``fp8-hybrid`` (E4M3 forward, E5M2 backward). Every FP8 variant but the two loss-scaling
ablations runs under the same enhanced loss scaling, so each differs from its neighbour in one
thing. Two tasks: the digits CNN (test accuracy) and a byte-level TinyGPT on the standard
library's sources, attention in FP8 (validation bits per character). Run::

    python -m benchmarks.papers.mellempudi [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.papers.common import (
    PAPERS,
    mean_std,
    plot_curves,
    standard_error,
    within_spread,
    worse_by,
    write_paper,
)
from examples.data import TextSplit, load_digits, load_stdlib_source
from examples.models import TinyGPT
from examples.train import Updater, train_digits


@dataclass(frozen=True)
class Variant:
    """One column of the paper's comparison."""

    recipe: str | None  # None: the model uncompiled, in FP32
    master_weights: str | None = None  # FP16 master weights' rounding, None: FP32 weights
    loss_scaling: bool = True  # enhanced loss scaling (FP8 variants)
    floor_raise: int = 0  # binades added to the task's floor schedule
    paper: str = ""  # the paper's result, for direction


PAPER_FULL = "75.3 (FP32 75.7): ResNet-50 ImageNet top-1, within ~0.5"
VARIANTS: dict[str, Variant] = {
    "FP32": Variant(None, paper="75.7 ResNet-50 ImageNet top-1"),
    "FP8 RNE": Variant("fp8-e5m2", paper="worse than SR (RNE on gradients loses accuracy)"),
    "FP8 SR": Variant("fp8-e5m2-sr", paper="close to FP32"),
    "full recipe": Variant("fp8-e5m2-sr", "stochastic", paper=PAPER_FULL),
    "FP16 master RNE": Variant("fp8-e5m2-sr", "nearest", paper="stagnates: worse than SR master weights"),
    "full, no loss scaling": Variant(
        "fp8-e5m2-sr", "stochastic", loss_scaling=False, paper="worse (errors underflow E5M2)"
    ),
    "full, binding floor": Variant(
        "fp8-e5m2-sr", "stochastic", floor_raise=1, paper="the floor keeps the scale from collapsing"
    ),
    "fp8-hybrid": Variant("fp8-hybrid", paper="– (not in the paper)"),
}
COMPARED = (
    "FP8 RNE",
    "FP8 SR",
    "FP16 master RNE",
    "full, no loss scaling",
    "full, binding floor",
    "fp8-hybrid",
)


@dataclass(frozen=True)
class Setting:
    """Sizes of one task; ``--quick`` shrinks them."""

    seeds: int
    epochs: int = 0  # digits
    steps: int = 0  # language model
    eval_every: int = 0


def raised(floors: Sequence[float], variant: Variant) -> tuple[float, ...]:
    """A task's floor schedule, raised ``variant.floor_raise`` binades."""
    return tuple(f * 2.0**variant.floor_raise for f in floors)


def scaler_options(steps: int, floors: tuple[float, float, float], variant: Variant) -> dict[str, Any] | None:
    """Enhanced loss scaling for an FP8 variant that uses it (None otherwise): dynamic from 2^16,
    halved on overflow and doubled after 25 clean steps (probing upward), never below
    ``floors[0]``, raised to ``floors[1]`` after a third of the steps and to ``floors[2]`` after
    two thirds, each floor ``variant.floor_raise`` binades higher. Where a floor sits at a scale
    the probing overflows, it binds: an overflow there keeps the scale instead of halving it."""
    if variant.recipe is None or not variant.loss_scaling:
        return None
    low, middle, high = raised(floors, variant)
    schedule = {steps // 3: middle, 2 * steps // 3: high}
    return {"growth_interval": 25, "min_scale": low, "min_scale_schedule": schedule}


def binades(floors: Sequence[float]) -> str:
    return ", ".join(f"2^{int(math.log2(f))}" for f in floors)


def options(recipe: str, seed: int, attention: str = "operands") -> dict[str, Any]:
    return {"recipe": recipe, "executor": "eager", "seed": seed, "attention": attention}


# -- digits -----------------------------------------------------------------------------------

DIGITS_LR = 0.01  # small updates: below half an FP16 ulp of many weights
DIGITS_FLOORS = (2.0**15, 2.0**16, 2.0**17)
DIGITS_EPOCHS = 10


def run_digits(name: str, variant: Variant, seed: int, epochs: int, data: Any) -> dict[str, Any]:
    torch._dynamo.reset()
    steps = epochs * (len(data.train_y) // 64)
    result = train_digits(
        name,
        options(variant.recipe, seed) if variant.recipe else None,
        compiled=variant.recipe is not None,
        epochs=epochs,
        lr=DIGITS_LR,
        seed=seed,
        loss_scale="enhanced" if variant.recipe and variant.loss_scaling else "none",
        scaler_options=scaler_options(steps, DIGITS_FLOORS, variant),
        master_weights=variant.master_weights,
        data=data,
    )
    per_epoch = len(result.losses) // epochs
    curve = [
        statistics.fmean(result.losses[i : i + per_epoch]) for i in range(0, len(result.losses), per_epoch)
    ]
    return {
        "metric": result.test_accuracy,
        "curve": curve,
        "skipped": result.skipped_steps,
        "floor": result.floor_steps,
    }


# -- byte-level language model ----------------------------------------------------------------

CONTEXT, WIDTH, DEPTH, HEADS, BATCH = 64, 64, 2, 4, 32
LM_LR = 3e-4  # Adam's updates (≤ ~lr) are below half an FP16 ulp of weights ≥ 1, often of ≥ 0.5
LM_FLOORS = (2.0**16, 2.0**18, 2.0**19)
LM_STEPS, LM_EVAL_EVERY = 300, 25


def windows(text: torch.Tensor, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(len(text) - CONTEXT - 1, (count,), generator=generator)
    rows = torch.stack([text[s : s + CONTEXT + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def bits_per_char(run: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    with torch.no_grad():
        nats = [F.cross_entropy(run(x).flatten(0, 1), y.flatten()).item() for x, y in batches]
    return statistics.fmean(nats) / math.log(2)


def run_lm(
    name: str, variant: Variant, seed: int, steps: int, eval_every: int, text: TextSplit
) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = TinyGPT(width=WIDTH, depth=DEPTH, heads=HEADS, context=CONTEXT)
    run = (
        torch.compile(model, backend="lowprec", options=options(variant.recipe, seed))
        if variant.recipe
        else model
    )
    scaled = variant.recipe is not None and variant.loss_scaling
    updater = Updater(
        model,
        optimizer="adam",
        lr=LM_LR,
        loss_scale="enhanced" if scaled else "none",
        scaler_options=scaler_options(steps, LM_FLOORS, variant),
        master_weights=variant.master_weights,
        seed=seed,
    )
    batches = torch.Generator().manual_seed(seed)
    validation = [windows(text.validation, BATCH, torch.Generator().manual_seed(1000 + i)) for i in range(4)]
    curve = []
    for step in range(steps):
        x, y = windows(text.train, BATCH, batches)
        updater.step(F.cross_entropy(run(x).flatten(0, 1), y.flatten()))
        if (step + 1) % eval_every == 0:
            curve.append(bits_per_char(run, validation))
    return {
        "metric": curve[-1],
        "curve": curve,
        "skipped": updater.scaler.skipped_steps,
        "floor": updater.floor_steps,
    }


# -- the page ---------------------------------------------------------------------------------


def verdicts(results: dict[str, list[float]], higher_is_better: bool, unit: str, floor: float) -> list[str]:
    """The claims: the full recipe within noise of FP32, and which weaker variants are worse."""
    fp32, full = results["FP32"], results["full recipe"]
    gap = statistics.fmean(full) - statistics.fmean(fp32)
    se = standard_error(full, fp32)
    same = within_spread(full, fp32, k=2.0, floor=floor)
    lines = [
        f"- Full recipe within noise of FP32 (|Δ| ≤ 2 standard errors): "
        f"**{'supported' if same else 'not supported'}** (Δ = {gap:+.3f} {unit}, standard error {se:.3f})."
    ]
    for name in COMPARED:
        worse = worse_by(results[name], full, k=2.0, higher_is_better=higher_is_better)
        gap = statistics.fmean(results[name]) - statistics.fmean(full)
        se = standard_error(results[name], full)
        lines.append(
            f"- {name} worse than the full recipe by > 2 standard errors: "
            f"**{'yes' if worse else 'no'}** (Δ = {gap:+.3f} {unit}, standard error {se:.3f})."
        )
    return lines


def table(runs: dict[str, list[dict[str, Any]]], metric: str, digits: int) -> str:
    rows = [
        f"| variant | {metric} | overflow steps skipped | floor held the scale | paper |",
        "|---|---|---|---|---|",
    ]
    for name, variant in VARIANTS.items():
        cell = mean_std([r["metric"] for r in runs[name]], digits)
        skipped = statistics.fmean(r["skipped"] for r in runs[name])
        floor = statistics.fmean(r["floor"] for r in runs[name])
        rows.append(f"| {name} | {cell} | {skipped:.1f} | {floor:.1f} | {variant.paper} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds and steps (a minute)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    digits_set = Setting(seeds=2, epochs=1) if args.quick else Setting(seeds=5, epochs=DIGITS_EPOCHS)
    lm_set = (
        Setting(seeds=2, steps=20, eval_every=10)
        if args.quick
        else Setting(seeds=3, steps=LM_STEPS, eval_every=LM_EVAL_EVERY)
    )
    start = time.perf_counter()
    data, text = load_digits(), load_stdlib_source()

    tasks = {
        "digits": lambda name, v, s: run_digits(name, v, s, digits_set.epochs, data),
        "lm": lambda name, v, s: run_lm(name, v, s, lm_set.steps, lm_set.eval_every, text),
    }
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for task, fn in tasks.items():
        seeds = digits_set.seeds if task == "digits" else lm_set.seeds
        runs[task] = {}
        for name, variant in VARIANTS.items():
            t = time.perf_counter()
            runs[task][name] = [fn(name, variant, seed) for seed in range(seeds)]
            values = [r["metric"] for r in runs[task][name]]
            print(
                f"{task:>6} {name:<22} {mean_std(values, 3)}  ({time.perf_counter() - t:.0f} s)", flush=True
            )
    wall = time.perf_counter() - start

    suffix = "_quick" if args.quick else ""
    PAPERS.mkdir(parents=True, exist_ok=True)
    (PAPERS / f"mellempudi{suffix}.json").write_text(json.dumps(runs))
    plots = {
        "digits": ("training loss (epoch mean)", "epoch", True),
        "lm": (f"validation bits per character (every {lm_set.eval_every} steps)", "evaluation", False),
    }
    for task, (ylabel, xlabel, log_y) in plots.items():
        curves = {name: [r["curve"] for r in runs[task][name]] for name in VARIANTS}
        plot_curves(
            curves,
            PAPERS / f"mellempudi_{task}{suffix}.png",
            f"Mellempudi et al. 2019: {task}",
            xlabel,
            ylabel,
            log_y,
        )

    digits_acc = {name: [r["metric"] for r in rs] for name, rs in runs["digits"].items()}
    lm_bpc = {name: [r["metric"] for r in rs] for name, rs in runs["lm"].items()}
    binding = VARIANTS["full, binding floor"]
    quick = "**Quick run: too few seeds and steps for the verdicts to mean anything.**" if args.quick else ""
    body = f"""{quick}

Wall time: {wall / 60:.1f} min.

Variants (all FP8 variants compute every matmul/conv, attention's Q, K, V included, in
E5M2 or E4M3 with FP32 accumulation, `executor="eager"`): FP8 RNE = `fp8-e5m2`; FP8 SR =
`fp8-e5m2-sr`; full recipe = `fp8-e5m2-sr` + FP16 master weights rounded stochastically
(`MasterWeightOptimizer`); FP16 master RNE = the same with master weights rounded to nearest;
fp8-hybrid = E4M3 forward, E5M2 backward. Every FP8 variant but "no loss scaling" uses
enhanced loss scaling: dynamic from 2^16, halved on overflow, doubled after 25 clean steps,
with a floor raised twice (after a third and two thirds of the steps): digits
{binades(DIGITS_FLOORS)}, at the scales where runs without a floor overflowed; language model
{binades(LM_FLOORS)}, one binade below them. "Full, binding floor" raises each floor one binade
(digits {binades(raised(DIGITS_FLOORS, binding))}, language model
{binades(raised(LM_FLOORS, binding))}), where the probing overflows. "Floor held the scale"
counts the overflows after which the floor, not the halving, set the scale (mean per run).
The "paper" column is the direction of Mellempudi et al.'s result (ImageNet, GNMT), not a
number to match.

## Digits CNN (scikit-learn digits, test accuracy %, {digits_set.seeds} seeds)

SGD, momentum 0.9, lr {DIGITS_LR}, batch 64, {digits_set.epochs} epochs; mean ± std over seeds.

{table(runs["digits"], "test accuracy %", 2)}

{chr(10).join(verdicts(digits_acc, True, "points", floor=100 / len(data.test_y) / 2))}

![digits](mellempudi_digits{suffix}.png)

## Byte-level TinyGPT (standard-library sources, validation bits per character, {lm_set.seeds} seeds)

{DEPTH} blocks, width {WIDTH}, {HEADS} heads, context {CONTEXT}; Adam lr {LM_LR}, batch {BATCH}
windows, {lm_set.steps} steps; bits per character on 4 fixed batches of validation windows
(files never trained on). {lm_set.seeds} seeds (a run is long); mean ± std over seeds.
Lower is better.

{table(runs["lm"], "validation bits/char", 3)}

{chr(10).join(verdicts(lm_bpc, False, "bits/char", floor=0.0))}

![lm](mellempudi_lm{suffix}.png)
"""
    path = write_paper(
        f"mellempudi{suffix}", "Mellempudi et al. 2019: FP8 training at small scale", body, argv
    )
    print(f"wrote {path} in {wall / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
