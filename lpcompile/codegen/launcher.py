"""Launcher: write a kernel's source to the cache, import it, ``triton.jit`` it, call it.

Sources live in ``$LOWPREC_CACHE`` (default ``~/.cache/lpcompile/triton``), one
module per kernel named by the hash of its code; a process keeps the imported
kernels in memory by that hash, so a second compile of the same graph (or the
same pattern in another layer) compiles nothing. :data:`STATS` counts what
happened (``jit``: modules imported and jitted; ``memory_hits``; ``written``
and ``disk_hits`` for the files; ``launches``).

Device policy (docs/codegen.md): CUDA tensors run the compiled Triton kernel;
CPU tensors run it in Triton's interpreter, which needs ``TRITON_INTERPRET=1``
when the kernel module is imported. Without it a CPU graph compiled with
``codegen="triton"`` is an error (:class:`CodegenDeviceError`), not a silent
fallback: use ``codegen="inductor"`` (the default) for the fast CPU path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lpcompile.codegen.kernel import NAME_PLACEHOLDER, KernelSpec, code_key

STATS: Counter[str] = Counter()
_LOADED: dict[tuple[str, str, bool], Any] = {}  # (cache dir, code key, interpreted) -> kernel
GPU_BLOCK = 1024
# Elements per program of a kernel with reductions on a GPU: each program ends in atomic adds
# (a histogram's bins, a count), so fewer, larger programs contend less. 4096 was the best of
# 1024, 4096 and 16384 for both reduction patterns (benchmarks/results/codegen_cuda.md).
GPU_REDUCTION_BLOCK = 4096
MAX_INTERPRETED_BLOCK = 1 << 16
INT32_MIN = -(1 << 31)

DEVICE_POLICY = (
    "codegen='triton' runs generated Triton kernels: on CUDA tensors compiled, on CPU tensors in "
    "Triton's interpreter, which needs the environment variable TRITON_INTERPRET=1 (set before the "
    "graph is compiled). For CPU training use codegen='inductor' (the default): Inductor compiles the "
    "lowprec operators' reference decompositions to C++."
)


class CodegenDeviceError(RuntimeError):
    """A fused kernel was asked to run where the device policy does not allow it."""


def interpreting() -> bool:
    """Whether ``triton.jit`` currently makes interpreted functions (``TRITON_INTERPRET=1``)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def check_device(device: torch.device) -> None:
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return
    raise CodegenDeviceError(f"{DEVICE_POLICY} Got tensors on {device}.")


def cache_dir() -> Path:
    """Where kernel sources are written: ``$LOWPREC_CACHE`` or ``~/.cache/lpcompile/triton``."""
    root = os.environ.get("LOWPREC_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "lpcompile" / "triton"


# The counters compile_stats reports, zero until counted.
STAT_KEYS = ("jit", "memory_hits", "written", "disk_hits", "launches", "relayouts")


def compile_stats() -> dict[str, int]:
    """A copy of :data:`STATS`, every counter of :data:`STAT_KEYS` included."""
    return {key: STATS[key] for key in STAT_KEYS}


def clear_memory_cache() -> None:
    """Forget the imported kernels (the files stay): the next load reads them from disk."""
    _LOADED.clear()


def _write(path: Path, source: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(source)
    os.replace(tmp, path)


def load_kernel(spec: KernelSpec) -> Any:
    """The ``triton.jit`` function of ``spec``, from memory, the disk cache, or freshly written."""
    folder = cache_dir()
    slot = (str(folder), spec.key, interpreting())
    if slot in _LOADED:
        STATS["memory_hits"] += 1
        return _LOADED[slot]
    path = folder / f"{spec.name}.py"
    # the key hashes the code with the kernel's name left out (the name is made from the key)
    if path.exists() and code_key(path.read_text().replace(spec.name, NAME_PLACEHOLDER)) == spec.key:
        STATS["disk_hits"] += 1
    else:
        _write(path, spec.source)
        STATS["written"] += 1
    module_name = f"lpcompile_kernels.{spec.name}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # triton reads the source through the module
    module_spec.loader.exec_module(module)
    STATS["jit"] += 1
    _LOADED[slot] = getattr(module, spec.name)
    return _LOADED[slot]


def _block_size(device: torch.device, numel: int, reduces: bool) -> int:
    if device.type == "cuda":
        return GPU_REDUCTION_BLOCK if reduces else GPU_BLOCK
    # The interpreter pays a large fixed cost per program: few large blocks.
    block = 16
    while block < numel and block < MAX_INTERPRETED_BLOCK:
        block *= 2
    return block


class FusedKernel:
    """The callable a fused graph calls: allocates outputs, launches, finishes reductions."""

    __module__ = __name__

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self.__name__ = spec.name  # what the FX code calls it
        self.__qualname__ = spec.name
        self.fn = load_kernel(spec)

    def __repr__(self) -> str:
        return f"FusedKernel({self.spec.name}, nodes={self.spec.nodes})"

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        spec = self.spec
        if len(tensors) != len(spec.inputs):
            raise TypeError(f"{spec.name} takes {len(spec.inputs)} tensors, got {len(tensors)}")
        device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
        if device.type != spec.device.type:
            raise ValueError(f"{spec.name} was compiled for {spec.device.type} tensors, got {device} ones")
        check_device(device)
        args: list[Any] = []
        strides: list[int] = []
        for t, inp in zip(tensors, spec.inputs, strict=True):
            if t.device != device:
                # a GPU kernel may read 0-dim CPU tensors (the step's seed): copied to the device
                if t.device.type != "cpu" or t.dim():
                    raise ValueError(f"{spec.name}: {inp.name} is on {t.device}, the kernel on {device}")
                t = t.to(device, non_blocking=True)
            if inp.kind == "contiguous":
                if tuple(t.shape) != spec.shape:
                    raise ValueError(
                        f"{spec.name}: {inp.name} has shape {tuple(t.shape)}, expected {spec.shape}"
                    )
                if not t.is_contiguous():
                    STATS["relayouts"] += 1
                    t = t.contiguous()
            elif inp.kind == "strided":
                strides.extend(t.expand(spec.shape).stride())
            args.append(t)
        outs = [torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device=device) for o in spec.outputs]
        for o, out in zip(spec.outputs, outs, strict=True):
            if o.strided:
                strides.extend(out.stride())
        numel = spec.numel
        block = _block_size(device, numel, bool(spec.reductions))
        programs = -(-numel // block)
        buffers = []
        for red in spec.reductions:
            if red.kind == "sum_partials":
                buffers.append(torch.zeros(max(programs, 1), dtype=torch.float32, device=device))
            elif red.kind == "amax":
                buffers.append(torch.full((), INT32_MIN, dtype=torch.int32, device=device))
            elif red.kind == "histogram":
                buffers.append(torch.zeros(red.bins, dtype=torch.float32, device=device))
            else:
                buffers.append(torch.zeros((), dtype=torch.int64, device=device))
        if numel:
            scalars: list[int] = [numel]
            if spec.coords:
                scalars += list(spec.shape) + strides
            scalars += [value for _, value in spec.ints]
            # The interpreter computes with numpy, which warns about the inf/NaN that the
            # rounding and the statistics handle on purpose.
            quiet = np.errstate(all="ignore") if device.type == "cpu" else contextlib.nullcontext()
            grid = (programs,)
            with quiet:
                self.fn[grid](
                    *args,
                    *outs,
                    *buffers,
                    *scalars,
                    BLOCK_SIZE=block,
                    num_warps=min(16, max(4, block // 512)),  # Triton's default 4, 8 for 4096
                    enable_fp_fusion=False,
                )
            STATS["launches"] += 1
        results = []
        for red, buf in zip(spec.reductions, buffers, strict=True):
            if red.kind == "sum_partials":
                buf = buf.sum()
            elif red.kind == "amax":
                if not numel:
                    raise RuntimeError(f"{red.name}: amax of an empty tensor")
                buf = torch.where(buf >= 0, buf, buf ^ 0x7FFFFFFF).view(torch.float32)
            results.append(buf.to(red.dtype).reshape(red.shape))
        return (*outs, *results)
