"""Matmul of two E5M2 operands: lowprec's bf16 kernel against torch's GEMMs.

The shapes are the benchmark MLP's (784-1024-1024-10, batch 128): its forward,
error and weight-gradient products. Rows:

* ``torch.mm`` on the FP32 tensors (what Inductor calls with ``matmul="fp32"``);
* ``lowprec::mm_bf16`` on the same FP32 tensors (packing to bfloat16 included),
  called as the Python function and through ``torch.ops.lowprec.mm_bf16`` (the
  dispatcher's overhead included, as a compiled graph calls it);
* ``torch.mm`` on the FP32 tensors with ``torch.backends.mkldnn.matmul.fp32_precision
  = "bf16"`` (oneDNN may compute an FP32 matmul on bfloat16 dot products). The flag
  is process-global: it is set and restored around each timed call only, so the
  other rows run without it;
* ``torch.mm`` on bfloat16 copies (oneDNN; rounds its output to bfloat16, so it is
  not a substitute, only the speed of a tuned bfloat16 GEMM on this CPU).

Every FP32-output result is checked against the FP32 GEMM within the FP32
dot-product error bound before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.common import interleaved_times, write_results
from lpcompile import quantize
from lpcompile.kernels.cpu import gemm as cpu_gemm

# (M, K, N) and which operand is read transposed, as the MLP's graphs read them.
SHAPES = {
    "forward, layer 1: x @ W1^T": (128, 784, 1024, "nt"),
    "forward, layer 2: h @ W2^T": (128, 1024, 1024, "nt"),
    "error, layer 2: g @ W2": (128, 1024, 784, "nn"),
    "weight gradient, layer 2: g^T @ h": (1024, 128, 1024, "tn"),
}


def operands(m: int, k: int, n: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(k, m, generator=g).t() if layout[0] == "t" else torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g).t() if layout[1] == "t" else torch.randn(k, n, generator=g)
    return quantize(a, "e5m2"), quantize(b, "e5m2")


def mkldnn_bf16_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with oneDNN allowed bfloat16 dot products, the previous setting restored."""
    previous = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        return a @ b
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = previous


def mkldnn_bf16_rounds(m: int, k: int, n: int, layout: str) -> bool:
    """Whether the flag makes oneDNN round FP32 operands to bfloat16 for this product: 1 + 2^-10
    is no bfloat16, so K of them dotted with ones give K rounded, K (1 + 2^-10) exactly if not."""
    a, b = operands(m, k, n, layout)
    a, b = torch.full_like(a, 1 + 2.0**-10), torch.ones_like(b)
    return (mkldnn_bf16_mm(a, b) != k * (1 + 2.0**-10)).any().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if why := cpu_gemm.unavailable():
        raise SystemExit(f"the bf16 kernel cannot run here: {why}")
    rows = [
        "| product | M x K x N | FP32 torch.mm ms | lowprec mm_bf16 ms | torch.ops.lowprec.mm_bf16 ms "
        "| mkldnn bf16 torch.mm ms | bf16 torch.mm ms | mm_bf16 speed-up over FP32 "
        "| op speed-up over FP32 | mkldnn bf16 speed-up over FP32 | mm_bf16 time ÷ bf16 torch.mm "
        "| mkldnn bf16 rounds operands |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (m, k, n, layout) in SHAPES.items():
        a, b = operands(m, k, n, layout)
        a16, b16 = a.bfloat16(), b.bfloat16()
        exact, bound = a.double() @ b.double(), k * 2.0**-24 * (a.double().abs() @ b.double().abs())
        for key, out in [
            ("mm_bf16", cpu_gemm.mm(a, b)),
            ("torch.ops.lowprec.mm_bf16", torch.ops.lowprec.mm_bf16(a, b)),
            ("mkldnn bf16", mkldnn_bf16_mm(a, b)),
        ]:
            assert ((out.double() - exact).abs() <= bound).all(), f"{name}: {key}"
        fns = {
            "fp32": lambda a=a, b=b: a @ b,
            "ours": lambda a=a, b=b: cpu_gemm.mm(a, b),
            "op": lambda a=a, b=b: torch.ops.lowprec.mm_bf16(a, b),
            "mkldnn": lambda a=a, b=b: mkldnn_bf16_mm(a, b),
            "bf16": lambda a=a16, b=b16: a @ b,
        }
        t = {key: statistics.median(ts) * 1e3 for key, ts in interleaved_times(fns, args.rounds).items()}
        print(
            f"{name:<36} fp32 {t['fp32']:.3f}  mm_bf16 {t['ours']:.3f}  op {t['op']:.3f}"
            f"  mkldnn-bf16 {t['mkldnn']:.3f}  bf16 {t['bf16']:.3f}",
            flush=True,
        )
        rows.append(
            f"| {name} | {m} x {k} x {n} | {t['fp32']:.3f} | {t['ours']:.3f} | {t['op']:.3f} "
            f"| {t['mkldnn']:.3f} | {t['bf16']:.3f} | {t['fp32'] / t['ours']:.2f}× "
            f"| {t['fp32'] / t['op']:.2f}× | {t['fp32'] / t['mkldnn']:.2f}× | {t['ours'] / t['bf16']:.2f} "
            f"| {'yes' if mkldnn_bf16_rounds(m, k, n, layout) else 'no'} |"
        )
    command = " ".join(["python -m benchmarks.bench_matmul", *sys.argv[1:]])
    body = f"`{command}`\n\n" + "\n".join(rows)
    body += (
        f"\n\nMedian over {args.rounds} rounds of 10 calls each, the five taken in turn (after 3"
        " warm-up calls). Operands are E5M2 values in FP32 tensors; mm_bf16's time includes"
        ' packing them into bfloat16 pairs, bf16 torch.mm\'s excludes the conversion. "op" is'
        ' the same kernel called through `torch.ops.lowprec.mm_bf16`. "mkldnn bf16" is FP32'
        ' `torch.mm` with `torch.backends.mkldnn.matmul.fp32_precision = "bf16"`, set and'
        ' restored around each call (about 1 µs). "mkldnn bf16 rounds operands" probes whether'
        " it computes on bfloat16 at all: K values 1 + 2^-10 (no bfloat16) dotted with ones give"
        " K exactly if oneDNN kept FP32 arithmetic (the flag allows bfloat16, it does not force it)."
    )
    print(body)
    write_results("matmul", "E5M2 matmul: lowprec's bf16 kernel against torch (bench_matmul.py)", body)


if __name__ == "__main__":
    main()
