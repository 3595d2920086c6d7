"""What the paper scripts share: seed statistics, the comparisons the slow tests make,
CPU time, the results page and the curves."""

from __future__ import annotations

import math
import platform
import resource
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from benchmarks.common import RESULTS, machine

PAPERS = RESULTS / "papers"


def mean_std(values: Sequence[float], digits: int = 1) -> str:
    """``mean ± std`` over seeds (sample standard deviation; 0 for one value)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {std:.{digits}f}"


def standard_error(a: Sequence[float], b: Sequence[float]) -> float:
    """The standard error of ``mean(a) - mean(b)`` for independent seeds (Welch)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("a comparison over seeds needs at least two seeds on each side")
    return math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def within_spread(a: Sequence[float], b: Sequence[float], k: float = 2.0, floor: float = 0.0) -> bool:
    """Whether the means of ``a`` and ``b`` differ by at most ``k`` standard errors.

    ``floor`` bounds the standard error from below, for metrics whose seeds can all
    agree exactly (a spread of zero would make any difference "significant").
    """
    return abs(statistics.fmean(a) - statistics.fmean(b)) <= k * max(standard_error(a, b), floor)


def worse_by(
    worse: Sequence[float], better: Sequence[float], k: float = 2.0, higher_is_better: bool = True
) -> bool:
    """Whether ``worse``'s mean is behind ``better``'s by more than ``k`` standard errors."""
    gap = statistics.fmean(better) - statistics.fmean(worse)
    if not higher_is_better:
        gap = -gap
    return gap > k * standard_error(worse, better)


def lower_per_seed(
    lower: Sequence[float], higher: Sequence[float], k: float = 2.0, floor: float = 1e-6
) -> bool:
    """Whether ``lower`` sits below ``higher`` seed by seed: the mean over paired seeds of
    ``log(higher / lower)`` exceeds ``k`` of its standard errors.

    For positive metrics that span binades across seeds (underflow fractions), measured
    with the same seed on both sides: one seed's outlier would swamp an unpaired
    comparison of means. ``floor`` stands in for zeros.
    """
    if len(lower) != len(higher) or len(lower) < 2:
        raise ValueError("a paired comparison needs the same seeds, at least two, on both sides")
    gaps = [math.log(max(h, floor) / max(lo, floor)) for lo, h in zip(lower, higher, strict=True)]
    return statistics.fmean(gaps) > k * statistics.stdev(gaps) / math.sqrt(len(gaps))


def cpu_seconds() -> float:
    """User and system CPU time of this process and of its finished child processes."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def header(command: str) -> str:
    """The lines every results page opens with: machine, versions and the command."""
    versions = f"Python {platform.python_version()}, torch {torch.__version__}"
    return f"Machine: {machine()}\n\nVersions: {versions}\n\nCommand: `{command}`\n"


def write_paper(name: str, title: str, body: str, argv: Sequence[str] | None = None) -> Path:
    """Write ``benchmarks/results/papers/<name>.md`` under :func:`header`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m", f"benchmarks.papers.{name}", *argv])
    PAPERS.mkdir(parents=True, exist_ok=True)
    path = PAPERS / f"{name}.md"
    path.write_text(f"# {title}\n\n{header(command)}\n{body}\n")
    return path


def plot_curves(
    curves: Mapping[str, Sequence[Sequence[float]]],
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    log_y: bool = False,
) -> Path:
    """One line per variant: the mean over seeds of equal-length curves, with min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, runs in curves.items():
        length = min(len(c) for c in runs)
        columns = [[c[i] for c in runs] for i in range(length)]
        ax.plot(range(length), [statistics.fmean(col) for col in columns], label=name, linewidth=1.2)
        ax.fill_between(
            range(length), [min(col) for col in columns], [max(col) for col in columns], alpha=0.15
        )
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
