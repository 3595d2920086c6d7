"""The fusion patterns of ``lpcompile.codegen``: fused vs unfused, on the CPU (and a GPU if lent).

Five patterns, each one generated Triton kernel under ``codegen="triton"``:

1. ``quantize``: SR to E5M2 with a scale;
2. bias add + ReLU + activation quantize (E4M3), writing the ReLU output too;
3. weight-gradient SR quantize + unscale by a 0-dim scale + inf/NaN count;
4. error x layer scale + SR quantize + the exponent histogram and moments
   (``lowprec.scale_grad``'s backward);
5. predicted weight (LWP^v) + E4M3 quantize.

CPU: the Triton interpreter is a correctness tool, not a speed path (~0.7 us per
element), so the CPU "fused path" is the device policy's: the reference ops
compiled by Inductor (which fuses their decompositions into C++), against the
same ops run eagerly one by one (unfused), in the same run, round-robin. Each
row also gives GB/s (bytes each input read once + each output written once)
and the fraction of a same-run ``clone`` of the largest input. A small-size
interpreted-Triton timing is listed for scale only.

GPU (only when CUDA is available): each generated kernel's GB/s against a
same-run device-to-device copy and against Inductor's fusion of the same ops.

    python -m benchmarks.bench_codegen [--numel N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from benchmarks.common import interleaved_times, machine, write_results
from lpcompile.adaptive_ops import gradient_stats
from lpcompile.ops_pipeline import predict_weight

Q = torch.ops.lowprec.quantize
QG = torch.ops.lowprec.quantize_grad
GPU_TARGET = 0.80  # of copy bandwidth, for the pointwise groups (issue 6)


def patterns(rows: int, cols: int, device: str) -> dict[str, tuple[Callable, tuple]]:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    seed = torch.tensor(12345, dtype=torch.int64, device=device)
    scalar = torch.tensor(64.0, device=device)
    lr = torch.tensor(0.01, device=device)

    def quantize_sr(x, seed, s):
        return Q(x, "e5m2", "stochastic", "inf", seed, 1, s)

    def bias_relu_quantize(h, b):
        r = F.relu(QG(h, "e5m2", "nearest", "inf", None, 2) + b)
        return r, Q(r, "e4m3", "nearest", "saturate", None, 3, None)

    def wgrad_unscale(g, inv, seed):
        q = Q(g, "e5m2", "stochastic", "inf", seed, 4, None)
        return q * inv, (~torch.isfinite(q)).sum().to(torch.float32)

    def error_scale_hist(g, s, seed):
        return gradient_stats(g, "histogram"), Q(g * s, "e5m2", "stochastic", "inf", seed, 5, None)

    def predicted_quantize(w, v, lr):
        return Q(predict_weight(w, v, lr, 3, "lwp_v"), "e4m3", "nearest", "saturate", None, 6, None)

    return {
        "1 quantize (SR, scale)": (quantize_sr, (randn(rows, cols), seed, scalar)),
        "2 bias + relu + quantize": (bias_relu_quantize, (randn(rows, cols), randn(cols))),
        "3 wgrad SR quantize + unscale + inf count": (wgrad_unscale, (randn(rows, cols), 1 / scalar, seed)),
        "4 error x scale + SR + histogram": (error_scale_hist, (randn(rows, cols) * 1e-3, scalar, seed)),
        "5 predicted weight + quantize": (predicted_quantize, (randn(rows, cols), randn(rows, cols), lr)),
    }


def traffic(fn: Callable, args: tuple) -> int:
    """Bytes of one fused pass: every tensor input read once, every output written once."""
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    flat = [t for t in args if isinstance(t, torch.Tensor)]
    for o in outs:
        flat += list(o) if isinstance(o, tuple) else [o]
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))


def round_robin(fns: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None]) -> dict:
    """Median seconds per call of each function, timed in turns so that load hits all alike."""
    times = interleaved_times(fns, repeats, block=1, warmup=2, sync=sync)
    return {name: statistics.median(t) for name, t in times.items()}


def fused_graph(fn: Callable, args: tuple):
    from torch.fx.experimental.proxy_tensor import make_fx

    from lpcompile.codegen import fuse_lowprec_kernels

    gm = make_fx(fn, tracing_mode="fake")(*args)
    ctx = SimpleNamespace(kernels=[])
    fuse_lowprec_kernels(gm, ctx)
    return gm, ctx.kernels


def cpu_section(numel: int, repeats: int) -> str:
    cols = 1024
    rows = max(1, numel // cols)
    lines = [
        f"## CPU: Inductor-compiled reference (fused C++) vs unfused eager ops, {rows}x{cols} fp32",
        "",
        "GB/s counts each input read once and each output written once. `copy` is a same-run",
        "`x.clone()` of one input; `fraction` is compiled GB/s over copy GB/s.",
        "",
        "| pattern | eager ms | compiled ms | eager / compiled | compiled GB/s | fraction of copy |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    x = torch.randn(rows, cols)
    for name, (fn, args) in patterns(rows, cols, "cpu").items():
        compiled = torch.compile(fn, backend="inductor")
        fns = {"eager": partial(fn, *args), "compiled": partial(compiled, *args), "copy": x.clone}
        t = round_robin(fns, repeats, lambda: None)
        gbs = traffic(fn, args) / t["compiled"] / 1e9
        copy_gbs = 2 * x.numel() * 4 / t["copy"] / 1e9
        eager_ms, compiled_ms = t["eager"] * 1e3, t["compiled"] * 1e3
        lines.append(
            f"| {name} | {eager_ms:.2f} | {compiled_ms:.2f} | {eager_ms / compiled_ms:.1f}x "
            f"| {gbs:.1f} | {gbs / copy_gbs:.2f} |"
        )
    return "\n".join(lines)


def interpreter_section(repeats: int) -> str:
    """The generated kernels in Triton's interpreter, on 64K elements: for scale, not speed."""
    os.environ["TRITON_INTERPRET"] = "1"
    rows, cols = 64, 1024
    lines = [
        f"## CPU: generated Triton in the interpreter ({rows}x{cols}; a correctness tool, not a speed path)",
        "",
        "| pattern | kernels | interpreted ms | eager ms |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, (fn, args) in patterns(rows, cols, "cpu").items():
        gm, kernels = fused_graph(fn, args)
        fns = {"fused": partial(gm, *args), "eager": partial(fn, *args)}
        t = round_robin(fns, max(3, repeats // 3), lambda: None)
        lines.append(f"| {name} | {len(kernels)} | {t['fused'] * 1e3:.1f} | {t['eager'] * 1e3:.2f} |")
    return "\n".join(lines)


def gpu_section(numel: int, repeats: int) -> str:
    if not torch.cuda.is_available():
        return (
            "## GPU: not measured (no GPU lent in this session)\n\n"
            f"The target, each pointwise group at >= {GPU_TARGET:.0%} of a same-run device-to-device\n"
            "copy, and the comparison with Inductor's own fusion of the same ops, are unmeasured;\n"
            "`python -m benchmarks.bench_codegen` on a CUDA machine fills this section in."
        )
    os.environ.pop("TRITON_INTERPRET", None)
    cols = 4096
    rows = max(1, numel // cols)
    x = torch.randn(rows, cols, device="cuda")
    lines = [
        f"## GPU: {torch.cuda.get_device_name()}, {rows}x{cols} fp32",
        "",
        "| pattern | kernels | fused GB/s | fraction of copy | Inductor GB/s | fused / Inductor |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (fn, args) in patterns(rows, cols, "cuda").items():
        gm, kernels = fused_graph(fn, args)
        inductor = torch.compile(fn, backend="inductor")
        fns = {"fused": partial(gm, *args), "inductor": partial(inductor, *args), "copy": x.clone}
        t = round_robin(fns, repeats, torch.cuda.synchronize)
        nbytes = traffic(fn, args)
        fused, ind = nbytes / t["fused"] / 1e9, nbytes / t["inductor"] / 1e9
        copy = 2 * x.nbytes / t["copy"] / 1e9
        lines.append(
            f"| {name} | {len(kernels)} | {fused:.0f} | {fused / copy:.2f} | {ind:.0f} | {fused / ind:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadier when shared)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    body = "\n\n".join(
        [
            cpu_section(args.numel, args.repeats),
            interpreter_section(args.repeats),
            gpu_section(args.numel, args.repeats),
        ]
    )
    body += (
        f"\n\nLoad average before / after: {load[0]:.1f} / {os.getloadavg()[0]:.1f} (other jobs share the"
        " machine: eager rows, many small ops, suffer most from it).\n\n"
        f"Run: `python -m benchmarks.bench_codegen --numel {args.numel} --repeats {args.repeats}"
        f" --threads {args.threads}`"
    )
    print(f"Machine: {machine()}\n\n{body}")
    if not args.no_write:
        print(write_results("codegen", "Codegen: fused lowprec patterns", body))


if __name__ == "__main__":
    main()
