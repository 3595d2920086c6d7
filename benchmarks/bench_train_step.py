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

``--device cuda`` times the same steps on a GPU (synchronized around each step),
adds "fp8-e5m2-sr triton" (``codegen="triton"``: the generated kernels) and writes
``train_step_cuda.md``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import MALLOC_NOTES, interleaved_times, use_malloc, write_results
from lpcompile.models import MLP, DigitsCNN

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--malloc", choices=["default", "keep"], default="default")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--optimizer", choices=["fused", "loop"], default="fused")
    args = parser.parse_args()
    use_malloc(args.malloc, "benchmarks.bench_train_step")
    variants = dict(VARIANTS)
    if args.device == "cuda":
        variants["fp8-e5m2-sr triton"] = {**FP8, "codegen": "triton"}
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = ["| model | variant | step ms | × fp32 inductor | fp8 eager ÷ this |", "|---|---|---|---|---|"]
    checks = []
    fused = args.optimizer == "fused"
    for case, (model_fn, x, y) in CASES.items():
        torch._dynamo.reset()
        steps = {name: step_fn(model_fn, x, y, opts, args.device, fused) for name, opts in variants.items()}
        timed = interleaved_times(steps, args.rounds, sync=sync)
        times = {name: statistics.median(ts) for name, ts in timed.items()}
        for variant, t in times.items():
            print(f"{case:<34} {variant:<22} {t * 1e3:8.2f} ms", flush=True)
        for variant, t in times.items():
            rows.append(
                f"| {case} | {variant} | {t * 1e3:.2f} | {t / times['fp32 inductor']:.2f} "
                f"| {times['fp8-e5m2-sr eager'] / t:.1f} |"
            )
        fp8, eager = times["fp8-e5m2-sr compiled"], times["fp8-e5m2-sr eager"]
        checks.append(
            f"| {case} | {fp8 / times['fp32 inductor']:.2f}× (target ≤ 1.5×) "
            f"| {eager / fp8:.1f}× (target ≥ 5×) | {eager / times['fp32 inductor']:.1f}× |"
        )
    malloc = MALLOC_NOTES[args.malloc]
    if args.malloc == "default":
        malloc += " (eager times depend on allocation history; see the script's docstring)"
    if args.device == "cuda":
        malloc = f"Device: {torch.cuda.get_device_name()} (steps synchronized); host {malloc}"
    sgd = "torch's fused SGD" if fused else "torch's default SGD (a loop over parameters)"
    body = f"{malloc}\n\nOptimizer: {sgd}, momentum 0.9, the same for every variant\n\n" + "\n".join(rows)
    body += (
        f"\n\nMedian step of each variant over {args.rounds} rounds; a round runs 10 steps of"
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
    print(body)
    name = "train_step" if args.malloc == "default" else "train_step_malloc_keep"
    if args.optimizer == "loop":
        name += "_sgd_loop"
    if args.device == "cuda":
        name += "_cuda"
    title = f"Training-step time (bench_train_step.py --malloc {args.malloc} --optimizer {args.optimizer})"
    write_results(name, title, body)


if __name__ == "__main__":
    main()
