"""Throughput and peak memory of E5M2 quantize-dequantize on the CPU, next to a same-run copy.

Rounds 16M FP32 values to E5M2 and back to FP32 (round-to-nearest-even and
stochastic rounding), eager and compiled with Inductor, and reports GB/s as
bytes read plus bytes written (8 bytes per element for every row, whatever the
implementation moves in between) and the ratio to ``x.clone()`` timed in the
same run. All rows are timed round-robin, so a busy machine slows them alike.

Peak memory: one call per row on 64M values, each in a fresh process (Linux: the
resident-memory high-water mark, reset just before the call), beyond what was
resident before it, in units of the input's size.

    python benchmarks/bench_quantize.py [--numel N] [--repeats R] [--memory-numel M] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lpcompile import quantize

TARGET = 0.30  # the direct API (both roundings) and compiled SR at >= 30% of copy bandwidth
MEMORY_TARGET = 2.0  # the direct API's peak memory beyond the input at most 2x the input's size


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> str:
    try:
        return " ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def rne(x):
    return quantize(x, "e5m2", "nearest")


def sr(x, seed):
    return quantize(x, "e5m2", "stochastic", seed=seed)


def rne_op(x):
    """The operator called directly: its reference ops, one by one."""
    return torch.ops.lowprec.quantize(x, "e5m2", "nearest", "saturate", None, 0, None)


def sr_op(x, seed):
    return torch.ops.lowprec.quantize(x, "e5m2", "stochastic", "saturate", seed, 0, None)


def torch_cast(x):
    return x.to(torch.float8_e5m2).float()


MEMORY_ROWS = {  # label -> (call on the input and a seed, is it a target row)
    "x.clone() (the output alone)": (lambda x, seed: x.clone(), False),
    "lowprec RNE, the operator op by op": (lambda x, seed: rne_op(x), False),
    "lowprec RNE, lpcompile.quantize (direct API)": (lambda x, seed: rne(x), True),
    "lowprec SR, the operator op by op": (sr_op, False),
    "lowprec SR, lpcompile.quantize (direct API)": (sr, True),
}


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_extra_memory(label: str, numel: int) -> float:
    """Peak resident memory of one call of a ``MEMORY_ROWS`` row beyond what was resident
    before it, in input sizes; run in a process of its own."""
    fn, _ = MEMORY_ROWS[label]
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 100
    seed = torch.tensor(1234, dtype=torch.int64)
    fn(x[: 1 << 20], seed)  # compiles: the kernel takes any length
    Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark to the current RSS
    before = status_bytes("VmRSS")
    if status_bytes("VmHWM") > before + (1 << 20):
        raise RuntimeError("the resident-memory high-water mark did not reset")
    fn(x, seed)
    return (status_bytes("VmHWM") - before) / x.nbytes


def memory_table(numel: int) -> str:
    lines = [
        "| operation | peak extra MiB | of input size | target: direct API <= 2x input |",
        "|---|---:|---:|---|",
    ]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}  # this checkout's lpcompile
    for label, (_, is_target) in MEMORY_ROWS.items():
        command = [sys.executable, "-m", "benchmarks.bench_quantize", "--peak-memory", label]
        command += ["--memory-numel", str(numel)]
        out = subprocess.run(command, env=env, cwd=root, check=True, capture_output=True, text=True)
        ratio = float(out.stdout.split()[-1])
        verdict = ("met" if ratio <= MEMORY_TARGET else "not met") if is_target else ""
        lines.append(f"| {label} | {ratio * 4 * numel / 2**20:.0f} | {ratio:.2f} | {verdict} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory-numel", type=int, default=1 << 26)
    parser.add_argument(
        "--peak-memory", metavar="ROW", help="print one MEMORY_ROWS row's peak memory and exit"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "quantize.md")
    args = parser.parse_args()
    if args.peak_memory:
        print(peak_extra_memory(args.peak_memory, args.memory_numel))
        return
    memory = memory_table(args.memory_numel)

    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)) * 100
    seed = torch.tensor(1234, dtype=torch.int64)
    rne_c = torch.compile(rne, fullgraph=True)
    sr_c = torch.compile(sr, fullgraph=True)
    cast_c = torch.compile(torch_cast, fullgraph=True)

    rows = {  # label -> (callable, is it the target row)
        "x.clone() (copy bandwidth)": (lambda: x.clone(), False),
        "torch x.to(float8_e5m2).float(), eager": (lambda: torch_cast(x), False),
        "torch x.to(float8_e5m2).float(), compiled": (lambda: cast_c(x), False),
        "lowprec RNE, the operator op by op": (lambda: rne_op(x), False),
        "lowprec RNE, lpcompile.quantize (direct API)": (lambda: rne(x), True),
        "lowprec RNE, compiled": (lambda: rne_c(x), False),
        "lowprec SR, the operator op by op": (lambda: sr_op(x, seed), False),
        "lowprec SR, lpcompile.quantize (direct API)": (lambda: sr(x, seed), True),
        "lowprec SR, compiled": (lambda: sr_c(x, seed), True),
    }
    qtorch_note = "not installed"
    if importlib.util.find_spec("qtorch") is not None:
        from qtorch.quant import float_quantize

        rows["qtorch float_quantize(exp=5, man=2, 'stochastic'), eager"] = (
            lambda: float_quantize(x, exp=5, man=2, rounding="stochastic"),
            False,
        )
        qtorch_note = "installed (row above)"

    compile_start = time.perf_counter()
    per_round = {}  # fast rows are timed several times per round: more samples, same wall time
    for label, (fn, _) in rows.items():
        for _ in range(args.warmup):
            start = time.perf_counter()
            fn()
        per_round[label] = max(1, min(5, int(0.3 / (time.perf_counter() - start))))
    warm_s = time.perf_counter() - compile_start
    # The compiled kernels must compute what the eager reference computes.
    assert torch.equal(rne_c(x).view(torch.int32), rne_op(x).view(torch.int32)), "compiled RNE differs"
    assert torch.equal(rne(x).view(torch.int32), rne_op(x).view(torch.int32)), "the direct API's RNE differs"
    assert torch.equal(sr_c(x, seed).view(torch.int32), sr_op(x, seed).view(torch.int32)), (
        "compiled SR differs"
    )
    assert torch.equal(sr(x, seed).view(torch.int32), sr_op(x, seed).view(torch.int32)), (
        "the direct API's SR differs"
    )
    assert torch.equal(rne(x), torch_cast(x.clamp(-57344, 57344))), "RNE differs from torch's cast"

    load_before = load_average()
    times: dict[str, list[float]] = {label: [] for label in rows}
    for _ in range(args.repeats):
        for label, (fn, _) in rows.items():
            for _ in range(per_round[label]):
                start = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - start)
    load_after = load_average()

    nbytes = 8 * args.numel  # 4 read + 4 written per element
    clone = times["x.clone() (copy bandwidth)"]
    clone_med, clone_best = statistics.median(clone), min(clone)
    lines = [
        "| operation | median ms | GB/s | of clone | best ms | of clone, best "
        "| target: >= 30% of clone (median) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, (_, is_target) in rows.items():
        med, best = statistics.median(times[label]), min(times[label])
        ratio = clone_med / med
        verdict = ("met" if ratio >= TARGET else "not met") if is_target else ""
        lines.append(
            f"| {label} | {med * 1e3:.1f} | {nbytes / med / 1e9:.2f} | {ratio:.2f} "
            f"| {best * 1e3:.1f} | {clone_best / best:.2f} | {verdict} |"
        )
    if "qtorch" not in " ".join(rows):
        lines.append("| qtorch float_quantize stochastic | — | — | — | — | — | not installed |")
    table = "\n".join(lines)

    report = f"""# E5M2 quantize throughput and peak memory (CPU)

Generated by `python benchmarks/bench_quantize.py` on {datetime.date.today().isoformat()}.

- Machine: {cpu_model()}, {os.cpu_count()} logical cores, torch {torch.__version__} \
({torch.get_num_threads()} threads), Python {platform.python_version()}
- Workload: {args.numel:,} FP32 values (randn * 100) rounded to E5M2 and back to FP32;
  bytes = 4 read + 4 written per element for every row.
- Timing: median over {args.repeats} round-robin rounds (1 call per round for the slow
  eager rows, up to 5 for the fast ones) after {args.warmup} warm-up calls
  (warm-up incl. compiles {warm_s:.0f} s). Load average before/after timing:
  {load_before} / {load_after} (the machine is shared; the ratio to the same-run clone
  is the figure to compare, the absolute GB/s move with the load; "best" is the
  fastest repeat, the least disturbed by other processes).
- Compiled results, the direct API's included, were checked bit-identical to the operator
  run op by op before timing.
- qtorch: {qtorch_note}.

{table}

## Peak memory

One call on {args.memory_numel:,} FP32 values ({4 * args.memory_numel / 2**20:.0f} MiB), each row in a
fresh process after a warm-up call that compiles: the resident-memory high-water mark
(`VmHWM`, reset through `/proc/self/clear_refs` just before the call) less the resident
memory before it. The output itself is one input size.

{memory}
"""
    print(table, memory, sep="\n\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
