"""Matmul of two E5M2 operands: lowprec's bf16 kernel against torch's GEMMs.

The shapes are the benchmark MLP's (784-1024-1024-10, batch 128): its forward,
error and weight-gradient products. Rows:

* ``torch.mm`` on the FP32 tensors (what Inductor calls with ``matmul="fp32"``);
* ``lowprec::mm_bf16`` on the same FP32 tensors (packing to bfloat16 included);
* ``torch.mm`` on bfloat16 copies (oneDNN; rounds its output to bfloat16, so it is
  not a substitute, only the speed of a tuned bfloat16 GEMM on this CPU).

Every result is checked against the FP32 GEMM within the FP32 dot-product
error bound before timing.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import interleaved_times, write_results
from lpcompile import cpu_gemm, quantize

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if why := cpu_gemm.unavailable():
        raise SystemExit(f"the bf16 kernel cannot run here: {why}")
    rows = [
        "| product | M x K x N | FP32 torch.mm ms | lowprec mm_bf16 ms | bf16 torch.mm ms "
        "| mm_bf16 speed-up over FP32 | mm_bf16 time ÷ bf16 torch.mm |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (m, k, n, layout) in SHAPES.items():
        a, b = operands(m, k, n, layout)
        a16, b16 = a.bfloat16(), b.bfloat16()
        exact, bound = a.double() @ b.double(), k * 2.0**-24 * (a.double().abs() @ b.double().abs())
        assert ((cpu_gemm.mm(a, b).double() - exact).abs() <= bound).all(), name
        fns = {"fp32": lambda a=a, b=b: a @ b, "ours": lambda a=a, b=b: cpu_gemm.mm(a, b)}
        fns["bf16"] = lambda a=a16, b=b16: a @ b
        t = {key: statistics.median(ts) * 1e3 for key, ts in interleaved_times(fns, args.rounds).items()}
        print(f"{name:<36} fp32 {t['fp32']:.3f}  mm_bf16 {t['ours']:.3f}  bf16 {t['bf16']:.3f}", flush=True)
        rows.append(
            f"| {name} | {m} x {k} x {n} | {t['fp32']:.3f} | {t['ours']:.3f} | {t['bf16']:.3f} "
            f"| {t['fp32'] / t['ours']:.2f}× | {t['ours'] / t['bf16']:.2f} |"
        )
    body = "\n".join(rows)
    body += (
        f"\n\nMedian over {args.rounds} rounds of 10 calls each, the three taken in turn (after 3"
        " warm-up calls). Operands are E5M2 values in FP32 tensors; mm_bf16's time includes"
        " packing them into bfloat16 pairs, bf16 torch.mm's excludes the conversion."
    )
    print(body)
    write_results("matmul", "E5M2 matmul: lowprec's bf16 kernel against torch (bench_matmul.py)", body)


if __name__ == "__main__":
    main()
