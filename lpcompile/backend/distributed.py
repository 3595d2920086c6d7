"""lowprec under data and tensor parallelism: the DDP and FSDP2 wrappings, each rank's
random stream, and the options a tensor-parallel graph refuses.

Dynamo compiles a frame only if it is user code: a frame whose code lives in ``torch.nn``
(``nn.Sequential.forward``, ``nn.Linear.forward``) is skipped when it is reached as a
frame of its own rather than inlined into a traced caller. DDP and FSDP2 make exactly
these frames: ``DistributedDataParallel.forward`` breaks the graph at
``_inside_ddp_forward`` (on purpose: Dynamo's DDPOptimizer takes over there) and then
calls the wrapped module from eager code; FSDP2's forward hooks are
``torch._dynamo.disable``-d, so each ``fully_shard``-ed module runs its ``forward`` as a
frame of its own, and a root ``forward`` that loops over sharded blocks breaks inside
the loop, which Dynamo cannot resume: the whole root frame runs eagerly and calls its
other layers (an output ``nn.Linear``) from there. Where such a module is a ``torch.nn``
one, its products ran in FP32 and lowprec's backend was never called to notice.

Dynamo already traces such a frame when the module has hooks and its class is a
``torch.nn`` one; FSDP2's classes (``FSDPLinear``) live in ``torch.distributed`` and the
others have no hooks. :func:`trace_wrapped_forwards` adds one rule to Dynamo's skip
decision: the ``forward`` frame of a module that a running DDP or FSDP2 module contains
(found on the Python stack, the wrapper's own call included) is traced. A second rule
holds for lowprec's compiles only, with or without a wrapper: the ``forward`` frame of a
module with products of its own (:func:`product_parameters`, or a fused forward that
multiplies its children's weights: :data:`FUSED_FORWARDS`) is traced, as when a root
``forward`` Dynamo gave up on calls its ``nn.Linear`` layers. Nothing else changes
(inlined calls, other frames, other backends' frames outside a wrapper).

What Dynamo still never traces (a module left out when compiling per block, products a
skipped root ``forward`` computes itself) is named by :mod:`lpcompile.backend.watch`.

Stochastic rounding: the wrapper folds the process's rank into the seed
(:func:`rank_seed`), so ranks draw different bits and each rank's bits are reproducible;
a graph of DTensors folds its device mesh's first rank (:func:`mesh_seed_rank`).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch._dynamo.trace_rules as trace_rules
from torch._dynamo.backends.distributed import DDPOptimizer

from lpcompile.config import LowPrecConfig
from lpcompile.numerics.quantize import is_dtensor, is_rowwise

# Odd multiplier of the rank in the seed (2^32 / golden ratio): injective on 32 bits,
# so no two ranks get one seed.
RANK_MULTIPLIER = 0x9E3779B9


def current_rank() -> int:
    """The rank of this process in the default process group (0 without one)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def has_dtensors(inputs: Sequence[Any]) -> bool:
    """Whether a graph's example ``inputs`` hold DTensors (a tensor-parallel model)."""
    return any(is_dtensor(t) for t in inputs if isinstance(t, torch.Tensor))


def mesh_positions(inputs: Sequence[Any]) -> str:
    """This rank's coordinates on the device meshes of ``inputs``' DTensors: the shards'
    random streams compiled into a graph depend on them, so AOT autograd's cache key must
    (ranks on one machine share the cache directory)."""
    meshes = {
        id(t.device_mesh): t.device_mesh for t in inputs if isinstance(t, torch.Tensor) and is_dtensor(t)
    }
    return ";".join(f"{mesh.mesh.tolist()}@{mesh.get_coordinate()}" for mesh in meshes.values())


def check_dtensor_options(config: LowPrecConfig) -> None:
    """Refuse the options whose operators have no DTensor rule, for a graph of DTensors."""
    specs = (config.weight, config.activation, config.error, config.weight_grad)
    rowwise = sorted({spec.scaling for spec in specs if spec.enabled and is_rowwise(spec.scaling)})
    refused = {
        "pipeline": config.pipeline is not None,
        # the joint graph's per-matmul roundings see each rank's shard only
        f"scaling={'/'.join(rowwise)!r}": bool(rowwise),
        "/".join(config.per_matmul): bool(config.per_matmul),
    }
    if found := [name for name, on in refused.items() if on]:
        raise NotImplementedError(
            f"lowprec: {', '.join(found)} on a tensor-parallel model (a graph of DTensors) is not "
            "supported: stage boundaries have no rule for sharded tensors, and the roundings of "
            "one matmul (per row, per block, or as an option for a layer's backward matmul says) "
            "would be computed from each rank's shard. Scale per tensor (fp8-tensorwise) or not "
            "at all (fp8-e5m2-sr)"
        )


def mesh_seed_rank(inputs: Sequence[Any]) -> int | None:
    """The rank whose random bits a graph with DTensor ``inputs`` (tensor parallelism)
    draws: the first rank of the smallest device mesh they lie on, so that ranks holding
    shards or replicas of one tensor share a seed, which replicas need to stay equal (each
    shard folds in its position: :mod:`lpcompile.numerics.dtensor`). None without DTensors:
    the graph draws the bits of the process's rank."""
    meshes = [t.device_mesh for t in inputs if isinstance(t, torch.Tensor) and is_dtensor(t)]
    if not meshes:
        return None
    return int(min(meshes, key=lambda mesh: (mesh.mesh.numel(), mesh.mesh.min())).mesh.min())


def rank_seed(seed: int, rank: int) -> int:
    """The 32-bit seed the graphs of ``rank`` read: ``seed`` XOR ``rank × 0x9E3779B9 mod
    2^32``. Rank 0 keeps ``seed``: a one-process run draws the bits of rank 0."""
    return seed ^ (rank * RANK_MULTIPLIER & 0xFFFFFFFF)


# How far up the Python stack a wrapper's frame is looked for (Dynamo's own frames, the
# module's _call_impl, the caller's forward and its _call_impl, ...).
STACK_DEPTH = 64


def wrapper_kind(owner: Any) -> str | None:
    """``"DDP"`` or ``"FSDP2"`` if ``owner`` is such a wrapper (without importing either)."""
    parallel = sys.modules.get("torch.nn.parallel.distributed")
    if parallel is not None and isinstance(owner, parallel.DistributedDataParallel):
        return "DDP"
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(owner, getattr(fsdp, "FSDPModule", ())):
        return "FSDP2"
    return None


def calling_selves(frame: Any, depth: int | None = STACK_DEPTH) -> Iterator[tuple[Any, Any]]:
    """(frame, its ``self``) of ``frame`` and its callers, up to ``depth`` frames (all with None)."""
    while frame is not None and depth != 0:
        if "self" in frame.f_code.co_varnames:
            yield frame, frame.f_locals.get("self")
        frame = frame.f_back
        depth = None if depth is None else depth - 1


def running_wrapper(module: torch.nn.Module) -> str | None:
    """The kind of the DDP or FSDP2 module on the Python stack that contains ``module``."""
    for _, owner in calling_selves(sys._getframe(1)):
        if (kind := wrapper_kind(owner)) is not None and any(m is module for m in owner.modules()):
            return kind
    return None


def wrapped_forward(frame: Any) -> str | None:
    """Why ``frame`` (a frame Dynamo would skip) is a ``forward`` that must be traced (of a
    module inside a running DDP or FSDP2 module, or, for lowprec, of a module with
    products), or None."""
    module = frame.f_locals.get("self")
    if not isinstance(module, torch.nn.Module):
        return None
    forward = getattr(type(module), "forward", None)
    if getattr(forward, "__code__", None) is not frame.f_code:
        return None
    if (kind := running_wrapper(module)) is not None:
        return f"lowprec: the forward of a module {kind} runs"
    if (product_parameters(module) or isinstance(module, FUSED_FORWARDS)) and compiling_for_lowprec():
        return "lowprec: the forward of a module with products, called from a frame run uncompiled"
    return None


# Modules whose parameters are read by lookups, not products.
LOOKUPS = (torch.nn.Embedding, torch.nn.EmbeddingBag)
# Modules whose forward multiplies their children's weights itself, in one fused call that
# never calls the children (nn.TransformerEncoderLayer in eval() without gradients).
FUSED_FORWARDS = (torch.nn.TransformerEncoderLayer,)


def product_parameters(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s own parameters that may enter products: those of two or
    more dimensions (none for an embedding lookup, nor for a lazy module not yet built)."""
    if isinstance(module, LOOKUPS):
        return []
    own = module.named_parameters(recurse=False)
    return [name for name, p in own if not torch.nn.parameter.is_lazy(p) and p.dim() >= 2]


# The attribute that marks a backend function as lowprec's (``lpcompile.backend.lowprec``
# has it; a function of the user's that calls lowprec may set it too).
LOWPREC_BACKEND = "lowprec_backend"
# A backend function's attribute: its compiles trace through what was compiled with lowprec
TRACES_THROUGH_LOWPREC = "lowprec_traces_through"


def compiling_for_lowprec() -> bool:
    """Whether Dynamo, deciding on a frame, compiles for lowprec: its callback, found on the
    Python stack, wraps a backend function marked :data:`LOWPREC_BACKEND` (or a
    ``functools.partial`` of one)."""
    for _, owner in calling_selves(sys._getframe(1)):
        if hasattr(owner, "_torchdynamo_orig_backend"):
            return is_lowprec_backend(owner)
    return False


def innermost_backend(compiler_fn: Any) -> Any:
    """The backend Dynamo's ``compiler_fn`` (or its callback) compiles with, through
    DDPOptimizer's (``torch.compile(DDP(model))``): torch.compile's wrapper of it."""
    backend = torch._dynamo.eval_frame.innermost_backend(compiler_fn)
    if isinstance(getattr(backend, "__self__", None), DDPOptimizer):  # its compile_fn
        return innermost_backend(backend.__self__.backend_compile_fn)
    return backend


def _backend_function(compiler_fn: Any) -> Any:
    """The backend function Dynamo's ``compiler_fn`` (or its callback) wraps, through
    :func:`innermost_backend`, torch.compile's wrapper or a ``functools.partial``."""
    backend = innermost_backend(compiler_fn)
    backend = getattr(backend, "compiler_fn", backend)  # torch.compile's wrapper
    return getattr(backend, "func", backend)


def is_lowprec_backend(compiler_fn: Any) -> bool:
    """Whether Dynamo's ``compiler_fn`` (or its callback) wraps a backend function marked
    :data:`LOWPREC_BACKEND`."""
    return getattr(_backend_function(compiler_fn), LOWPREC_BACKEND, False)


def traces_through_lowprec(compiler_fn: Any) -> bool:
    """Whether Dynamo's ``compiler_fn`` traces through what was compiled with lowprec, as
    Dynamo does by default: lowprec's own backend (an outer lowprec compile rounds a block
    compiled with lowprec with its own options), and a backend marked
    :data:`TRACES_THROUGH_LOWPREC` (the pipeline's capture of the model's graph)."""
    backend = _backend_function(compiler_fn)
    return getattr(backend, LOWPREC_BACKEND, False) or getattr(backend, TRACES_THROUGH_LOWPREC, False)


def ddp_optimizer_split() -> Any | None:
    """Where the graph being compiled is a piece of a graph Dynamo's DDPOptimizer split at
    DDP's gradient buckets (``torch.compile(DDP(model))`` with more than one bucket),
    DDPOptimizer's context of that split, the same object for all its pieces; else None."""
    context = torch._guards.TracingContext.try_get()
    return None if context is None else getattr(context, "ddp_optimizer_ctx", None)


def unsharded_parameters(model: torch.nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    """The unsharded parameters FSDP2 swaps into ``model``'s sharded modules for forward and
    backward, by (``id`` of their module, name): the compiled graphs read these, not the
    registered shards, and lowprec's per-model state is keyed by them. Empty without FSDP2."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return {}
    found = {}
    for module in model.modules():
        if isinstance(module, getattr(fsdp, "FSDPModule", ())):
            for group in getattr(module._get_fsdp_state(), "_fsdp_param_groups", ()):
                for fp in group.fsdp_params:
                    if (param := getattr(fp, "_unsharded_param", None)) is not None:
                        info = fp._module_info  # a tied parameter is registered on several
                        owners = [(info.module, info.param_name)]
                        owners += zip(info.shared_modules, info.shared_param_names, strict=True)
                        found.update({(id(m), name): param for m, name in owners})
    return found


def _check_verbose(original: Any) -> Any:
    def check_verbose(obj: Any, is_inlined_call: bool = False, frame: Any | None = None) -> Any:
        # the lent GPU's torch 2.11 passes no frame (the rule is off there)
        result = original(obj, is_inlined_call) if frame is None else original(obj, is_inlined_call, frame)
        if (
            result.skipped
            and not is_inlined_call
            and frame is not None
            and isinstance(obj, types.CodeType)
            and obj.co_name == "forward"
            and (reason := wrapped_forward(frame)) is not None
        ):
            return trace_rules.SkipResult(False, reason)
        return result

    check_verbose.lowprec_original = original
    return check_verbose


def trace_wrapped_forwards() -> None:
    """Let Dynamo trace the ``forward`` frames :func:`wrapped_forward` names (once per process)."""
    if not hasattr(trace_rules.check_verbose, "lowprec_original"):
        trace_rules.check_verbose = _check_verbose(trace_rules.check_verbose)
