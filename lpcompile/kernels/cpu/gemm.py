"""The AVX512-BF16 matmul kernel (``mm_bf16.c`` beside this module): built once, loaded with ctypes.

The kernel multiplies FP32 matrices whose values bfloat16 holds exactly (see
:func:`lpcompile.passes.joint.matmul.exact_in_bf16_products`) on the CPU's bfloat16
dot-product instructions, with FP32 accumulation. It is compiled once per
machine with GCC (``$CC`` if set, else ``gcc``) into Inductor's cache directory,
named by a hash of the source, the flags and the compiler command, so a changed
kernel is rebuilt. It runs on ``torch.get_num_threads()`` OpenMP threads of
GCC's runtime, ``libgomp.so.1``, the one torch's CPU build loads (a compiler
that links another OpenMP runtime, such as clang's ``libomp``, would start a
second thread pool). A failed build is reported once per process.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "mm_bf16.c"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")


def _cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "lowprec"


def _build(cc: list[str], rebuild: bool = False) -> Path:
    """The shared library for this source, flags and compiler; compiled if not cached (or
    ``rebuild``: a cached file that did not load)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((*cc, *FLAGS)).encode()).hexdigest()[:16]
    path = _cache_dir() / f"mm_bf16-{key}.so"
    if rebuild or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            subprocess.run([*cc, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True)
            os.replace(built, path)  # atomic: concurrent builders all leave a whole file
    return path


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded kernel, or why it cannot be used on this machine."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if not torch.cpu._is_avx512_bf16_supported():
        return "this CPU has no AVX512-BF16 instructions"
    cc = shlex.split(os.environ.get("CC", "")) or ([gcc] if (gcc := shutil.which("gcc")) else [])
    if not cc:
        return _off("no GCC found (set CC)")
    try:
        try:
            lib = ctypes.CDLL(str(_build(cc)))
        except OSError:  # a damaged cached file (e.g. empty after a crash): build it once more
            lib = ctypes.CDLL(str(_build(cc, rebuild=True)))
    except subprocess.CalledProcessError as err:
        stderr = err.stderr.decode(errors="replace")[-500:]
        return _off(f"{shlex.join(cc)} could not build {SOURCE.name}: {stderr}")
    except OSError as err:
        return _off(f"could not build or load {SOURCE.name} (in {_cache_dir()}): {err}")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.lp_bmm_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.lp_bmm_bf16.restype = ctypes.c_int
    return lib


def _off(why: str) -> str:
    """Say once (``_library`` is cached) that a machine that could run the kernel does not."""
    warnings.warn(f"lowprec: the bf16 matmul kernel is off, matmuls run as FP32 GEMMs: {why}", stacklevel=3)
    return why


def unavailable() -> str | None:
    """Why the kernel cannot run here, or ``None`` when it can."""
    lib = _library()
    return lib if isinstance(lib, str) else None


def check_operands(a: torch.Tensor, b: torch.Tensor, batched: bool = False) -> None:
    """``a @ b`` must be a product of two FP32 CPU matrices, or of two equal batches of them."""
    name, dims = ("bmm_bf16", "(B, M, K) @ (B, K, N)") if batched else ("mm_bf16", "(M, K) @ (K, N)")
    rank = 3 if batched else 2
    if a.dim() != rank or b.dim() != rank or a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"{name} multiplies {dims}, got {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"{name} takes float32 operands, got {a.dtype} and {b.dtype}")
    if a.device.type != "cpu" or b.device.type != "cpu":
        raise ValueError(f"{name} runs on the CPU, got {a.device} and {b.device}")


def _run(a: torch.Tensor, b: torch.Tensor, a_strides, b_strides, batch: int, m: int, k: int, n: int):
    """The kernel on ``batch`` products of (m, k) @ (k, n) with the given strides."""
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(f"lowprec's bf16 matmul kernel is unavailable: {lib}")
    out = torch.empty(batch, m, n, dtype=torch.float32)
    operands = (a.data_ptr(), *a_strides, b.data_ptr(), *b_strides)
    status = lib.lp_bmm_bf16(*operands, out.data_ptr(), batch, m, n, k, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"bf16 matmul: no memory to pack a {batch} x ({m}, {k}) @ ({k}, {n}) product")
    return out


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for batches of matrices, in FP32 from bfloat16 products: exact only
    for operands bfloat16 holds.

    Values bfloat16 does not hold are cut to their high 16 bits: the caller
    guarantees the operands (the lowprec pass only rewrites matmuls of quantized
    tensors).
    """
    check_operands(a, b, batched=True)
    (batch, m, k), n = a.shape, b.shape[2]
    return _run(a, b, a.stride(), b.stride(), batch, m, k, n)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for two matrices (see :func:`bmm`)."""
    check_operands(a, b)
    (m, k), n = a.shape, b.shape[1]
    return _run(a, b, (0, *a.stride()), (0, *b.stride()), 1, m, k, n).view(m, n)


# The operators, defined with the plain Library API rather than torch.library.custom_op:
# a call costs ~7 us less, which moves the size from which lpcompile.passes.joint.matmul
# gains by using them. They have no autograd: that pass adds them after autograd ran.
_LIBRARY = torch.library.Library("lowprec", "FRAGMENT")
_LIBRARY.define("mm_bf16(Tensor a, Tensor b) -> Tensor")
_LIBRARY.impl("mm_bf16", mm, "CPU")
_LIBRARY.define("bmm_bf16(Tensor a, Tensor b) -> Tensor")
_LIBRARY.impl("bmm_bf16", bmm, "CPU")


@torch.library.register_fake("lowprec::mm_bf16")
def _(a, b):
    check_operands(a, b)
    return a.new_empty(a.shape[0], b.shape[1])


@torch.library.register_fake("lowprec::bmm_bf16")
def _(a, b):
    check_operands(a, b, batched=True)
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2])
