"""The ``lowprec`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch


def _demo(args: argparse.Namespace) -> int:
    from lpcompile.train import train_digits

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lowprec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train the digits CNN in FP32 and FP8 and compare")
    demo.add_argument("--epochs", type=int, default=8)
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
