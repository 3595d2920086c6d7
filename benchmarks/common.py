"""Helpers shared by the benchmark scripts: timing and the results files."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"

# malloc serves blocks up to 32 MiB from its heap and never trims it.
KEEP_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
MALLOC_NOTES = {
    "default": "malloc: glibc defaults",
    "keep": f"malloc: glibc with `GLIBC_TUNABLES={KEEP_TUNABLES}`"
    " (freed memory kept, no page faults on reuse)",
}


def use_malloc(mode: str, module: str) -> None:
    """With ``mode="keep"``, run ``python -m module`` again (same arguments) with glibc's
    malloc keeping freed memory, unless this process already does.

    With glibc's defaults, blocks above the mmap threshold (which moves with what the
    process freed before) come from fresh pages, page-faulted in on every use, and
    freed heap tops are trimmed: step times then depend on allocation history.
    """
    if mode == "keep" and os.environ.get("GLIBC_TUNABLES") != KEEP_TUNABLES:
        # glibc reads its tunables at start-up: run again with them set.
        os.execve(
            sys.executable,
            [sys.executable, "-m", module, *sys.argv[1:]],
            {**os.environ, "GLIBC_TUNABLES": KEEP_TUNABLES},
        )


def interleaved_times(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    block: int = 10,
    warmup: int = 3,
    sync: Callable[[], object] = lambda: None,
) -> dict[str, list[float]]:
    """Wall time (s) of every call of each function, timed in blocks taken in turn.

    Each round runs ``block`` calls of every function in turn: slow drifts of a
    shared machine hit every function alike, while consecutive calls of one
    function keep its caches warm, as a training loop does. ``sync`` runs before
    and after each timed call (e.g. ``torch.cuda.synchronize``).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(block):
                sync()
                start = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - start)
    return times


def machine() -> str:
    """One line naming the machine the numbers were measured on."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import triton

        kernels = f", triton {triton.__version__}"
    except ImportError:
        kernels = ""
    threads = torch.get_num_threads()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}{kernels}, {threads} threads"


def write_results(name: str, title: str, body: str) -> Path:
    """Write ``benchmarks/results/<name>.md`` with the machine noted."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(f"# {title}\n\nMachine: {machine()}\n\n{body}\n")
    return path
