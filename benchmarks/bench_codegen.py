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

GPU (``--device cuda``, written to ``codegen_cuda.md``): each generated kernel's
GB/s against a same-run device-to-device copy and against Inductor's fusion of
the same ops.

    python -m benchmarks.bench_codegen [--numel N] [--repeats R] [--device cuda]
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
from torch.utils._pytree import tree_leaves

from benchmarks.common import interleaved_times, machine, write_results
from lpcompile.numerics.predict import predict_weight
from lpcompile.numerics.scale_grad import gradient_stats

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


def tensors(values: object) -> list[torch.Tensor]:
    """The tensors in a (nested) tuple of results or arguments."""
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


def traffic(fn: Callable, args: tuple) -> int:
    """Bytes of one fused pass: every tensor input read once, every output written once."""
    return sum(t.numel() * t.element_size() for t in tensors(args) + tensors(fn(*args)))


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


def same_results(got: object, want: object, numel: int) -> None:
    """Elementwise outputs bit for bit; reductions (summed in another order) to 1e-5."""
    for g, w in zip(tensors(got), tensors(want), strict=True):
        if g.numel() == numel:
            assert torch.equal(g, w), "an elementwise output changed with the block size"
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def gpu_section(numel: int, blocks: tuple[int, ...] = (1024, 4096, 16384)) -> str:
    """GB/s of each generated kernel (the fused graph's call: allocation, launch, reduction
    finish), of Inductor's fusion and of a copy, timed with CUDA events (median of
    ``triton.testing.do_bench``), in turn per pattern. Kernels with reductions are timed
    with each of ``blocks`` elements per program, their results checked against the default's.
    The seed is a CUDA tensor here; in training it is a CPU one, copied per kernel."""
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.testing import do_bench

    from lpcompile.codegen import launcher

    def bench(f: Callable[[], object]) -> float:
        f()
        return do_bench(f, warmup=25, rep=200, return_mode="median") * 1e-3

    cols = 4096
    rows = max(1, numel // cols)
    x = torch.randn(rows, cols, device="cuda")
    default_block = launcher.GPU_REDUCTION_BLOCK
    lines = [
        f"## GPU: {torch.cuda.get_device_name()}, {rows}x{cols} fp32",
        "",
        "GB/s counts each input read once and each output written once; `copy` is a same-run",
        "`x.clone()` of one input (read + write). Times: median of `triton.testing.do_bench`",
        "(CUDA events), after one warm-up call. `block`: elements per program (kernels with",
        f"reductions end each program in atomic adds; * the default, {default_block}).",
        "",
        "| pattern | kernels | block | fused µs | fused GB/s | fraction of copy | Inductor GB/s "
        "| fused / Inductor |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (fn, args) in patterns(rows, cols, "cuda").items():
        gm, kernels = fused_graph(fn, args)
        nbytes = traffic(fn, args)
        t_copy = bench(x.clone)
        t_ind = bench(partial(torch.compile(fn, backend="inductor"), *args))
        copy, ind = 2 * x.nbytes / t_copy / 1e9, nbytes / t_ind / 1e9
        reference = gm(*args)
        reduces = any(k.reductions for k in kernels)
        try:
            for block in blocks if reduces else (launcher.GPU_BLOCK,):
                launcher.GPU_REDUCTION_BLOCK = block
                same_results(gm(*args), reference, rows * cols)
                t = bench(partial(gm, *args))
                fused = nbytes / t / 1e9
                star = "*" if block == (default_block if reduces else launcher.GPU_BLOCK) else ""
                lines.append(
                    f"| {name} | {len(kernels)} | {block}{star} | {t * 1e6:.0f} | {fused:.0f} "
                    f"| {fused / copy:.2f} | {ind:.0f} | {fused / ind:.2f} |"
                )
        finally:
            launcher.GPU_REDUCTION_BLOCK = default_block
    lines.append(f"\nTarget (issue 6): each pattern at >= {GPU_TARGET:.0%} of the copy's GB/s.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=15, help="CPU rounds (the GPU uses do_bench)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steadier when shared)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    if args.device == "cuda":
        body = gpu_section(args.numel)
        body += f"\n\nRun: `python -m benchmarks.bench_codegen --numel {args.numel} --device cuda`"
    else:
        body = "\n\n".join([cpu_section(args.numel, args.repeats), interpreter_section(args.repeats)])
        body += (
            "\n\nGPU: `--device cuda`, in `codegen_cuda.md`.\n\n"
            f"Load average before / after: {load[0]:.1f} / {os.getloadavg()[0]:.1f} (other jobs share"
            " the machine: eager rows, many small ops, suffer most from it).\n\n"
            f"Run: `python -m benchmarks.bench_codegen --numel {args.numel} --repeats {args.repeats}"
            f" --threads {args.threads}`"
        )
    print(f"Machine: {machine()}\n\n{body}")
    if not args.no_write:
        name = "codegen" if args.device == "cpu" else "codegen_cuda"
        print(write_results(name, "Codegen: fused lowprec patterns", body))


if __name__ == "__main__":
    main()
