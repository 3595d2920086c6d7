"""FP8 pipelined backpropagation on the digits set with loss scaling per stage.

The DigitsCNN cut into one stage per layer (four stages, PB+SC+LWP^v, the batch-32
recipe scaled to batch 1, the learning rate decaying linearly to zero), each stage
compiled with ``fp8-e5m2`` (E5M2 everywhere, round to nearest; errors overflow to inf)
with the eager executor: FP32 stages against FP8 stages without loss scaling, with a
static scale of 2^16 (the loss's error overflows E5M2 for nearly every sample) and with
the default dynamic scales (from 2^16). Per row: test accuracy over seeds, and for the
first seed each stage's final scale and the updates it skipped.

``python -m benchmarks.bench_pipeline_scaling`` writes ``results/pipeline_scaling.md``;
``--quick`` runs one seed of one epoch and prints the page.
"""

from __future__ import annotations

import argparse
import math
import time

from benchmarks.common import write_results
from benchmarks.papers.common import mean_std
from examples.data import load_digits
from examples.pipeline_digits import DigitsRun, run_digits
from lpcompile.runtime.pipeline import scale_hyperparameters

FP8 = {"recipe": "fp8-e5m2", "executor": "eager"}
# row -> PipelinedTrainer options
ROWS = {
    "FP32": {},
    "FP8, no scaling": {"compile": FP8},
    "FP8, static 2^16": {"compile": FP8, "loss_scale": 2.0**16},
    "FP8, dynamic": {"compile": FP8, "loss_scale": "dynamic"},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one seed, one epoch; print the page")
    args = parser.parse_args()
    seeds, epochs = (1, 1) if args.quick else (args.seeds, args.epochs)
    lr, momentum = scale_hyperparameters(0.016, 0.9, batch_size=32)
    data = load_digits()
    runs: dict[str, list[DigitsRun]] = {}
    start = time.perf_counter()
    for row, options in ROWS.items():
        for seed in range(seeds):
            run = run_digits(
                "PB+SC+LWPv", lr=lr, momentum=momentum, epochs=epochs, seed=seed, data=data, options=options
            )
            runs.setdefault(row, []).append(run)
            print(f"{row:28s} seed {seed}: {run.test_accuracy:5.1f}%  {run.seconds:5.1f} s", flush=True)
    lines = [
        "| stages | test accuracy (%) | final scale per stage (seed 0) | skipped per stage (seed 0) "
        "| s/run |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row, found in runs.items():
        first = found[0]
        scales = ", ".join(f"2^{math.log2(v):g}" for v in first.loss_scales.values())
        skipped = ", ".join(str(n) for n in first.skipped.values())
        seconds = sum(r.seconds for r in found) / len(found)
        accuracy = mean_std([r.test_accuracy for r in found])
        lines.append(f"| {row} | {accuracy} | {scales} | {skipped} | {seconds:.0f} |")
    body = "\n".join(
        [
            f"Command: `python -m benchmarks.bench_pipeline_scaling{' --quick' if args.quick else ''}` "
            f"({seeds} seeds, {epochs} epochs of {len(data.train_y)} samples; "
            f"{time.perf_counter() - start:.0f} s in all)",
            "",
            __doc__.split("\n\n")[1].replace("\n", " "),
            "",
            *lines,
            "",
            "Stages are listed from the input (stage 0, delay 6) to the loss (stage 3).",
        ]
    )
    if args.quick:
        print(body)
        return
    title = "FP8 pipelined backpropagation with loss scaling per stage"
    path = write_results("pipeline_scaling", title, body)
    print(body, f"\nwrote {path}", sep="\n")


if __name__ == "__main__":
    main()
