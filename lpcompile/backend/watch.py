"""Modules no lowprec graph covers, named once.

Products that torch.compile never traces run in FP32, and lowprec's backend, never called
for them, cannot quantize them: a module left out when compiling per block (torchtitan
compiles only the blocks), one called through a ``torch._dynamo.disable``-d function, or
products a ``forward`` computes itself when Dynamo gives up on that frame (a graph break
inside its loop over blocks). When a graph compiles, the backend finds the outermost
module on the Python stack (the model being run, or its DDP or FSDP2 wrapper) and keeps
one :class:`CoverageWatch` for it: the graphs' calls record the parameters they read
until that module's forward ends (the first forward whose call starts with the watch's
hook in place), and then one warning names every module with parameters none of those
calls read.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lpcompile.backend.distributed import computes_products, unsharded_parameters, wrapper_kind

# Modules a warning names (the others are counted).
LISTED = 12


def outermost_module() -> torch.nn.Module | None:
    """The outermost module whose call is on the Python stack, or None."""
    found = None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(owner, torch.nn.Module):
            found = owner
        frame = frame.f_back
    return found


def user_model(root: torch.nn.Module) -> torch.nn.Module:
    """The module ``root`` wraps: through DDP's ``module`` and torch.compile's ``_orig_mod``."""
    while True:
        if wrapper_kind(root) == "DDP":
            root = root.module
        elif isinstance(root, torch._dynamo.eval_frame.OptimizedModule):
            root = root._orig_mod
        else:
            return root


def unread_modules(root: torch.nn.Module, read: set[int]) -> list[tuple[str, torch.nn.Module, list[str]]]:
    """(name, module, its parameters' names) of each module under ``root`` that
    :func:`~lpcompile.backend.distributed.computes_products` with parameters of two or more
    dimensions none of which is in ``read`` (ids of the parameters lowprec's graphs read;
    under FSDP2 the unsharded ones)."""
    unsharded = unsharded_parameters(root)
    found = []
    for name, module in user_model(root).named_modules():
        if not computes_products(module):
            continue
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() >= 2]
        if not any(id(p) in read or id(unsharded.get((id(module), n))) in read for n, p in own):
            found.append((name, module, [n for n, _ in own]))
    return found


class CoverageWatch:
    """The parameters lowprec's graphs read in the first forward of ``root``. At the end of
    that forward (hooks run only on a call that starts with one registered: where the
    root's call began with none, as under DDP, that is the second forward) it warns once,
    naming the modules no graph read (:func:`unread_modules`). Parameters are taken from
    the graphs' calls, not their compiles: Dynamo reuses one block's graph for the
    identical blocks after it."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.read: set[int] = set()
        self._handle: Any = root.register_forward_hook(self._check)

    def watched(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """``run``, a compiled graph, recording the parameters it is called with while the
        watch lasts."""

        def call(*args: Any) -> Any:
            if self._handle is not None:
                self.read.update(id(a) for a in args if isinstance(a, torch.nn.Parameter))
            return run(*args)

        return call

    def _check(self, root: torch.nn.Module, args: Any, output: Any) -> None:
        self._handle.remove()
        self._handle = None
        missed = unread_modules(root, self.read)
        self.read.clear()  # done: the ids of parameters freed later may be reused
        if not missed:
            return
        listed = ", ".join(
            f"{name or '(the root)'} ({type(module).__name__}: {', '.join(params)})"
            for name, module, params in missed[:LISTED]
        ) + (f" and {len(missed) - LISTED} more" if len(missed) > LISTED else "")
        kind = wrapper_kind(root)
        warnings.warn(
            f"lowprec: no lowprec graph read the parameters of {listed} while "
            f"{type(user_model(root)).__name__} ran{f' under {kind}' if kind else ''}: any products "
            "they compute ran in FP32. torch.compile never traced them: a module left out of the "
            "compiled ones, called through torch._dynamo.disable, or a forward Dynamo gave up on "
            "(a graph break inside a loop over blocks) computing products itself. Compile those "
            "modules with lowprec too, or put such products in modules of their own (an nn.Linear)",
            stacklevel=2,
        )
