"""Training-step time: fp32 eager, fp32 Inductor, lowprec FP8 compiled, FP8 eager.

A step is forward, backward and an SGD update. "fp8 eager" runs the same
FP8 numerics (recipe fp8-e5m2-sr) without compilation: the lowprec graphs
executed op by op (``executor="eager"``), which is the eager reference.
"fp8-e5m2 compiled" (round to nearest everywhere, no random bits) shows how
much of the compiled FP8 step is stochastic rounding. The issue's two models
are the MLP and the digits CNN; the 32x32 CNN shows a convolutional step whose
time is not mostly per-call overhead.

The eager steps allocate a fresh tensor per op. With glibc's default malloc,
buffers above its mmap threshold come from fresh pages and are page-faulted in
on every step; the threshold rises as large blocks are freed, so the eager
times depend on what the process allocated before (the 32x32 CNN's FP8 eager
step: 55 ms after the MLP's cases, 103 ms run alone). ``--malloc keep``
re-runs the script with malloc keeping freed memory (``GLIBC_TUNABLES``), which
takes that history out, and writes ``train_step_malloc_keep.md``.

The SGD step (momentum 0.9) is the same for every variant: by default torch's
fused implementation (``fused=True``, one kernel for all parameters);
``--optimizer loop`` uses its default on CPU, a Python loop over the parameters
(0.07-0.17 ms more per step for the digits CNN, whose compiled step takes ~1.4 ms),
and writes ``train_step_sgd_loop.md``.

This machine's speed drifts between phases, and a slow phase costs the compiled
steps more than the eager reference, so one run's ratios depend on when it ran.
``--runs N`` repeats the whole measurement N times, each in a fresh process,
``--gap`` seconds apart, and writes every run's figures and how many met the
targets to the results file's name plus ``_runs`` (``train_step_runs.md`` with the
other options at their defaults).

``--device cuda`` times the same steps on a GPU (synchronized around each step),
adds "fp8-e5m2-sr triton" (``codegen="triton"``: the generated kernels) and writes
``train_step_cuda.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import MALLOC_NOTES, interleaved_times, use_malloc, write_results
from examples.models import MLP, DigitsCNN

FP8 = {"recipe": "fp8-e5m2-sr"}
VARIANTS = {
    "fp32 eager": None,
    "fp32 inductor": "inductor",
    "fp8-e5m2 compiled": {"recipe": "fp8-e5m2", "executor": "inductor"},
    "fp8-e5m2-sr compiled": {**FP8, "executor": "inductor"},
    "fp8-e5m2-sr eager": {**FP8, "executor": "eager"},
}


def cnn32(width: int = 32) -> nn.Sequential:
    """Three convolutions (the last two strided) with GroupNorm for 3x32x32 images (CIFAR-sized)."""
    layers: list[nn.Module] = []
    for i, (c_in, c_out) in enumerate([(3, width), (width, 2 * width), (2 * width, 4 * width)]):
        conv = nn.Conv2d(c_in, c_out, 3, stride=1 if i == 0 else 2, padding=1)
        layers += [conv, nn.GroupNorm(4, c_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(4 * width * 8 * 8, 10))


# The models timed, with their input batch and labels.
CASES = {
    "MLP 784-1024-1024-10, batch 128": (
        lambda: MLP(784, 1024, 1024, 10),
        torch.randn(128, 1, 28, 28),
        torch.randint(0, 10, (128,)),
    ),
    "digits CNN, batch 64": (DigitsCNN, torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,))),
    "CNN 3x32x32, batch 32": (cnn32, torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))),
}


def sgd_step(model: torch.nn.Module, run, x: torch.Tensor, y: torch.Tensor, fused: bool = False):
    """One training step: ``run(x)`` (the model, compiled or not), cross-entropy, SGD with
    momentum (torch's fused kernel with ``fused``, else its default: a loop on CPU)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=fused)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(run(x), y).backward()
        opt.step()

    return step


def step_fn(model_fn, x, y, backend, device: str = "cpu", fused: bool = False):
    torch.manual_seed(0)
    model = model_fn().to(device)
    x, y = x.to(device), y.to(device)
    if backend == "inductor":
        run = torch.compile(model)
    elif backend is not None:
        run = torch.compile(model, backend="lowprec", options=backend)
    else:
        run = model
    return sgd_step(model, run, x, y, fused)


def measure(variants: dict, rounds: int, device: str, fused: bool) -> dict[str, dict[str, float]]:
    """Median step time (s) of every variant, per case; the variants of a case in one process."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    medians = {}
    for case, (model_fn, x, y) in CASES.items():
        torch._dynamo.reset()
        steps = {name: step_fn(model_fn, x, y, opts, device, fused) for name, opts in variants.items()}
        timed = interleaved_times(steps, rounds, sync=sync)
        medians[case] = {name: statistics.median(ts) for name, ts in timed.items()}
        for variant, t in medians[case].items():
            print(f"{case:<34} {variant:<22} {t * 1e3:8.2f} ms", flush=True)
    return medians


def targets(times: dict[str, float]) -> tuple[float, float]:
    """The issue's two figures: compiled FP8 ÷ fp32 Inductor, and FP8 eager ÷ compiled FP8."""
    fp8 = times["fp8-e5m2-sr compiled"]
    return fp8 / times["fp32 inductor"], times["fp8-e5m2-sr eager"] / fp8


def tables(medians: dict[str, dict[str, float]], rounds: int) -> str:
    """The step times of one run, and the targets."""
    rows = ["| model | variant | step ms | × fp32 inductor | fp8 eager ÷ this |", "|---|---|---|---|---|"]
    checks = []
    for case, times in medians.items():
        for variant, t in times.items():
            rows.append(
                f"| {case} | {variant} | {t * 1e3:.2f} | {t / times['fp32 inductor']:.2f} "
                f"| {times['fp8-e5m2-sr eager'] / t:.1f} |"
            )
        versus_inductor, speedup = targets(times)
        checks.append(
            f"| {case} | {versus_inductor:.2f}× (target ≤ 1.5×) "
            f"| {speedup:.1f}× (target ≥ 5×) "
            f"| {times['fp8-e5m2-sr eager'] / times['fp32 inductor']:.1f}× |"
        )
    body = "\n".join(rows)
    body += (
        f"\n\nMedian step of each variant over {rounds} rounds; a round runs 10 steps of"
        " every variant in turn (after 3 warm-up steps, compile excluded).\n\n"
    )
    body += (
        "| model | compiled FP8 vs fp32 Inductor | compiled FP8 speed-up over FP8 eager "
        "| ceiling: FP8 eager ÷ fp32 Inductor |\n|---|---|---|---|\n"
    )
    body += "\n".join(checks)
    body += (
        "\n\nThe ceiling is the speed-up of a compiled FP8 step as fast as the fp32 Inductor step,"
        " i.e. with quantization free; the compiled FP8 step passes it only where it runs faster"
        " than fp32 Inductor."
    )
    return body


def spread(runs: list[dict[str, dict[str, float]]], gap: float) -> str:
    """Every run's targets, and per model how many runs met them."""
    rows = [
        "| run | model | fp32 eager ms | fp32 inductor ms | fp8 compiled ms | fp8 eager ms "
        "| compiled FP8 vs fp32 Inductor | speed-up over FP8 eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, medians in enumerate(runs, 1):
        for case, times in medians.items():
            ms = [
                times[v] * 1e3
                for v in ("fp32 eager", "fp32 inductor", "fp8-e5m2-sr compiled", "fp8-e5m2-sr eager")
            ]
            versus_inductor, speedup = targets(times)
            rows.append(
                f"| {i} | {case} | "
                + " | ".join(f"{t:.2f}" for t in ms)
                + f" | {versus_inductor:.2f}× | {speedup:.1f}× |"
            )
    summary = [
        "| model | speed-up: min / median / max | runs ≥ 5× | vs fp32 Inductor: max | runs ≤ 1.5× |",
        "|---|---|---|---|---|",
    ]
    for case in runs[0]:
        ratios, speedups = zip(*(targets(medians[case]) for medians in runs), strict=True)
        summary.append(
            f"| {case} | {min(speedups):.1f}× / {statistics.median(speedups):.1f}× / {max(speedups):.1f}× "
            f"| {sum(s >= 5 for s in speedups)} of {len(runs)} | {max(ratios):.2f}× "
            f"| {sum(r <= 1.5 for r in ratios)} of {len(runs)} |"
        )
    return (
        f"{len(runs)} runs, each a fresh process timing every model as a single run does,"
        f" {gap:g} s apart. The fp32 eager step shows the machine's phase.\n\n"
        + "\n".join(summary)
        + "\n\n"
        + "\n".join(rows)
    )


def repeat(args: argparse.Namespace) -> list[dict[str, dict[str, float]]]:
    """Run this script ``args.runs`` times, each in a fresh process, and collect its medians."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "medians.json"
        for i in range(args.runs):
            if i:
                time.sleep(args.gap)
            command = [sys.executable, "-m", "benchmarks.bench_train_step", "--json", str(out)]
            for flag in ("rounds", "malloc", "device", "optimizer"):
                command += [f"--{flag}", str(getattr(args, flag))]
            print(f"run {i + 1} of {args.runs}", flush=True)
            subprocess.run(command, check=True)
            runs.append(json.loads(out.read_text()))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--malloc", choices=["default", "keep"], default="default")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--optimizer", choices=["fused", "loop"], default="fused")
    parser.add_argument("--runs", type=int, default=1, help="repeat in fresh processes; write <name>_runs.md")
    parser.add_argument("--gap", type=float, default=30.0, help="seconds between --runs")
    parser.add_argument("--json", type=Path, help="write the medians here instead of a results file")
    args = parser.parse_args()
    if args.runs < 1 or args.rounds < 1 or args.gap < 0:
        parser.error("--runs and --rounds must be at least 1, --gap not negative")
    if args.json and args.runs > 1:
        parser.error("--json writes one run's medians: it takes no --runs")
    if args.runs == 1:
        use_malloc(args.malloc, "benchmarks.bench_train_step")
        variants = dict(VARIANTS)
        if args.device == "cuda":
            variants["fp8-e5m2-sr triton"] = {**FP8, "codegen": "triton"}
        medians = measure(variants, args.rounds, args.device, args.optimizer == "fused")
        if args.json:
            args.json.write_text(json.dumps(medians))
            return
        body = tables(medians, args.rounds)
    else:
        body = spread(repeat(args), args.gap)
    malloc = MALLOC_NOTES[args.malloc]
    if args.malloc == "default":
        malloc += " (eager times depend on allocation history; see the script's docstring)"
    if args.device == "cuda":
        malloc = f"Device: {torch.cuda.get_device_name()} (steps synchronized); host {malloc}"
    sgd = "torch's fused SGD" if args.optimizer == "fused" else "torch's default SGD (a loop over parameters)"
    body = f"{malloc}\n\nOptimizer: {sgd}, momentum 0.9, the same for every variant\n\n{body}"
    print(body)
    name = "train_step" if args.malloc == "default" else "train_step_malloc_keep"
    if args.optimizer == "loop":
        name += "_sgd_loop"
    if args.device == "cuda":
        name += "_cuda"
    flags = f"--malloc {args.malloc} --optimizer {args.optimizer}"
    if args.runs > 1:
        name += "_runs"
        flags += f" --runs {args.runs} --gap {args.gap:g}"
    write_results(name, f"Training-step time (bench_train_step.py {flags})", body)


if __name__ == "__main__":
    main()
