"""Cold compile time of one digits-CNN training step: fp32 Inductor vs lowprec recipes.

Each measurement is a fresh Python process with an empty Inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` in a new temporary folder), timing the first
forward+backward+SGD step, which compiles forward and backward. Nothing is
shared between measurements, so every one pays Inductor's full cold cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import write_results

VARIANTS = {
    "fp32 inductor": "inductor",
    "fp8-e5m2 (round to nearest)": {"recipe": "fp8-e5m2"},
    "fp8-e5m2-sr (stochastic rounding)": {"recipe": "fp8-e5m2-sr"},
}

CHILD = """
import json, sys, time, torch
from benchmarks.bench_train_step import step_fn
from examples.models import DigitsCNN
x, y = torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,))
step = step_fn(DigitsCNN, x, y, json.loads(sys.argv[1]))
start = time.perf_counter()
step()
print(time.perf_counter() - start)
"""


def cold_compile_seconds(backend: str | dict) -> float:
    """The first step's wall time in a fresh process with an empty Inductor cache."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(root)}
        out = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(backend)],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):  # variants in turn: slow drifts hit all alike
        for name, backend in VARIANTS.items():
            times[name].append(cold_compile_seconds(backend))
            print(f"{name:<36} {times[name][-1]:6.1f} s", flush=True)
    base = statistics.median(times["fp32 inductor"])
    rows = ["| variant | cold first step s (median) | × fp32 inductor | runs |", "|---|---|---|---|"]
    for name, ts in times.items():
        median = statistics.median(ts)
        runs = ", ".join(f"{t:.1f}" for t in ts)
        rows.append(f"| {name} | {median:.1f} | {median / base:.2f} | {runs} |")
    body = "\n".join(rows)
    body += (
        f"\n\nDigits CNN, batch 64: the first training step (forward, backward, SGD) in a fresh"
        f" process with an empty Inductor cache, {args.repeats} runs per variant taken in turn."
        " It includes Dynamo, AOT autograd, lowprec's passes, Inductor's code generation and"
        " g++ (Inductor's precompiled header is rebuilt in every run)."
    )
    print(body)
    write_results("compile", "Cold compile time (bench_compile.py)", body)


if __name__ == "__main__":
    main()
