"""The ``lowprec`` torch.compile backend: options → passes → Inductor or FX.

``torch.compile(model, backend="lowprec", options={...})`` calls :func:`lowprec`
once per Dynamo graph. It parses the options into a
:class:`~lpcompile.config.LowPrecConfig`, runs the Dynamo-graph passes, then
captures forward and backward with AOT autograd and either hands them to Inductor
(``executor="inductor"``: the joint-graph and AOT passes run inside its compile,
and Inductor decomposes the lowprec operators into its own fused C++ or Triton)
or runs them as plain FX (``executor="eager"``; ``codegen="triton"`` fuses the
lowprec nodes into generated Triton first). Each compiled graph leaves a
:class:`~lpcompile.backend.records.CompiledGraph` in the registry.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import _is_tangent as is_tangent

from lpcompile.backend import runtime
from lpcompile.backend.cache import (
    SourceStamp,
    joint_warnings_key,
    load_joint_warnings,
    package_hash,
    save_joint_warnings,
    without_donated_buffers,
)
from lpcompile.backend.distributed import (
    LOWPREC_BACKEND,
    check_dtensor_options,
    ddp_optimizer_split,
    has_dtensors,
    mesh_positions,
    trace_wrapped_forwards,
    unsharded_parameters,
)
from lpcompile.backend.records import CompiledGraph
from lpcompile.backend.state import REGISTRY
from lpcompile.backend.watch import (
    compiled_module,
    instance_of,
    outermost_module,
    warn_in_eager_function,
    watch_frame_compiles,
    watch_torch_compile,
)
from lpcompile.codegen import fuse_lowprec_kernels
from lpcompile.config import LowPrecConfig, recipes
from lpcompile.kernels.cpu import gemm
from lpcompile.numerics import lowering
from lpcompile.passes.aot import AOT_PASSES
from lpcompile.passes.aot.layout import prefers_contiguous_layout
from lpcompile.passes.driver import CompileContext, applicable, run_passes
from lpcompile.passes.dynamo import DYNAMO_PASSES
from lpcompile.passes.dynamo.recurrent import RECURRENT
from lpcompile.passes.dynamo.regions import has_regions, write_out_regions
from lpcompile.passes.graph import (
    FRAME_ROOT,
    ROOT_PATH,
    SOURCE_ROOTS,
    SUBMODULE_FRAME,
    WRAPPER_PATH,
    find_calls,
    is_layer_call,
    layer_name,
    mark_exported_root,
    name_canonically,
    parameter_of,
    qualified_name,
    relative_state_name,
    source_fqn,
    source_root,
    with_bodies,
)
from lpcompile.passes.joint import JOINT_PASSES
from lpcompile.passes.joint.matmul import uses_bf16_kernel

# Dynamo skips a whole frame that runs nn.LSTM/GRU/RNN unless this is set, so the backend
# would never see such a model; with it, the recurrent layer is one ATen call that
# passes.dynamo.recurrent writes out as its cells. Set when the backend is first looked up.
torch._dynamo.config.allow_rnn = True
# A checkpointed forward with a Python side effect (HF transformers' layers, through the
# `kernels` hub's context variable) makes Dynamo run the whole frame uncompiled: every
# product in FP32 in the backward's recomputation. With this set, Dynamo compiles it and
# applies the side effect once, in the forward, where eager checkpointing replays it.
torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
# DDP and FSDP2 run a wrapped module's forward as a frame of its own, which Dynamo skips
# when that forward is torch.nn's (nn.Sequential, nn.Linear); so does a frame Dynamo gave
# up on with the layers it calls: see backend/distributed.py.
trace_wrapped_forwards()
# Past Dynamo's recompile limit, a frame compiled for lowprec runs uncompiled, unrounded:
# warn, naming the model; and a model whose frames compile to no graph never calls the
# backend: watch it from the start of each frame's compile (backend/watch.py).
watch_frame_compiles(REGISTRY.watches)
# Another backend's torch.compile that calls a model compiled with lowprec would trace
# through lowprec's compile: it runs it apart instead; given the model itself, it warns,
# naming the model (backend/watch.py).
watch_torch_compile(REGISTRY.watches)

# codegen="triton": after the AOT passes, each fusion group becomes one generated Triton kernel.
CODEGEN_PASSES = (fuse_lowprec_kernels,)


def graph_stream(gm: torch.fx.GraphModule) -> int:
    """A 15-bit id of the captured graph's layers (name, op, weight shapes), the high bits
    of its sites' offsets.

    It depends on the model alone, not on what the process compiled before nor on the
    sizes Dynamo made symbolic: a recompile for new shapes keeps the stream (and its
    call count), the same model and seed give the same bits in any process, and
    Inductor's cache keys stay stable. A graph without layers hashes its code. Nested
    compile regions count as written out: decorating a block keeps its bits.
    """
    if has_regions(gm):
        gm = write_out_regions(own_copy(gm))
    layers = []
    for node in filter(is_layer_call, gm.graph.nodes):
        operands = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
        shapes = [tuple(p.shape) for p in map(parameter_of, operands) if p is not None]
        layers.append(f"{layer_name(node)}:{getattr(node.target, '__name__', node.target)}:{shapes}")
    return zlib.crc32(("|".join(layers) if layers else gm.code).encode()) & 0x7FFF


def model_piece(gm: torch.fx.GraphModule, split: Any) -> str:
    """What part of the model running ``gm`` is, in words, where it is not the whole model:
    a piece of DDPOptimizer's ``split``, or the graph of a submodule's frame (a block compiled
    on its own, a frame after a graph break); "" for the whole model."""
    if split is not None:
        return "a piece of the model's graph, split at DDP's gradient buckets"
    index = runtime.model_key_input(gm)
    param = None if index is None else parameter_of(gm.graph.find_nodes(op="placeholder")[index])
    path = "" if param is None else instance_of(param, runtime.model_key_name(gm))[0]
    return (
        f"submodule {path!r}'s (a block compiled on its own or a frame after a graph break)" if path else ""
    )


def set_root_path(gm: torch.fx.GraphModule, model: torch.nn.Module | None) -> None:
    """Name a graph's layers from the compiled ``model``'s root where its frame starts lower
    (Dynamo compiled it apart after a graph break): its parameters, found in ``model``, give
    the FQN of the frame's module. Not where that module's class occurs more than once in
    ``model``: Dynamo may run the one graph for each of them. Either way, mark the graph as
    a submodule's frame, whose own calls are named after the submodule. Where the frame's
    module holds ``model`` instead (DDP's ``forward`` traced whole), mark the path to drop."""
    names = {} if model is None else _parameter_names(model)
    _mark_frame_root(gm, model, names)
    if model is None:
        return
    roots: set[str] | None = None
    wrappers: set[str] | None = None  # where the frame's module holds the model
    for node in gm.graph.find_nodes(op="placeholder"):
        if (parameter := parameter_of(node)) is None or (path := relative_state_name(node)) is None:
            continue
        found = {
            name.removesuffix(path).removesuffix(".")
            for name in names.get(id(parameter), ())
            if name == path or name.endswith("." + path)
        }
        roots = found if roots is None else roots & found
        above = {
            path.removesuffix("." + name)
            for name in names.get(id(parameter), ())
            if path.endswith("." + name)
        }
        wrappers = above if wrappers is None else wrappers & above
    if not roots and wrappers is not None and len(wrappers) == 1:
        for graph in with_bodies(gm):
            graph.meta[WRAPPER_PATH] = next(iter(wrappers))
    if not roots or len(roots) > 1 or "" in roots:
        return
    (root,) = roots
    kind = type(model.get_submodule(root))
    unique = sum(type(module) is kind for module in model.modules()) == 1
    for graph in with_bodies(gm):
        graph.meta[SUBMODULE_FRAME] = True
        if unique:
            graph.meta[ROOT_PATH] = root


def _parameter_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """Every FQN of each parameter of ``model`` (tied ones have several), by ``id``; FSDP2's
    unsharded parameters, which its graphs read, by the names of the sharded ones."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    unsharded = unsharded_parameters(model)
    for path, module in model.named_modules(remove_duplicate=False):
        for name in dict(module.named_parameters(recurse=False)):
            if (parameter := unsharded.get((id(module), name))) is not None:
                names.setdefault(id(parameter), []).append(qualified_name(path, name))
    return names


def _mark_frame_root(gm: torch.fx.GraphModule, model: torch.nn.Module | None, names: dict) -> None:
    """Mark a graph and its bodies with the local or global of its frame that ``model``'s
    parameters (``names``; any, without a model) are read from (:data:`FRAME_ROOT`), where
    that is one; where they are several, with each one's FQN in ``model``, where its
    parameters place each in one module (:data:`SOURCE_ROOTS`)."""
    read = [
        (source_root(node._dynamo_source.name), source_fqn(node._dynamo_source.name), parameter)
        for node in gm.graph.find_nodes(op="placeholder")
        if (parameter := parameter_of(node)) is not None
        and getattr(node, "_dynamo_source", None) is not None
        and (model is None or id(parameter) in names)
    ]
    roots = {root for root, _, _ in read}
    if len(roots) == 1:
        for graph in with_bodies(gm):
            graph.meta[FRAME_ROOT] = next(iter(roots))
    temporaries = any(root.startswith("L['___stack") for root in roots)
    if model is None or not (len(roots) > 1 or temporaries):
        return
    places: dict[str, set[str]] = {}
    for root, path, parameter in read:
        found = {
            name.removesuffix(path).removesuffix(".")
            for name in names[id(parameter)]
            if name == path or name.endswith("." + path)
        }
        if not path:  # the local is the parameter itself
            found = set(names[id(parameter)])
        places[root] = places.get(root, found) & found
    if any(len(found) != 1 for found in places.values()):
        return  # a local whose parameters are tied to several modules: named as it is
    placed = {root: next(iter(found)) for root, found in places.items()}
    # from the module that holds them all, which plays the frame's ``self`` (set_root_path
    # places it; blocks of one class that run one graph each name its layers alike)
    steps = [path.split(".")[:-1] if path else [] for path in placed.values()]
    common = 0
    while all(len(s) > common and s[common] == steps[0][common] for s in steps):
        common += 1
    parent = ".".join(steps[0][:common])
    for graph in with_bodies(gm):
        graph.meta[SOURCE_ROOTS] = {
            root: path.removeprefix(parent).removeprefix(".") for root, path in placed.items()
        }


def own_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a Dynamo graph that passes may change.

    Dynamo keeps using the graph it hands to a backend, so the passes work on a
    copy that keeps what AOT autograd reads from Dynamo's: the module meta, the
    parameter sources and each placeholder's ``_dynamo_source``; subgraphs are copied too.
    """
    graph = copy.deepcopy(gm.graph)
    new = {node.name: node for node in graph.find_nodes(op="placeholder")}
    for old in gm.graph.find_nodes(op="placeholder"):
        if hasattr(old, "_dynamo_source"):
            new[old.name]._dynamo_source = old._dynamo_source
    copied = torch.fx.GraphModule(gm, graph)
    for name, child in gm.named_children():  # subgraphs (checkpoint bodies): passes enter them too
        if isinstance(child, torch.fx.GraphModule):
            setattr(copied, name, own_copy(child))
    copied.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copied._param_name_to_source = gm._param_name_to_source
    return copied


class JointPasses(SourceStamp):
    """Inductor's joint-graph hook: runs :data:`JOINT_PASSES` before AOT partitions.

    Its uuid is SourceStamp's plus what the passes decide from outside the graph
    (whether matmuls go to the bf16 kernel, whether and with which signs the weight
    gradients' operands take a Hadamard transform, how the per-matmul options round a
    role) and what the rounding rules compile into it (the rank's device-mesh
    coordinates): AOT autograd's cache keys on the graph before the passes.
    """

    def __init__(self, ctx: CompileContext, tag: str, on_cpu: bool, positions: str = "") -> None:
        self.ctx, self.tag, self.on_cpu, self.positions = ctx, tag, on_cpu, positions

    def uuid(self) -> str:
        bf16 = uses_bf16_kernel(self.ctx.config, self.on_cpu)
        mesh = f"-mesh-positions-{self.positions}" if self.positions else ""
        config = self.ctx.config
        hadamard = f"-wgrad-hadamard-{config.seed}" if config.wgrad_hadamard else ""
        per_matmul = "".join(f"-{name}-{getattr(config, name)}" for name in config.per_matmul)
        return f"{package_hash()}-bf16-matmuls-{bf16}{mesh}{hadamard}{per_matmul}"

    def __call__(self, graph: torch.fx.Graph) -> None:
        # Inductor runs its joint-graph passes on inference graphs too; the backend runs
        # JOINT_PASSES over those itself, as the inference graph's (no tangent inputs).
        if any(map(is_tangent, graph.find_nodes(op="placeholder"))):
            run_passes(graph.owning_module, JOINT_PASSES, self.ctx, graph="joint" + self.tag)


def inductor_graph_kind(kwargs: dict[str, Any]) -> str:
    """Which AOT graph a call of Inductor's ``inner_compile`` compiles, from its keywords."""
    if kwargs.get("is_inference"):
        return "inference"
    return "backward" if kwargs.get("is_backward") else "forward"


def _fx_compiler(ctx: CompileContext, record: CompiledGraph, kind: str) -> Callable:
    """AOT's compiler for graphs that run as FX: the AOT passes (and codegen), then FX."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
        gm.meta["lowprec_graph"] = kind
        passes = (*JOINT_PASSES, *AOT_PASSES) if kind.startswith("inference") else AOT_PASSES
        run_passes(gm, passes, ctx, graph=kind)
        if ctx.config.codegen == "triton":
            run_passes(gm, CODEGEN_PASSES, ctx, graph=kind)
        record.aten_graphs[kind] = gm
        return make_boxed_func(gm)

    return compile_graph


def _partition_after_joint_passes(ctx: CompileContext, tag: str) -> Callable:
    """AOT's partition function for graphs that run as FX: :data:`JOINT_PASSES`, then AOT
    autograd's default partition."""
    from torch._functorch.partitioners import default_partition

    def partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
        run_passes(joint, JOINT_PASSES, ctx, graph="joint" + tag)
        return default_partition(joint, joint_inputs, **kwargs)

    return partition


def _inductor_compiler(ctx: CompileContext, record: CompiledGraph, tag: str, observers: list) -> Callable:
    """Inductor's ``inner_compile`` after lowprec's passes over each AOT graph."""
    from torch._inductor.compile_fx import compile_fx_inner

    def inner_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *args: Any, **kwargs: Any):
        kind = inductor_graph_kind(kwargs) + tag
        gm.meta["lowprec_graph"] = kind
        passes = (*JOINT_PASSES, *AOT_PASSES) if kind.startswith("inference") else AOT_PASSES
        run_passes(gm, passes, ctx, graph=kind)
        for observer in observers:
            observer.inductor_graph(record, kind, gm)
        # The adaptive variants' forwards are equal graphs: printed alike and without the
        # variant's tag (the module's dict is in the key), the second is a cache hit.
        del gm.meta["lowprec_graph"]
        name_canonically(gm)
        python_wrapper = contextlib.nullcontext()
        if kwargs.get("cpp_wrapper") and replays_random_ops(gm):
            if ctx.config.wrapper == "cpp":
                raise ValueError(
                    "wrapper='cpp': Inductor's C++ wrapper cannot call the random operators an "
                    "activation checkpoint replays in its recomputation (the CPU's fused "
                    "scaled_dot_product_attention, ...); use wrapper='auto', which writes such "
                    "graphs' wrapper in Python"
                )
            kwargs["cpp_wrapper"] = False
            python_wrapper = torch._inductor.config.patch(cpp_wrapper=False)
        # (lowprec_cpp_builds again: a backward is lowered at its first call)
        with python_wrapper, lowprec_cpp_builds(ctx.config.cpp_opt_level):
            return compile_fx_inner(gm, example_inputs, *args, **kwargs)

    return inner_compile


def replays_random_ops(gm: torch.fx.GraphModule) -> bool:
    """Whether an AOT graph runs a random operator with a saved generator state: AOT
    autograd wraps those an activation checkpoint recomputes and Inductor does not lower
    (the CPU's fused attention, which may drop out) so that the backward draws what the
    forward drew, and Inductor's C++ wrapper cannot call them."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    return any(
        node.op == "call_function" and node.target in (run_and_save_rng_state, run_with_rng_state)
        for node in gm.graph.nodes
    )


# GCC's value numbering walks the stores of a kernel body for each load it looks at:
# on the long bodies of stochastic rounding's hash, half of an -O3 build. Bounded,
# builds take half the time and the kernels run as fast.
GCC_ALIAS_WALK_BOUND = "--param=sccvn-max-alias-queries-per-access=100"


def cpp_flags(level: str) -> tuple[str, ...]:
    """The flags lowprec adds to Inductor's C++ builds: the optimization level, and on
    GCC the bound of its alias walk."""
    from torch._inductor.cpp_builder import is_gcc

    return (f"-{level}", GCC_ALIAS_WALK_BOUND) if is_gcc() else (f"-{level}",)


@contextlib.contextmanager
def lowprec_cpp_builds(level: str) -> Iterator[None]:
    """Inductor builds the C++ it compiles or loads inside with :func:`cpp_flags`.

    Inductor has no setting for its compiler's flags; its builds take extra flags,
    and the compiler takes the last level it is given. The flags are in the key of a
    built library, so a graph loaded from Inductor's caches finds the build made with
    them. Inside itself (a backward compiled at its first call, inside the graph's
    compile) it changes nothing.
    """
    from torch._inductor.codecache import CppPythonBindingsCodeCache as cache

    inductors = cache.__dict__["load_pybinding_async"]
    flags = cpp_flags(level)
    if getattr(inductors.__func__, "lowprec_flags", None) == flags:
        yield
        return

    def load_with_flags(cls, *args: Any, extra_flags: Sequence[str] = (), **kwargs: Any):
        return inductors.__func__(cls, *args, extra_flags=(*extra_flags, *flags), **kwargs)

    load_with_flags.lowprec_flags = flags
    cache.load_pybinding_async = classmethod(load_with_flags)
    try:
        yield
    finally:
        cache.load_pybinding_async = inductors


@contextlib.contextmanager
def overlapped_cpp_builds() -> Iterator[None]:
    """Inductor lowers a graph's backward with its forward, and builds each graph's C++
    wrapper on its compile threads, loaded at the graph's first call.

    A C++ wrapper makes each graph one translation unit, built by one compiler process;
    its backward is otherwise lowered at its first call, after the forward's build. Here
    the forward's build runs while the backward is lowered, and the backward's while the
    forward runs, as Inductor's Python wrapper builds its kernels side by side. With one
    compile thread (``TORCHINDUCTOR_COMPILE_THREADS=1``) it changes nothing.

    The backward then gives no saved tensor's buffer to its outputs (AOT autograd's donated
    buffers): a backward lowered lazily learns at its first call whether autograd keeps
    the graph (``backward(retain_graph=True)``), one lowered with the forward cannot.
    """
    from torch._inductor.async_compile import AsyncCompile, get_compile_threads
    from torch._inductor.codecache import CppWrapperCodeCache as cache

    if get_compile_threads() < 2 or "load_pybinding" in cache.__dict__:  # or inside itself
        yield
        return

    def load_in_background(cls, *args: Any, **kwargs: Any) -> Callable:
        built = cls.load_pybinding_async(*args, submit_fn=AsyncCompile.pool().submit, **kwargs)

        def entry(*inputs: Any) -> Any:
            return built()(*inputs)

        return entry

    cache.load_pybinding = classmethod(load_in_background)
    try:
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True), without_donated_buffers():
            yield
    finally:
        del cache.load_pybinding  # back to the one it inherits


@contextlib.contextmanager
def _tracing_without_onednn() -> Iterator[None]:
    """AOT autograd traces CPU recurrent calls as torch's own math, not oneDNN's kernel:
    traced, that kernel returns no workspace for the backward when its input needs no
    gradient, and the graph fails at its first call."""
    saved = torch.backends.mkldnn.set_flags(False, _fp32_precision=None)
    try:
        yield
    finally:
        torch.backends.mkldnn.set_flags(*saved)


def _execute(
    gm: torch.fx.GraphModule, example_inputs: list, ctx: CompileContext, record: CompiledGraph, tag: str = ""
):
    # a recurrent layer left whole (a recipe that rounds nothing): AOT traces its math
    recurrent = bool(find_calls(gm, RECURRENT.keys()))
    with _tracing_without_onednn() if recurrent else contextlib.nullcontext(), _backward_without_autocast():
        return _compile_aot(gm, example_inputs, ctx, record, tag)


def _backward_without_autocast() -> contextlib.AbstractContextManager:
    """AOT autograd traces the backward without autocast, as eager runs a ``backward()``
    called after the autocast region (torch's advice): each backward product in its
    forward's dtypes, the FP32 backward of a product lowprec runs in FP32 under autocast
    included. Where autocast is on while compiling, AOT autograd's default would apply it to
    the backward too; a value the user set other than that default is kept."""
    if torch._functorch.config.backward_pass_autocast != "same_as_forward":
        return contextlib.nullcontext()
    return torch._functorch.config.patch(backward_pass_autocast="off")


def _compile_aot(
    gm: torch.fx.GraphModule, example_inputs: list, ctx: CompileContext, record: CompiledGraph, tag: str
):
    """``gm`` compiled by AOT autograd, its graphs run as FX or by Inductor (``executor``)."""
    observers = REGISTRY.active_observers()
    # codegen="triton" generates its own fused kernels: the AOT graphs then run as FX
    # (the eager executor) whatever `executor` says, or Inductor would fuse them again.
    if ctx.config.executor == "eager" or ctx.config.codegen == "triton":
        backend = aot_autograd(
            fw_compiler=_fx_compiler(ctx, record, "forward" + tag),
            bw_compiler=_fx_compiler(ctx, record, "backward" + tag),
            inference_compiler=_fx_compiler(ctx, record, "inference" + tag),
            partition_fn=_partition_after_joint_passes(ctx, tag),
        )
        with without_donated_buffers():  # buffers FX reuses nowhere
            compiled = backend(gm, example_inputs)
    else:
        from torch._inductor.compile_fx import compile_fx

        lowering.refresh_inductor_decompositions()
        joint = JointPasses(ctx, tag, on_cpu(example_inputs), mesh_positions(example_inputs))
        warnings_key = joint_warnings_key(gm, example_inputs, f"{joint.uuid()}-{tag}")
        records, warned = len(ctx.records), len(ctx.joint_warnings)
        patches = {
            "post_grad_custom_post_pass": SourceStamp(),
            "joint_custom_post_pass": joint,
            # a fused FP16/BF16 intermediate is rounded to its dtype, as eager stores it,
            # before a quantize reads it: else the quantize rounds the FP32 value elsewhere
            "emulate_precision_casts": True,
            # Adaptive loss scaling's statistics are under torch.cond, which Inductor's and
            # AOT autograd's caches skip unless it is marked: their keys hold the branches'
            # code (a graph module pickles with its subgraphs), so a hit is the same graph.
            "unsafe_marked_cacheable_functions": {"torch.ops.higher_order.cond": torch.__version__},
            **record.inductor_options,
        }
        # An observer of Inductor's graphs needs them compiled, and lpcompile.coverage the
        # roundings the per-matmul options have the joint passes make: a cache hit of AOT
        # autograd's would skip both.
        uncached = torch._functorch.config.patch(enable_autograd_cache=False)
        overlapped = record.inductor_options.get("cpp_wrapper", False)
        with (
            uncached if observers or ctx.config.per_matmul else contextlib.nullcontext(),
            overlapped_cpp_builds() if overlapped else contextlib.nullcontext(),
            lowprec_cpp_builds(ctx.config.cpp_opt_level),
        ):
            compiled = compile_fx(
                gm,
                example_inputs,
                inner_compile=_inductor_compiler(ctx, record, tag, observers),
                config_patches=patches,
            )
        if warnings_key is not None and len(ctx.records) > records:
            save_joint_warnings(warnings_key, ctx.joint_warnings[warned:])
        elif warnings_key is not None:  # served by AOT autograd's cache: no pass ran
            for message in load_joint_warnings(warnings_key):
                ctx.warn_from_joint_graph(message)
    for observer in observers:
        observer.graph_compiled(record, gm, tag)
    return compiled


def on_cpu(example_inputs: Sequence[Any]) -> bool:
    """Whether a graph may compute on the CPU: a tensor input is there, or none is a tensor."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return not tensors or any(x.device.type == "cpu" for x in tensors)


def uses_cpp_wrapper(wrapper: str, example_inputs: Sequence[Any]) -> bool:
    """Whether Inductor generates C++ rather than Python to call a graph's kernels
    (``wrapper="auto"``: for graphs whose tensors are all on the CPU and none is a DTensor:
    a DTensor's graph reads its device mesh, which the C++ wrapper cannot take, and
    ``wrapper="cpp"`` raises ``ValueError`` for such a graph)."""
    dtensors = has_dtensors(example_inputs)
    if wrapper == "cpp" and dtensors:
        raise ValueError(
            "wrapper='cpp': Inductor's C++ wrapper cannot take the device mesh of a DTensor "
            "(tensor parallelism); use wrapper='auto', which writes such graphs' wrapper in Python"
        )
    if wrapper != "auto":
        return wrapper == "cpp"
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return bool(tensors) and not dtensors and all(x.device.type == "cpu" for x in tensors)


def lowprec(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable:
    """The backend: rewrite ``gm`` for low-precision training and compile it."""
    if mode is not None:
        raise ValueError(
            f"backend='lowprec' takes no mode (got mode={mode!r}): lowprec chooses Inductor's"
            " settings itself; pass lowprec's own settings as options={...}"
        )
    config = LowPrecConfig.from_options(options)
    if "recipe" not in (options or {}) and not config.quantizes and config.pipeline is None:
        warnings.warn(
            "lowprec: no recipe given (options={'recipe': ...}): the graph compiles in FP32, as"
            f" Inductor would; recipes: {', '.join(recipes())}",
            stacklevel=1,  # (the user's frame is far up, under torch.compile's)
        )
    if config.matmul == "bf16" and (why := gemm.unavailable()):
        raise ValueError(f"matmul='bf16': lowprec's bf16 matmul kernel cannot run here: {why}")
    if has_dtensors(example_inputs):  # tensor parallelism
        check_dtensor_options(config)
        importlib.import_module("lpcompile.numerics.dtensor").register_dtensor_rules()
    graph_id = REGISTRY.new_graph_id()
    set_root_path(gm, compiled_module())  # before any layer is named
    mark_exported_root(gm)
    if config.quantizes:
        warn_in_eager_function()
    split = ddp_optimizer_split()
    ctx = CompileContext(
        config=config,
        graph_id=graph_id,
        stream=graph_stream(gm),
        split_from=None if split is None else REGISTRY.first_piece(split, graph_id),
        piece=model_piece(gm, split),
    )
    record = CompiledGraph(
        ctx.graph_id, ctx.stream, config, ctx.sites, ctx.records, ctx.kept, fused=ctx.kernels
    )
    REGISTRY.records.append(record)
    REGISTRY.entry(runtime.compiled_model_key(gm, example_inputs)).graphs.add(ctx.graph_id)
    if applicable(DYNAMO_PASSES, gm, ctx, "dynamo"):
        gm = run_passes(own_copy(gm), DYNAMO_PASSES, ctx, graph="dynamo")
        record.partition = ctx.partition
    inductor = config.executor == "inductor" and config.codegen != "triton"
    if inductor and prefers_contiguous_layout(gm):  # small CPU convolutions: see passes/aot/layout.py
        record.inductor_options["layout_optimization"] = False
        ctx.contiguous_layout = True
    if inductor and uses_cpp_wrapper(config.wrapper, example_inputs):
        record.inductor_options["cpp_wrapper"] = True

    def compile_variant(inputs: list, tag: str = "") -> Callable:
        """Compile the rewritten graph (a variant, named by its tag, compiles a copy)."""
        return _execute(own_copy(gm) if tag else gm, inputs, ctx, record, tag)

    if (root := outermost_module()) is not None:
        REGISTRY.watches.start(root)
    if ctx.unmatched_excludes is not None:
        REGISTRY.watches.warn_unmatched_excludes(root, config.exclude, *ctx.unmatched_excludes)
    return REGISTRY.watches.recording(runtime.wrap(gm, list(example_inputs), ctx, compile_variant))


# Dynamo traces, for this backend, the layers a frame it gave up on calls (backend/distributed.py).
setattr(lowprec, LOWPREC_BACKEND, True)
