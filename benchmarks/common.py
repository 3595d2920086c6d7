"""Helpers shared by the benchmark scripts: timing and the results files."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``fn`` in seconds, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> str:
    """One line naming the machine the numbers were measured on."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def write_results(name: str, title: str, body: str) -> Path:
    """Write ``benchmarks/results/<name>.md`` with the machine noted."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(f"# {title}\n\nMachine: {machine()}\n\n{body}\n")
    return path
