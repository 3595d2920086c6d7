"""Inductor's cache keys for lowprec's compiles.

Inductor's and AOT autograd's caches key on the graph and on Inductor's config,
not on the Python of lowprec's decompositions, autograd rules and the passes that
run inside Inductor's compile. :class:`SourceStamp` puts a hash of those sources
into the key, so editing them never serves code compiled from the old ones.

A compile that AOT autograd's cache serves runs none of those passes, so the warnings
the joint graph's passes gave are kept beside Inductor's cache
(:func:`save_joint_warnings`), for the backend to repeat on such a compile.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from lpcompile.numerics import source_digest

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
    return source_digest(package, TRACED_SOURCES)


@functools.cache
def package_hash() -> str:
    return source_hash(Path(__file__).parents[1])


class SourceStamp(CustomGraphPass):
    """A post-grad pass that does nothing; its uuid hashes lpcompile's traced sources, and
    says whether the graph is compiled :func:`without_donated_buffers` (Inductor's key
    holds no donated buffer: a backward that writes into them must not serve one that may
    run again)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        from torch._functorch._aot_autograd import graph_compile

        donating = graph_compile.collect_bw_donated_buffer_idxs is not _none_donated
        return package_hash() if donating else f"{package_hash()}-without-donated-buffers"


def _none_donated(*args: Any) -> list[int]:
    return []


@contextlib.contextmanager
def without_donated_buffers() -> Iterator[None]:
    """AOT autograd compiles backwards that donate no saved tensor's buffer (to their outputs
    and intermediates), so that ``backward(retain_graph=True)`` may run them at any call
    (AOT autograd refuses that for a backward compiled with donated buffers). Its
    ``collect_bw_donated_buffer_idxs`` finds none meanwhile, which also leaves nothing to
    ``saved_tensors_hooks_filtering_mode="donated"``."""
    from torch._functorch._aot_autograd import graph_compile

    donated = graph_compile.collect_bw_donated_buffer_idxs
    graph_compile.collect_bw_donated_buffer_idxs = _none_donated
    try:
        yield
    finally:
        graph_compile.collect_bw_donated_buffer_idxs = donated


# graph inputs whose value (not only type) goes into joint_warnings_key
_PLAIN_INPUTS = (bool, int, float, str, torch.SymInt, torch.SymFloat, torch.SymBool)


def joint_warnings_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], stamp: str) -> str | None:
    """A key of what decides the joint passes' warnings (finer than AOT autograd's cache key:
    a hit of that cache at other sizes finds none): the graph before them (its subgraphs'
    code too), its inputs' metadata (of other inputs their type, and their value where it is
    a number, a string or a symbol), the grad and autocast modes, and ``stamp`` (the joint
    passes' uuid and the graph's tag). ``None`` where an input has no such metadata (a
    sparse CSR tensor's strides)."""
    digest = hashlib.sha256(stamp.encode())
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            digest.update(module.code.encode())
    try:
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                meta = (type(x).__qualname__, x.shape, x.stride(), x.dtype, x.device.type, x.requires_grad)
            elif x is None or isinstance(x, _PLAIN_INPUTS):
                meta = (type(x).__qualname__, x)
            else:
                meta = (type(x).__qualname__,)
            digest.update(repr(meta).encode())
    except (RuntimeError, NotImplementedError):
        return None
    modes = [torch.is_grad_enabled()]
    for device in ("cpu", "cuda"):
        modes += [torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)]
    digest.update(repr(modes).encode())
    return digest.hexdigest()


def _joint_warnings_file(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "lowprec" / "joint-warnings" / f"{key}.json"


def save_joint_warnings(key: str, messages: Sequence[str]) -> None:
    """Keep ``messages`` under ``key``, replacing what was kept (none: remove it); a cache
    that cannot be written keeps nothing."""
    written: Path | None = None
    try:
        path = _joint_warnings_file(key)
        if not messages:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            written = Path(f.name)
            f.write(json.dumps(list(dict.fromkeys(messages))))
        os.replace(written, path)  # (whole: another process may read it meanwhile)
    except OSError:
        if written is not None:
            with contextlib.suppress(OSError):
                written.unlink(missing_ok=True)


def load_joint_warnings(key: str) -> list[str]:
    """The messages kept under ``key``; none if there are none, or they cannot be read."""
    try:
        return json.loads(_joint_warnings_file(key).read_text())
    except (OSError, ValueError):
        return []
