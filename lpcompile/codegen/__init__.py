"""Codegen: fuse lowprec nodes and their pointwise neighbours into generated Triton kernels.

Three layers, as in Inductor and tinygrad (docs/codegen.md):

* :mod:`~lpcompile.codegen.triton_ops`: the table op -> Triton expression, the
  bitwise rounding and the counter RNG rendered from ``lpcompile.numerics.rng``;
* :mod:`~lpcompile.codegen.fusion` and :mod:`~lpcompile.codegen.kernel`: fusion
  groups, and one tutorial-style kernel per group;
* :mod:`~lpcompile.codegen.launcher`: the on-disk cache, ``triton.jit``, the
  device policy and the callable the graph calls.

:func:`fuse_lowprec_kernels` is the graph pass the backend runs on the AOT
graphs when ``options={"codegen": "triton"}``.
"""

from lpcompile.codegen.graph_pass import KernelRecord, fuse_lowprec_kernels
from lpcompile.codegen.launcher import (
    STATS,
    CodegenDeviceError,
    cache_dir,
    clear_memory_cache,
    compile_stats,
    interpreting,
)

__all__ = [
    "STATS",
    "CodegenDeviceError",
    "KernelRecord",
    "cache_dir",
    "clear_memory_cache",
    "compile_stats",
    "fuse_lowprec_kernels",
    "interpreting",
]
