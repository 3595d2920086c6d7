"""Numerics: number formats, the counter-based RNG, the ``lowprec::`` operators with
their reference implementations, and how Inductor compiles them. Knows no graphs.

The operator modules (:mod:`.quantize`, :mod:`.scale_grad`, :mod:`.predict`) import
torch only. :mod:`.lowering` imports Inductor; :func:`register_when_inductor_loads`
imports it once Inductor itself is loaded, so ``import lpcompile`` stays cheap.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType


def source_digest(folder: Path, names: Iterable[str]) -> str:
    """The SHA-256 of the files ``names`` under ``folder``, in order (a cache key of the
    code compiled from them)."""
    digest = hashlib.sha256()
    for name in names:
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()


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
    as it is (before its first compile copies its decomposition table)."""
    if INDUCTOR_MODULE in sys.modules:
        importlib.import_module("lpcompile.numerics.lowering")
    elif not any(isinstance(finder, _AfterInductor) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterInductor())
