"""Modules no lowprec graph covers, named once.

Products that torch.compile never traces run in FP32, and lowprec's backend, never called
for them, cannot quantize them: a module left out when compiling per block (torchtitan
compiles only the blocks), one called through a ``torch._dynamo.disable``-d function, or
products a ``forward`` computes itself when Dynamo gives up on that frame (a graph break
inside its loop over blocks). When a graph compiles, the backend finds the outermost
module call on the Python stack (the model being run, ``torch.compile``'s wrapper of it,
or its DDP or FSDP2 wrapper) and starts one :class:`CoverageWatch` for it. Every lowprec
graph called while a watch is active records the parameters it reads into it (Dynamo runs
one compiled graph for identical blocks, and for identical models). At the end of that
module's forward (the first whose call starts with the watch's hook in place), one
warning names every module with parameters none of those calls read, and another the
sparse tensors the forward was called with or its modules hold: Dynamo does not trace
them, so their products run uncompiled. A third names the ``exclude`` patterns that
matched no layer of any graph compiled meanwhile (each graph break is a graph of its
own), with each graph's layers.

Dynamo also runs a frame it compiled before uncompiled, unrounded, once that code has been
compiled ``torch._dynamo.config.recompile_limit`` times: each new input shape and each
``torch.compile`` with other options (a sweep over recipes in one process) compiles it
anew. :func:`watch_frame_compiles` makes Dynamo's check warn, naming the model, where
that frame was compiled for lowprec; the same check, which Dynamo runs as it begins each
frame's compile, starts the watch of a model whose frames compile to no graph.

Another backend's torch.compile whose trace calls a model or function compiled with lowprec
would trace through lowprec's compile, unrounded. While another backend compiles a frame,
torch.compile's wrappers made for lowprec are marked as ``torch.compiler.disable`` marks a
function (:func:`set_apart`): Dynamo breaks that graph at the call, and lowprec's compile
runs it. Given a model compiled with lowprec itself, torch.compile compiles what it wraps:
:func:`compiled_over_warning` names it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._dynamo import convert_frame
from torch._dynamo.eval_frame import OptimizedModule
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.hooks import RemovableHandle

from lpcompile.backend.distributed import (
    calling_selves,
    innermost_backend,
    is_lowprec_backend,
    product_parameters,
    traces_through_lowprec,
    unsharded_parameters,
    wrapper_kind,
)
from lpcompile.passes.dynamo.attention import MULTIHEAD_CALLS

# Modules a warning names (the others are counted).
LISTED = 12
# Layouts Dynamo does not trace (a nested tensor's ``torch.jagged`` it does).
SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
# Where torch's and lpcompile's own frames come from.
INTERNAL = tuple(os.path.dirname(path) + os.sep for path in (torch.__file__, os.path.dirname(__file__)))
# Where Dynamo's own code lives (torch.compile's wrapper of a module's call among it)
DYNAMO_DIR = os.path.dirname(torch._dynamo.__file__) + os.sep
# Why a torch.compile that calls a model or function compiled with lowprec breaks its graph there
RUN_APART = (
    "compiled with lowprec: a torch.compile that calls it runs it apart, with a graph break, so that"
    " lowprec's graph rounds its products; compile the whole with lowprec to keep one graph"
)
# The code of ``torch.autograd.Function.apply``: a frame of it on the stack runs a Function uncompiled.
FUNCTION_APPLY = torch.autograd.Function.apply.__func__.__code__


def outermost_module() -> torch.nn.Module | None:
    """The module of the outermost module call on the Python stack, or None: a
    ``Module._call_impl``, or for a module compiled in place (``module.compile()``), whose
    ``_call_impl`` Dynamo runs, the ``Module._wrapped_call_impl`` that calls it."""
    found = None
    for frame, owner in calling_selves(sys._getframe(1), depth=None):
        if frame.f_code is torch.nn.Module._call_impl.__code__ and owner._compiled_call_impl is None:
            found = owner
        elif frame.f_code is torch.nn.Module._wrapped_call_impl.__code__ and owner._compiled_call_impl:
            found = owner
    return found


def compiled_module() -> torch.nn.Module | None:
    """The innermost module torch.compile wraps on the Python stack (``torch.compile(model)``,
    ``model.compile()``, or a method of it: ``torch.compile(model.forward)``), inside DDP's
    wrapper, or None (a compiled function)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename == torch._dynamo.eval_frame.__file__:
            method = frame.f_locals.get("fn")  # what torch.compile was given
            if isinstance(method, types.MethodType) and isinstance(method.__self__, torch.nn.Module):
                return unwrapped(method.__self__)[0]
        elif "self" in code.co_varnames:
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch._dynamo.eval_frame.OptimizedModule):
                return unwrapped(owner)[0]
            if code is torch.nn.Module._wrapped_call_impl.__code__ and owner._compiled_call_impl:
                return unwrapped(owner)[0]
        frame = frame.f_back
    return None


def warn_in_eager_function() -> None:
    """Warn, naming it, when a graph compiles inside the ``forward`` of a
    ``torch.autograd.Function`` that Dynamo runs uncompiled (it could not trace its
    backward): the graph's products are rounded, but the Function's backward runs eagerly,
    and a product it computes (a recomputation, as in reversible layers) in higher precision."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not FUNCTION_APPLY:
        frame = frame.f_back
    if frame is not None and isinstance(function := frame.f_locals.get("cls"), type):
        warnings.warn(
            f"lowprec: {function.__qualname__} is a torch.autograd.Function Dynamo runs uncompiled: the"
            " layers its forward calls are rounded, but its backward runs eagerly, and any product it"
            " computes stays in higher precision (torch.utils.checkpoint recomputes in FP8)",
            stacklevel=caller_level(),
        )


def module_name(name: str) -> str:
    """``name`` from ``named_modules()`` without torch.compile's ``_orig_mod`` steps."""
    return ".".join(step for step in name.split(".") if step != "_orig_mod")


def unwrapped(root: torch.nn.Module) -> tuple[torch.nn.Module, str | None]:
    """The user's model inside ``root`` (through torch.compile's ``_orig_mod`` and DDP's
    ``module``), and the kind of data-parallel wrapper found on the way, if any."""
    kind = None
    while True:
        if isinstance(root, torch._dynamo.eval_frame.OptimizedModule):
            root = root._orig_mod
        elif (found := wrapper_kind(root)) == "DDP":
            kind, root = found, root.module
        else:
            return root, kind or found


def instance_of(
    param: torch.Tensor, relative: str | None, root: torch.nn.Module | None = None
) -> tuple[str, torch.nn.Module | None]:
    """The module whose graph's frame reads ``param`` as ``relative`` (its FQN from that
    frame's ``self``), and that module's FQN in ``root`` (by default the outermost module
    running that holds ``param``: :func:`running_holder`); ("", None) where it is ``root``
    itself, or where none holds ``param`` so.
    Blocks compiled one by one run one graph, their parameters its inputs: this tells them
    apart. Where ``param`` is tied across modules that each read it as ``relative`` (the
    embedding of an encoder's and a decoder's stack), the innermost of them running on the
    Python stack is the one (without one running, or with ``root`` given, the first)."""
    if relative is None:
        return "", None
    running = root is None
    root = running_holder(param) if root is None else root
    if root is None:
        return "", None
    root = unwrapped(root)[0]
    modules = dict(root.named_modules(remove_duplicate=False))
    names = [name for name, p in root.named_parameters(remove_duplicate=False) if p is param]
    names += [
        f"{name}.{attr}" if name else attr
        for (owner, attr), p in unsharded_parameters(root).items()
        if p is param
        for name, module in modules.items()
        if id(module) == owner
    ]
    paths = [
        path.removesuffix(relative).removesuffix(".")
        for path in map(module_name, names)
        if path == relative or path.endswith("." + relative)
    ]
    held = {}  # each path's module, by identity
    for path in paths:
        module = root if not path else next(m for n, m in modules.items() if module_name(n) == path)
        held.setdefault(id(unwrapped(module)[0]), path)
    path = next((p for p in paths if p), "")
    if len(held) > 1 and running:
        on_stack = (held.get(id(unwrapped(owner)[0])) for owner in module_selves(sys._getframe(1)))
        path = next((p for p in on_stack if p is not None), path)
    if not path:
        return "", None
    found = next(m for n, m in modules.items() if module_name(n) == path)  # its parameter's
    return path, unwrapped(found)[0]


def running_holder(param: torch.Tensor) -> torch.nn.Module | None:
    """The outermost module on the Python stack that holds ``param`` (or FSDP2's unsharded
    stand-in for it), unwrapped: a teacher's blocks run inside a student that does not hold
    them are its own; None without one."""
    found = None
    for owner in module_selves(sys._getframe(1)):
        module = unwrapped(owner)[0]
        if "_parameters" not in vars(module):  # (in its __init__, before Module's)
            continue
        held = [*module.parameters(), *unsharded_parameters(module).values()]
        if any(p is param for p in held):
            found = module
    return found


def module_selves(frame: types.FrameType) -> Iterator[torch.nn.Module]:
    """The modules that are ``self`` of ``frame`` and of its callers, innermost first."""
    for _, owner in calling_selves(frame, depth=None):
        if isinstance(owner, torch.nn.Module):
            yield owner


def names_in_model(root: torch.nn.Module, pattern: str) -> bool:
    """Whether the ``exclude`` pattern ``pattern`` (its part before a ``#i``) names a module
    or parameter of the model in ``root`` (without ``_orig_mod``), from the model or from a
    module of it (layer names start at a graph's frame), or a call of
    ``nn.MultiheadAttention`` (``attn.in_proj_q``)."""
    model = unwrapped(root)[0]
    names = [module_name(n) for n, _ in model.named_parameters(remove_duplicate=False)]
    for name, module in model.named_modules(remove_duplicate=False):
        names.append(module_name(name))
        if isinstance(module, torch.nn.MultiheadAttention):  # its calls' names
            names += [f"{module_name(name)}.{call}" for call in MULTIHEAD_CALLS]
    stem = pattern.split("#")[0]
    return any(fnmatch.fnmatchcase(name, stem) or fnmatch.fnmatchcase(name, "*." + stem) for name in names)


def unread_modules(root: torch.nn.Module, read: set[int]) -> list[tuple[str, torch.nn.Module, list[str]]]:
    """(name, module, its parameters' names) of each module under ``root`` with
    :func:`~lpcompile.backend.distributed.product_parameters` none of which is in ``read``
    (ids of the parameters lowprec's graphs read; under FSDP2 the unsharded ones)."""
    unsharded = unsharded_parameters(root)
    found = []
    for name, module in unwrapped(root)[0].named_modules():
        names = product_parameters(module)
        own = dict(module.named_parameters(recurse=False))
        # the registered parameter, and under FSDP2 the unsharded one swapped in for it
        versions = [own[n] for n in names] + [
            unsharded[key] for n in names if (key := (id(module), n)) in unsharded
        ]
        if names and not any(id(p) in read for p in versions):
            found.append((name, module, names))
    return found


def sparse_tensors(root: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> list[str]:
    """Where ``root``'s forward met a sparse tensor: among its arguments (by position or
    keyword), and the tensors its modules hold (parameters, buffers, plain attributes)."""
    found = [
        f"argument {key} ({value.layout})"
        for key, arg in [*enumerate(args), *kwargs.items()]
        for value in torch.utils._pytree.tree_leaves(arg)
        if isinstance(value, torch.Tensor) and value.layout in SPARSE_LAYOUTS
    ]
    for name, module in unwrapped(root)[0].named_modules():
        prefix = f"{module_name(name)}." if name else ""
        for kind, held in (
            ("parameter", module._parameters),
            ("buffer", module._buffers),
            ("attribute", vars(module)),
        ):
            found += [
                f"{kind} {prefix}{attr} ({value.layout})"
                for attr, value in held.items()
                if isinstance(value, torch.Tensor) and value.layout in SPARSE_LAYOUTS
            ]
    return found


def caller_level() -> int:
    """The ``stacklevel`` that makes the caller's warning point at the first frame outside
    torch and lpcompile (the user's ``model(x)``)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


class CoverageWatch:
    """The parameters lowprec's graphs read until the end of ``root``'s next forward (hooks
    run only on a call that starts with one registered: where the root's call began with
    none, as ``torch.compile``'s wrapper and DDP's, that is the second forward). Then it
    warns once, naming the modules no graph read (:func:`unread_modules`) there, nor while
    a submodule watched as a root of its own ran (compiled apart, and called apart: the
    encoder HF's ``generate`` calls before the model's ``forward``).

    A root compiled in place (``root.compile()``) gets no hook, which Dynamo would trace
    into its graph; its compiled call is wrapped instead, until that check."""

    def __init__(
        self,
        root: torch.nn.Module,
        active: weakref.WeakSet[CoverageWatch],
        roots: weakref.WeakKeyDictionary[torch.nn.Module, CoverageWatch],
    ) -> None:
        self.read: set[int] = set()
        # the root's parameters that were read, by id, kept at the check (while they live)
        self.covered: dict[int, weakref.ref] = {}
        self._roots = roots  # every watched root: a submodule among them has a watch of its own
        # exclude patterns that matched a layer of one of the root's graphs, those warned
        # about, and those each graph compiled while the watch is active matched none of
        # (with the graph in words)
        self.matched_excludes: set[str] = set()
        self.warned_excludes: set[str] = set()
        self.unmatched_excludes: list[tuple[list[str], str]] = []
        self._active = active
        active.add(self)
        # a function, not the bound method: deepcopy of the root shares it instead of
        # copying the watch; disabled, so that Dynamo never traces it into a graph
        check = torch._dynamo.disable(self.check)
        self._handle: RemovableHandle | None = None
        if (compiled := root._compiled_call_impl) is None:
            self._handle = root.register_forward_hook(check, with_kwargs=True)
            return

        def call(*args: Any, **kwargs: Any) -> Any:
            output = compiled(*args, **kwargs)
            if root._compiled_call_impl is call:
                root._compiled_call_impl = compiled
            check(root, args, kwargs, output)
            return output

        root._compiled_call_impl = call

    def seen(self) -> set[int]:
        """The ids of the parameters lowprec's graphs read while this watch was active."""
        return self.read | {i for i, p in self.covered.items() if p() is not None}

    def check(self, root: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        """End the watch (at the end of ``root``'s forward, called with ``args`` and
        ``kwargs``): warn about the modules of ``root`` no graph read, and about the sparse
        tensors it ran with."""
        if self not in self._active:
            return
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._active.discard(self)
        model = unwrapped(root)[0]
        inner = [
            watch
            for r, watch in list(self._roots.items())
            if (sub := unwrapped(r)[0]) is not model and any(m is sub for m in model.modules())
        ]
        missed = unread_modules(root, self.read.union(*(watch.seen() for watch in inner)))
        params = [*model.parameters(), *unsharded_parameters(root).values()]
        self.covered.update((id(p), weakref.ref(p)) for p in params if id(p) in self.read)
        self.read.clear()  # the ids of parameters freed later may be reused
        unused = {p for patterns, _ in self.unmatched_excludes for p in patterns}
        unused -= self.matched_excludes | self.warned_excludes
        self.warned_excludes |= unused
        if unused:
            graphs = dict.fromkeys(g for patterns, g in self.unmatched_excludes if unused & set(patterns))
            warnings.warn(
                f"lowprec: exclude patterns {sorted(unused)} match no layer of the graphs of "
                f"{type(unwrapped(root)[0]).__name__}: {'; '.join(graphs)}",
                stacklevel=caller_level(),
            )
        self.unmatched_excludes.clear()
        if sparse := sparse_tensors(root, args, kwargs):
            model, _ = unwrapped(root)
            warnings.warn(
                f"lowprec: {type(model).__name__} ran with sparse tensors ({', '.join(sparse)}): Dynamo "
                "does not trace sparse tensors, so code that uses them runs uncompiled, its "
                "products with them (torch.sparse.mm, @) in FP32. Pass or keep a dense tensor "
                "(.to_dense()) for lowprec to round those products",
                stacklevel=caller_level(),
            )
        if not missed:
            return
        listed = ", ".join(
            f"{module_name(name) or '(the root)'} ({type(module).__name__}: {', '.join(params)})"
            for name, module, params in missed[:LISTED]
        ) + (f" and {len(missed) - LISTED} more" if len(missed) > LISTED else "")
        model, kind = unwrapped(root)
        warnings.warn(
            f"lowprec: no lowprec graph read the parameters of {listed} while "
            f"{type(model).__name__} ran{f' under {kind}' if kind else ''}: they were not called, "
            "or ran outside lowprec's graphs, their products in FP32. torch.compile never traced "
            "them: a module left out of the compiled ones, called through torch._dynamo.disable, "
            "or a forward Dynamo gave up on (a graph break inside a loop over blocks) computing "
            "products itself. Compile those modules with lowprec too, or put such products in "
            "modules of their own (an nn.Linear)",
            stacklevel=caller_level(),
        )


class CoverageWatches:
    """The coverage watches of this process: one per root module, and those still active;
    and torch.compile's wrappers of what was compiled for lowprec, marked to run apart
    from another backend's compile (:func:`set_apart`)."""

    def __init__(self) -> None:
        self._by_root: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # weak: the watch of a root that died before its hook ran does not stay active
        self._active: weakref.WeakSet[CoverageWatch] = weakref.WeakSet()
        # code that went past Dynamo's recompile limit -> weak references to its backends then
        self._past_limit: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._apart: weakref.WeakSet[types.FunctionType] = weakref.WeakSet()

    def run_apart(self, compiled: Any) -> None:
        """Have ``compiled``, what torch.compile returned for lowprec (its wrapper of a module
        or function), run apart from the compiles of other backends that call it."""
        wrapper = compiled.forward if isinstance(compiled, OptimizedModule) else compiled
        if isinstance(wrapper, types.FunctionType):  # (a lazy module's forward is a method)
            self._apart.add(wrapper)

    @contextlib.contextmanager
    def compiling(self, compiler_fn: Any) -> Iterator[None]:
        """Around Dynamo's compile of a frame with ``compiler_fn``: what was compiled for
        lowprec is marked to run apart (:func:`set_apart`) unless ``compiler_fn`` traces
        through it (lowprec's own, with its own options, as Dynamo does), and unmarked
        afterwards: at rest, as torch.compile made it (what a graph's guards read, what a
        ``functools.wraps`` copies, what ``torch.export`` traces through). A lowprec compile
        inside another backend's (its backend calling lowprec's model) leaves the marks set:
        lowprec's code that runs meanwhile reads the wrappers as marked."""
        if compiler_fn is None or traces_through_lowprec(compiler_fn):
            yield
            return
        marked = [wrapper for wrapper in self._apart if not is_apart(wrapper)]
        for wrapper in marked:
            set_apart(wrapper, True)
        try:
            yield
        finally:
            for wrapper in marked:
                set_apart(wrapper, False)

    def start(self, root: torch.nn.Module) -> None:
        """Watch ``root``'s next forward, unless it has been watched already."""
        if root not in self._by_root:
            self._by_root[root] = CoverageWatch(root, self._active, self._by_root)

    def warn_unmatched_excludes(
        self, root: torch.nn.Module | None, patterns: tuple[str, ...], unused: list[str], graph: str
    ) -> None:
        """Warn about the ``exclude`` ``patterns`` that match no layer of a graph (``unused``
        of them; ``graph``: it in words) compiled while ``root`` runs, once each, unless a
        graph of ``root`` matched them. A pattern that names a module or parameter of
        ``root`` may match a layer of a graph still to compile (after a graph break): while
        the watch of ``root``'s forward is active, it waits for the watch's end. Any other
        warns now (a typo)."""
        watch = self._by_root.get(root) if root is not None else None
        if watch is not None:
            watch.matched_excludes |= set(patterns) - set(unused)
            unused = [p for p in unused if p not in watch.matched_excludes | watch.warned_excludes]
            if watch in self._active:
                later = [p for p in unused if names_in_model(root, p)]
                if later:
                    watch.unmatched_excludes.append((later, graph))
                unused = [p for p in unused if p not in later]
            watch.warned_excludes |= set(unused)
        if unused:
            warnings.warn(
                f"lowprec: exclude patterns {unused} match no layer of {graph}", stacklevel=caller_level()
            )

    def recording(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """``run``, a compiled graph, recording the tensors it is called with into the active
        watches: its parameters, and the tensors ``torch.func.functional_call`` puts in their
        place while it runs."""
        active = self._active

        def call(*args: Any) -> Any:
            if active:
                ids = {id(a) for a in args if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor)}
                for watch in active:
                    watch.read |= ids
            return run(*args)

        return call

    def start_compiling(self, compiling: types.FrameType) -> None:
        """Watch the outermost module running where Dynamo, in ``compiling`` (its frame of
        ``_compile``), compiles a frame for lowprec."""
        compiler_fn = compiling.f_locals.get("compiler_fn")
        if compiler_fn is not None and is_lowprec_backend(compiler_fn):
            if (root := outermost_module()) is not None:
                self.start(root)

    def warn_past_limit(self, compiling: types.FrameType, limit_type: str) -> None:
        """Warn where Dynamo, in ``compiling`` (its frame of ``_compile``), hit its
        ``limit_type`` for a frame compiled for lowprec, which it then runs uncompiled; once
        per backend and code (a new torch.compile after ``torch._dynamo.reset()`` may hit
        it again)."""
        found = compiling.f_locals
        code, compiler_fn = found.get("code"), found.get("compiler_fn")
        if not isinstance(code, types.CodeType) or compiler_fn is None or not is_lowprec_backend(compiler_fn):
            return
        if found.get("one_graph") or torch._dynamo.config.fail_on_recompile_limit_hit:
            return  # Dynamo raises instead
        backend = innermost_backend(compiler_fn)
        backends = self._past_limit.setdefault(code, [])
        if any(seen() is backend for seen in backends):
            return
        backends.append(weakref.ref(backend))
        # the frame Dynamo compiles: a module's forward, or torch.compile's wrapper of its call
        owner = getattr(found.get("frame"), "f_locals", {}).get("self")
        model = None
        if isinstance(owner, torch.nn.Module) and getattr(type(owner).forward, "__code__", None) is code:
            model = owner
        elif code.co_filename.startswith(DYNAMO_DIR):
            model = compiled_module()
        what, where = code.co_qualname, code
        if model is not None:
            what = f"{type(model).__name__}'s forward"
            where = getattr(type(model).forward, "__code__", code)
        options = getattr(backend, "kwargs", {}).get("options")  # torch.compile's wrapper's
        warnings.warn(
            f"lowprec: Dynamo hit torch._dynamo.config.{limit_type} "
            f"({getattr(torch._dynamo.config, limit_type)}) compiling {what} "
            f"({where.co_filename}:{where.co_firstlineno}) for lowprec"
            f"{f' with options={options}' if options else ''}: until torch._dynamo.reset(), it runs"
            " this call, and each later one that none of the graphs it keeps fits (every later"
            " torch.compile of that code too), uncompiled, its products in the model's own precision."
            " Each torch.compile of that code with other options (a sweep over recipes in one"
            " process) and each new input shape counts against the limit. Call"
            f" torch._dynamo.reset() between the runs of a sweep, raise torch._dynamo.config.{limit_type},"
            " or set torch._dynamo.config.fail_on_recompile_limit_hit = True to make this an error;"
            ' TORCH_LOGS="recompiles" lists why it recompiled',
            stacklevel=caller_level(),
        )


def compiled_with_lowprec(compiled: Any, depth: int = 1) -> bool:
    """Whether ``compiled`` is torch.compile's wrapper of a module or function compiled with
    lowprec, or a module compiled with lowprec in place (``module.compile(backend="lowprec")``),
    whose compiled call is looked into two closures deep (a coverage watch wraps it for a
    forward)."""
    if isinstance(compiled, OptimizedModule):
        return is_lowprec_backend(compiled.dynamo_ctx.callback)
    if isinstance(compiled, torch.nn.Module):
        return compiled_with_lowprec(compiled._compiled_call_impl, depth=2)
    for cell in getattr(compiled, "__closure__", None) or ():  # (torch.compile's wrapper's)
        try:
            value = cell.cell_contents
        except ValueError:  # (a cell not yet filled)
            continue
        if isinstance(value, torch._dynamo.eval_frame._TorchDynamoContext):
            return is_lowprec_backend(value.callback)
        if depth > 1 and isinstance(value, types.FunctionType) and compiled_with_lowprec(value, depth - 1):
            return True
    return False


def _has_hooks(module: torch.nn.Module) -> bool:
    """Whether Dynamo calls ``module`` through its ``__call__`` (which calls a compiled call),
    not its ``forward``: it has hooks, or the process global ones."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(module, kind) for kind in kinds) or torch.nn.modules.module._has_any_global_hook()


def _traced_in_place(module: torch.nn.Module, path: str = "") -> Iterator[str]:
    """The FQNs of the modules inside ``module`` compiled with lowprec in place that a
    compile of ``module`` with another backend traces into its graph (Dynamo calls their
    ``forward``, not their compiled call, where they have no hooks), but not those inside
    a module that runs apart (:func:`set_apart`)."""
    for name, child in module.named_children():
        fqn = f"{path}.{name}" if path else name
        if isinstance(child, OptimizedModule):
            if not compiled_with_lowprec(child):
                yield from _traced_in_place(child._orig_mod, fqn)
        elif child._compiled_call_impl is not None and compiled_with_lowprec(child):
            if not _has_hooks(child):  # (with hooks, Dynamo calls its compiled call: it runs apart)
                yield fqn
        else:
            yield from _traced_in_place(child, fqn)


def compiled_over_warning(context: Any, fn: Any) -> str | None:
    """The warning where torch.compile's ``context`` (another backend's) compiles ``fn``, a
    module or function compiled with lowprec, or a module holding modules compiled with
    lowprec in place that Dynamo will trace through; or None."""
    if is_lowprec_backend(context.callback):
        return None
    if compiled_with_lowprec(fn):
        if isinstance(fn, OptimizedModule):
            name = type(fn._orig_mod).__name__
        elif isinstance(fn, torch.nn.Module):
            name = type(fn).__name__
        else:
            name = f"function {torch._dynamo.eval_frame.innermost_fn(fn).__qualname__}"
        return (
            f"lowprec: {name}, compiled with lowprec, is compiled again by a torch.compile with another"
            " backend: Dynamo traces through lowprec's compile, which never runs, and the model's"
            " products run unrounded, in its own precision. Compile the model once, with lowprec"
        )
    if getattr(fn, "__func__", None) is torch.nn.Module._wrapped_call_impl:
        return None  # (torch.compile's wrapper compiling the call of the module it was given)
    model = getattr(fn, "__self__", fn)  # (a method of the model: module.compile(), its forward)
    model = model._orig_mod if isinstance(model, OptimizedModule) else model
    if not isinstance(model, torch.nn.Module):
        return None
    inside = list(_traced_in_place(model))
    if not inside:
        return None
    more = f" and {len(inside) - LISTED} more" if len(inside) > LISTED else ""
    return (
        f"lowprec: {type(model).__name__} holds {', '.join(inside[:LISTED])}{more}, compiled with lowprec"
        " in place (module.compile(backend='lowprec')), and a torch.compile with another backend compiles it:"
        " Dynamo traces their forward into its own graph, and lowprec never runs, their products"
        " unrounded. Register torch.compile(module, backend='lowprec') in their place instead (another"
        " compile calls it apart, with a graph break), or compile the whole model with lowprec"
    )


def is_apart(wrapper: types.FunctionType) -> bool:
    """Whether ``wrapper`` is marked by :func:`set_apart`."""
    return wrapper.__dict__.get("_torchdynamo_disable_msg") is RUN_APART


def set_apart(wrapper: types.FunctionType, apart: bool) -> None:
    """Mark torch.compile's ``wrapper`` of a module or function compiled with lowprec to run
    apart from a compile whose trace calls it (``apart``), as a ``torch.compiler.disable``-d
    function: Dynamo breaks its graph there and calls it, and lowprec's graph rounds its
    products (a ``fullgraph`` compile raises, with :data:`RUN_APART` as the reason);
    otherwise to be traced through, as Dynamo does by default."""
    found = wrapper.__dict__
    if apart:
        found.update(_torchdynamo_disable=True, _torchdynamo_disable_msg=RUN_APART)
        if "_torchdynamo_inline" in found:  # (Dynamo traces the function it names)
            found["lowprec_inline"] = found.pop("_torchdynamo_inline")
    else:
        found.pop("_torchdynamo_disable", None)
        found.pop("_torchdynamo_disable_msg", None)
        if "lowprec_inline" in found:
            found["_torchdynamo_inline"] = found.pop("lowprec_inline")


def watch_torch_compile(watches: CoverageWatches) -> None:
    """Make torch.compile record what it compiles for lowprec to run apart from the compiles
    of other backends that call it (``watches.run_apart``), and warn
    (:func:`compiled_over_warning`) where another backend is given a module or function
    compiled with lowprec, or a model holding blocks compiled in place, which Dynamo
    compiles through lowprec's compile, which never runs."""
    context = torch._dynamo.eval_frame.OptimizeContext
    if hasattr(context.__call__, "lowprec_original"):
        return
    original = context.__call__

    def __call__(self: Any, fn: Any) -> Any:
        message = None
        with contextlib.suppress(Exception):  # (lowprec's check must never break torch.compile)
            message = compiled_over_warning(self, fn)
        if message is not None:
            warnings.warn(message, stacklevel=caller_level())
        compiled = original(self, fn)
        if is_lowprec_backend(self.callback):
            watches.run_apart(compiled)
        return compiled

    __call__.lowprec_original = original
    context.__call__ = __call__


def watch_frame_compiles(watches: CoverageWatches) -> None:
    """Make Dynamo's recompile-limit check, which it runs as it begins compiling each frame,
    start a coverage watch for the outermost module running where that frame compiles for
    lowprec (a model whose frames all compile to no graph, its forward only a
    ``torch.utils.checkpoint`` call whose body breaks the graph, never calls the backend,
    and would otherwise run in FP32 unnamed), and call ``watches.warn_past_limit`` where the
    frame goes past the limit (once per process); and make Dynamo compile each frame within
    ``watches.compiling`` its backend."""
    if hasattr(convert_frame.exceeds_recompile_limit, "lowprec_original"):
        return
    compile_frame = convert_frame._compile
    parameters = inspect.signature(compile_frame)

    def _compile(*args: Any, **kwargs: Any) -> Any:
        with watches.compiling(parameters.bind(*args, **kwargs).arguments.get("compiler_fn")):
            return compile_frame(*args, **kwargs)

    _compile.lowprec_original = compile_frame
    convert_frame._compile = _compile
    original = convert_frame.exceeds_recompile_limit

    def exceeds_recompile_limit(*args: Any, **kwargs: Any) -> tuple[bool, str]:
        compiling = sys._getframe(1)
        exceeded, limit_type = original(*args, **kwargs)
        if exceeded:
            watches.warn_past_limit(compiling, limit_type)
        else:
            watches.start_compiling(compiling)
        return exceeded, limit_type

    exceeds_recompile_limit.lowprec_original = original
    convert_frame.exceeds_recompile_limit = exceeds_recompile_limit
