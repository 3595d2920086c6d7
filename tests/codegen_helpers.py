"""Shared by the codegen tests: run generated Triton and trace small ATen graphs.

Generated kernels run in Triton's interpreter on CPU, or compiled on a GPU with
``LOWPREC_TEST_DEVICE=cuda`` (``devices.py``). ``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel module is imported (``triton.knobs`` reads
the environment lazily), so the fixture :func:`interpreted` sets it on CPU (unsets
it on a GPU), and a private ``LOWPREC_CACHE``, for the codegen tests only and
restores both after.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
from devices import TEST_DEVICE, on_test_device
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map

from lpcompile.codegen import fuse_lowprec_kernels, launcher
from lpcompile.numerics.formats import FloatFormat


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """TRITON_INTERPRET=1 on CPU (compiled kernels on a GPU), a fresh kernel cache: for a module's tests."""
    saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "LOWPREC_CACHE")}
    if TEST_DEVICE.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    os.environ["LOWPREC_CACHE"] = str(tmp_path_factory.mktemp("lowprec_kernels"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def small_blocks():
    """At most 1024 elements per program (interpreted, and on a GPU for kernels with
    reductions too), so that kernels run several programs and a partial block."""
    saved = launcher.MAX_INTERPRETED_BLOCK, launcher.GPU_REDUCTION_BLOCK
    launcher.MAX_INTERPRETED_BLOCK = launcher.GPU_REDUCTION_BLOCK = 1024
    yield
    launcher.MAX_INTERPRETED_BLOCK, launcher.GPU_REDUCTION_BLOCK = saved


def fuse(fn, *inputs):
    """Trace ``fn`` to an ATen graph on the test device, fuse it; return ``(run, kernel records)``.

    ``run(*inputs)`` takes CPU tensors, runs the fused graph on the test device and returns
    its outputs on the CPU, where the tests compare them with ``fn`` run on the reference ops.
    """
    gm = make_fx(fn, tracing_mode="fake")(*map(on_test_device, inputs))
    ctx = SimpleNamespace(kernels=[])
    fuse_lowprec_kernels(gm, ctx)
    if TEST_DEVICE.type == "cpu":
        return gm, ctx.kernels

    def run(*args):
        outs = gm(*map(on_test_device, args))
        return tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, outs)

    return run, ctx.kernels


def edge_values(fmt: FloatFormat, random: int, seed: int = 0) -> torch.Tensor:
    """Values around ``fmt``'s edges (zeros, subnormals, ties, max, overflow, inf/NaN) and random ones."""
    sub, norm, top, m = fmt.min_subnormal, fmt.min_normal, fmt.max, fmt.man_bits
    f32_max = torch.finfo(torch.float32).max
    edges = [
        0.0,
        sub,
        sub / 2,
        sub * 1.5,
        sub * 0.75,
        sub * 2.5,
        norm,
        norm - sub / 2,
        norm - sub,
        norm * 1.25,
    ]
    edges += [1.0, 1.0 + 2.0 ** -(m + 1), 1.0 + 3 * 2.0 ** -(m + 1), 3.0, 0.1, 1e-40, 1e-45, 1.4e-45]
    edges += [top, top * (1 + 2.0 ** -(m + 2)), top * (1 + 2.0 ** -(m + 1)), min(top * 2, f32_max), f32_max]
    edges += [math.inf, math.nan]
    values = torch.tensor(edges + [-v for v in edges], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    lo, hi = fmt.min_exp - fmt.man_bits - 3, min(fmt.max_exp + 2, 127)
    exps = torch.randint(lo, hi + 1, (random,), generator=gen).to(torch.float64)
    mant = 1 + torch.rand(random, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(random, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
    return torch.cat([values, sign * mant * 2.0**exps]).to(torch.float32)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in FP32 ulps (ordered bit patterns), for finite values."""

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return (ordered(a) - ordered(b)).abs()
