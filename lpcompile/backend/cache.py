"""Inductor's cache keys for lowprec's compiles.

Inductor's and AOT autograd's caches key on the graph and on Inductor's config,
not on the Python of lowprec's decompositions, autograd rules and the passes that
run inside Inductor's compile. :class:`SourceStamp` puts a hash of those sources
into the key, so editing them never serves code compiled from the old ones.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

# The modules whose Python ends up in Inductor's compiled code: the operators and their
# decompositions, what they call, the function traced in place of small convolutions,
# the passes run inside Inductor's compile and the lists that order them.
TRACED_SOURCES = (
    "numerics/formats.py",
    "numerics/rng.py",
    "numerics/quantize.py",
    "numerics/scale_grad.py",
    "numerics/predict.py",
    "numerics/lowering.py",
    "kernels/cpu/gemm.py",
    "passes/dynamo/conv.py",
    "passes/joint/__init__.py",
    "passes/joint/masks.py",
    "passes/joint/matmul.py",
    "passes/joint/rowwise.py",
    "passes/aot/__init__.py",
    "passes/aot/layout.py",
    "passes/aot/histogram.py",
    "backend/compile.py",
)


def source_hash(package: Path) -> str:
    """Hash of :data:`TRACED_SOURCES` under ``package`` (the lpcompile folder)."""
    digest = hashlib.sha256()
    for name in TRACED_SOURCES:
        digest.update((package / name).read_bytes())
    return digest.hexdigest()


@functools.cache
def package_hash() -> str:
    return source_hash(Path(__file__).parents[1])


class SourceStamp(CustomGraphPass):
    """A post-grad pass that does nothing; its uuid hashes lpcompile's traced sources."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return package_hash()
