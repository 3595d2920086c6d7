"""The demo: train a small CNN on scikit-learn's digits in FP32 eager, FP32 compiled
and FP8 compiled (``fp8-e5m2-sr`` with enhanced loss scaling), and compare.

Run from the repository root: ``python -m examples.demo [--epochs N]`` (``make demo``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from examples.train import train_digits


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=_positive_int, default=8)
    args = parser.parse_args(argv)
    runs = [
        ("fp32 eager", None, False, "none"),
        ("fp32 compiled", {"recipe": "fp32"}, True, "none"),
        ("fp8-e5m2-sr", {"recipe": "fp8-e5m2-sr"}, True, "enhanced"),
    ]
    print(f"Training a small CNN on scikit-learn's digits ({args.epochs} epochs, torch {torch.__version__})")
    results = [
        train_digits(name, options, compiled=compiled, loss_scale=scale, epochs=args.epochs, progress=True)
        for name, options, compiled, scale in runs
    ]
    print(f"{'run':<16}{'test acc %':>11}{'final loss':>12}{'step ms':>10}{'compile s':>11}")
    for r in results:
        print(
            f"{r.name:<16}{r.test_accuracy:>11.2f}{r.final_loss:>12.4f}"
            f"{r.step_time * 1e3:>10.2f}{r.compile_time:>11.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
