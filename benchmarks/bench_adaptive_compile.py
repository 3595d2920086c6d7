"""What adaptive loss scaling adds to a cold compile: ``fp8-e5m2-als`` against
``fp8-e5m2-sr`` on models of the zoo (examples/zoo.py).

Each run is a fresh process with an empty Inductor cache (``bench_zoo.measure``); on
the CPU with one compile thread, so that the process's CPU time (g++ included) counts
the whole compile (``--device cuda``: Inductor's default compile workers). Compile
seconds: the training steps' time beyond their median, over the first steps (the
adaptive variants compile at different steps). CPU seconds: the process's, model
building and the steps included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks.bench_zoo import measure
from benchmarks.common import write_results

RECIPES = {"plain": "fp8-e5m2-sr", "adaptive": "fp8-e5m2-als"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["gpt2", "checkpointed_mlp", "transformer_encoder"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    rows = [
        "| model | compile s: plain | adaptive | extra / plain | CPU s: plain | adaptive | extra / plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        runs = {
            variant: [
                measure(name, [{"recipe": recipe, "attention": "operands"}], args.device, args.steps)[0]
                for _ in range(args.repeats)
            ]
            for variant, recipe in RECIPES.items()
        }
        print(name, json.dumps(runs), flush=True)
        errors = [r["error"] for rs in runs.values() for r in rs if "error" in r]
        if errors:
            rows.append(f"| {name} | {errors[0]} |" + " |" * 5)
            continue
        m = {
            v: {k: statistics.median(r[k] for r in rs) for k in ("compile", "cpu")} for v, rs in runs.items()
        }
        p, a = m["plain"], m["adaptive"]
        rows.append(
            f"| {name} | {p['compile']:.1f} | {a['compile']:.1f} | {a['compile'] / p['compile'] - 1:+.2f}"
            f" | {p['cpu']:.1f} | {a['cpu']:.1f} | {a['cpu'] / p['cpu'] - 1:+.2f} |"
        )
    command = "python -m benchmarks.bench_adaptive_compile " + " ".join(sys.argv[1:])
    threads = "one compile thread" if args.device == "cpu" else "Inductor's compile workers"
    body = "\n".join(rows) + (
        f"\n\nCommand: `{command}` (device {args.device}). Median of {args.repeats} run(s) per cell,"
        f' Inductor executor, `attention="operands"`, {threads}, an empty Inductor cache per run. Target: the'
        " adaptive variant adds at most half of the plain compile. Wall seconds move with"
        " whatever else the machine runs; CPU seconds less so."
    )
    print(body)
    results = "adaptive_compile" if args.device == "cpu" else f"adaptive_compile_{args.device}"
    write_results(results, "Adaptive loss scaling: compile cost (bench_adaptive_compile.py)", body)


if __name__ == "__main__":
    main()
