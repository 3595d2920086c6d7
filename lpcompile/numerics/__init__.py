"""Numerics: number formats, the counter-based RNG, the ``lowprec::`` operators with
their reference implementations, and how Inductor compiles them. Knows no graphs.

The operator modules (:mod:`.quantize`, :mod:`.scale_grad`, :mod:`.predict`) import
torch only. :mod:`.lowering` imports Inductor; :func:`register_when_inductor_loads`
imports it once Inductor itself is loaded, so ``import lpcompile`` stays cheap. It also
tags every Inductor cache key with a hash of these modules (:func:`tag_inductor_cache_keys`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType


def source_digest(folder: Path, names: Iterable[str]) -> str:
    """The SHA-256 of the files ``names`` under ``folder``, each with its name and length,
    in order (a cache key of the code compiled from them)."""
    digest = hashlib.sha256()
    for name in names:
        data = (folder / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def lowering_tag(folder: Path) -> str:
    """``lowprec-`` and a hash of the modules under ``folder`` (this package's), which
    define lowprec's operators and how Inductor lowers them."""
    return "lowprec-" + source_digest(folder, sorted(path.name for path in folder.glob("*.py")))[:16]


@functools.cache
def _own_lowering_tag() -> str:
    return lowering_tag(Path(__file__).parent)


def tag_inductor_cache_keys() -> None:
    """Append :func:`lowering_tag` to ``torch.compiler.config.cache_key_tag``
    (process-wide) unless it is there, so that Inductor's and AOT autograd's caches key
    every graph by the code that lowers lowprec's operators, whichever backend compiles it
    (a plain ``torch.compile`` of :func:`lpcompile.quantize` too)."""
    import torch.compiler.config

    tag = _own_lowering_tag()
    current = torch.compiler.config.cache_key_tag
    if tag not in current:
        torch.compiler.config.cache_key_tag = f"{current}-{tag}" if current else tag


# The Inductor module whose import brings lowprec's decompositions and lowerings in.
INDUCTOR_MODULE = "torch._inductor.compile_fx"


class _AfterInductor(importlib.abc.MetaPathFinder):
    """Imports :mod:`lpcompile.numerics.lowering` right after Inductor's compiler module."""

    def find_spec(self, name, path, target=None):
        if name != INDUCTOR_MODULE:
            return None
        sys.meta_path.remove(self)  # find the real spec, and never fire twice
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            importlib.import_module("lpcompile.numerics.lowering")

        spec.loader.exec_module = exec_then_register
        return spec


def register_when_inductor_loads() -> None:
    """Register lowprec's Inductor decompositions now if Inductor is loaded, else as soon
    as it is (before its first compile copies its decomposition table); tag the cache keys
    now (:func:`tag_inductor_cache_keys`: Dynamo's profile-guided shapes key on the tag
    too, before Inductor loads)."""
    tag_inductor_cache_keys()
    if INDUCTOR_MODULE in sys.modules:
        importlib.import_module("lpcompile.numerics.lowering")
    elif not any(isinstance(finder, _AfterInductor) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterInductor())
