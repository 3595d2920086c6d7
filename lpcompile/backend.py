"""The ``lowprec`` torch.compile backend.

``torch.compile(model, backend="lowprec", options={...})`` calls
:func:`lowprec` once per Dynamo graph. It parses the options into a
:class:`~lpcompile.config.LowPrecConfig`, runs the graph passes over the
Dynamo graph, then captures forward and backward with AOT autograd and either
hands them to Inductor (``executor="inductor"``; Inductor decomposes the
lowprec operators into its own fused C++ or Triton) or runs them as plain FX
(``executor="eager"``). Each compiled graph leaves a
:class:`CompiledGraph` record in :data:`COMPILED_GRAPHS`.
"""

from __future__ import annotations

import collections
import copy
import functools
import hashlib
import itertools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.weak import WeakIdKeyDictionary

from lpcompile import cpu_gemm, dump, ops
from lpcompile.adaptive import AdaptiveScaleState
from lpcompile.codegen import fuse_lowprec_kernels
from lpcompile.config import LowPrecConfig
from lpcompile.passes import CompileContext, PassRecord, Site, run_passes
from lpcompile.passes.conv import use_im2col_convs
from lpcompile.passes.histogram import count_histograms_serially
from lpcompile.passes.layout import (
    prefers_contiguous_layout,
    realize_transposed_copies,
    remove_permute_pairs,
    use_channels_last_conv_backward,
)
from lpcompile.passes.loss_scale import insert_loss_scale
from lpcompile.passes.matmul import remove_grid_marks, use_bf16_matmuls, uses_bf16_kernel
from lpcompile.passes.partition import recompute_bool_masks
from lpcompile.passes.pipeline import PIPELINE_ATEN_PASSES, PIPELINE_GRAPH_PASSES, remove_pipe_splits
from lpcompile.passes.quantize import (
    SEED_INPUT,
    annotate_lowprec_nodes,
    insert_quantize,
    is_layer_call,
    layer_name,
    parameter_of,
)
from lpcompile.pipeline.partition import is_pipe_split

# The ordered pass lists: graph-level rewrites, then passes over each AOT graph.
GRAPH_PASSES = (insert_loss_scale, insert_quantize, use_im2col_convs)
ATEN_PASSES = (annotate_lowprec_nodes,)
# executor="inductor": passes over the joint graph before AOT partitions it (an
# inference graph, which has none, gets the first two in its stead), then over
# each AOT graph before Inductor compiles it.
JOINT_PASSES = (use_bf16_matmuls, remove_grid_marks, recompute_bool_masks)
INFERENCE_PASSES = (use_bf16_matmuls, remove_grid_marks)
INDUCTOR_PASSES = (remove_permute_pairs, use_channels_last_conv_backward, count_histograms_serially)
# Only over backward graphs (passes/layout.py says why not the forward's).
BACKWARD_PASSES = (realize_transposed_copies,)
# codegen="triton": after the passes, each fusion group becomes one generated Triton kernel.
CODEGEN_PASSES = (fuse_lowprec_kernels,)

_graph_ids = itertools.count()


@dataclass
class CompiledGraph:
    """What the backend did to one Dynamo graph."""

    graph_id: int
    stream: int
    config: LowPrecConfig
    sites: dict[int, Site]
    records: list[PassRecord]
    aten_graphs: dict[str, torch.fx.GraphModule] = field(default_factory=dict)
    # Adaptive loss scaling: one state per model that runs this graph (Dynamo shares a
    # compiled graph between instances of a module class), keyed by its first weight.
    adaptive: WeakIdKeyDictionary | None = None  # first weight -> AdaptiveScaleState
    fused: list = field(default_factory=list)  # codegen.KernelRecord of every generated kernel
    # Inductor settings lowprec chose for this graph (executor="inductor")
    inductor_options: dict[str, Any] = field(default_factory=dict)

    @property
    def kernels(self) -> dict[str, str]:
        """The generated kernels, name -> Triton source (what ``lowprec dump`` writes)."""
        return {k.name: k.source for k in self.fused}


COMPILED_GRAPHS: list[CompiledGraph] = []


def step_seed(seed: int, step: int) -> torch.Tensor:
    """The seed tensor a compiled graph reads at call number ``step``: the user seed in the
    high 32 bits, the call count below (as a signed int64)."""
    return torch.tensor((seed << 32 | (step & 0xFFFFFFFF)) - (1 << 63))


# Call counts behind the seeds: per model (its first parameter, weakly), random stream,
# settings and grad mode, so that a recompile of its graph (new shapes) continues the
# count, two instances of one class (which share Dynamo's compiled graph) count apart,
# and so do two compiles of one model with other options (e.g. the two executors) and
# its no_grad graphs (evaluation does not shift the training steps' bits).
_CALLS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # model key -> Counter of (stream, ...)
# The key of graphs with no such input: they count per stream and settings in the process.
_NO_MODEL = torch.empty(0)


def next_step(key: torch.Tensor, counter: tuple[int, LowPrecConfig, bool]) -> int:
    """The call number of this call of ``key``'s graphs with this (stream, settings, grad
    mode)."""
    calls = _CALLS.get(key)
    if calls is None:
        calls = _CALLS[key] = collections.Counter()
    calls[counter] += 1
    return calls[counter] - 1


def graph_stream(gm: torch.fx.GraphModule) -> int:
    """A 15-bit id of the captured graph's layers (name, op, weight shapes), the high bits
    of its sites' offsets.

    It depends on the model alone, not on what the process compiled before nor on the
    sizes Dynamo made symbolic: a recompile for new shapes keeps the stream (and its
    call count), the same model and seed give the same bits in any process, and
    Inductor's cache keys stay stable. A graph without layers hashes its code.
    """
    layers = []
    for node in filter(is_layer_call, gm.graph.nodes):
        operands = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
        shapes = [tuple(p.shape) for p in map(parameter_of, operands) if p is not None]
        layers.append(f"{layer_name(node)}:{getattr(node.target, '__name__', node.target)}:{shapes}")
    return zlib.crc32(("|".join(layers) if layers else gm.code).encode()) & 0x7FFF


def model_key_input(gm: torch.fx.GraphModule) -> int | None:
    """The index of the Dynamo graph input that names the model at each call: its first
    parameter, else (functional code) its first input that requires grad."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    params = [i for i, node in enumerate(placeholders) if parameter_of(node) is not None]
    values = [node.meta.get("example_value") for node in placeholders]
    trained = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.requires_grad]
    return next(iter(params or trained), None)


def model_key(args: Sequence[Any], index: int | None, default: torch.Tensor) -> torch.Tensor:
    """The tensor that stands for the model in this call (a weight slot's owner: pipeline)."""
    key = default if index is None else args[index]
    return getattr(key, "lowprec_state_key", key)


def own_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a Dynamo graph that passes may change.

    Dynamo keeps using the graph it hands to a backend, so the passes work on a
    copy that keeps what AOT autograd reads from Dynamo's: the module meta, the
    parameter sources and each placeholder's ``_dynamo_source``.
    """
    graph = copy.deepcopy(gm.graph)
    new = {node.name: node for node in graph.find_nodes(op="placeholder")}
    for old in gm.graph.find_nodes(op="placeholder"):
        if hasattr(old, "_dynamo_source"):
            new[old.name]._dynamo_source = old._dynamo_source
    copied = torch.fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copied._param_name_to_source = gm._param_name_to_source
    return copied


class SourceStamp(CustomGraphPass):
    """A post-grad pass that does nothing; its uuid hashes lpcompile's sources.

    Inductor's and AOT autograd's caches key on the graph and on Inductor's
    config, not on the Python of lowprec's decompositions and autograd rules:
    without this, editing ``lpcompile/ops.py`` would keep serving code compiled
    from the old numerics.
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return _package_hash()


class JointPasses(SourceStamp):
    """Inductor's joint-graph hook: runs :data:`JOINT_PASSES` before AOT partitions.

    Its uuid is SourceStamp's (the passes' own source is part of that hash) plus
    what they decide from outside the graph: whether matmuls go to the bf16 kernel.
    AOT autograd's cache keys on the graph before the passes, so without it a
    ``matmul="fp32"`` compile was served an earlier ``"auto"`` compile's kernels.
    """

    def __init__(self, ctx: CompileContext, tag: str) -> None:
        self.ctx, self.tag = ctx, tag

    def uuid(self) -> str:
        return f"{_package_hash()}-bf16-matmuls-{uses_bf16_kernel(self.ctx.config)}"

    def __call__(self, graph: torch.fx.Graph) -> None:
        # Inductor runs its joint-graph passes on inference graphs too: nothing to partition.
        if any(p.name.startswith("tangents") for p in graph.find_nodes(op="placeholder")):
            run_passes(graph.owning_module, JOINT_PASSES, self.ctx, graph="joint" + self.tag)


@functools.cache
def _package_hash() -> str:
    return source_hash(Path(__file__).parent)


def source_hash(package: Path) -> str:
    """Hash of the modules whose Python ends up in Inductor's compiled code: the
    operators (``*ops*.py``: decompositions and autograd rules), what they call,
    the function traced in place of small convolutions (``passes/conv.py``), the
    passes run inside Inductor's compile (``passes/partition.py``,
    ``passes/layout.py``, ``passes/matmul.py``, ``passes/histogram.py``) and the pass
    lists that name them (this module)."""
    digest = hashlib.sha256()
    traced = [p for p in sorted(package.glob("*.py")) if "ops" in p.stem or p.stem in ("rng", "formats")]
    inductor_passes = ("conv.py", "partition.py", "layout.py", "matmul.py", "histogram.py")
    passes = [package / "passes" / name for name in inductor_passes]
    passes.append(package / "backend.py")
    for path in (*traced, *passes):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _config_patches(ctx: CompileContext, tag: str, record: CompiledGraph) -> dict[str, Any]:
    patches = {
        "post_grad_custom_post_pass": SourceStamp(),
        "joint_custom_post_pass": JointPasses(ctx, tag),
        # a fused FP16/BF16 intermediate is rounded to its dtype, as eager stores it, before
        # a quantize reads it: else the quantize rounds the FP32 value onto another grid point
        "emulate_precision_casts": True,
    }
    return {**patches, **record.inductor_options}


def _aten_compiler(ctx: CompileContext, record: CompiledGraph, kind: str) -> Callable:
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
        pipeline = PIPELINE_ATEN_PASSES if ctx.config.pipeline is not None else ()
        codegen = CODEGEN_PASSES if ctx.config.codegen == "triton" else ()
        gm.meta["lowprec_graph"] = kind
        run_passes(gm, (*ATEN_PASSES, *pipeline, *codegen), ctx, graph=kind)
        record.aten_graphs[kind] = gm
        return make_boxed_func(gm)

    return compile_graph


def _inductor_compiler(inner: Callable, ctx: CompileContext, tag: str) -> Callable:
    """Inductor's ``inner_compile`` after lowprec's passes over each AOT graph."""

    def inner_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *args: Any, **kwargs: Any):
        kind = dump.inductor_graph_kind(kwargs)
        passes = {
            "inference": (*INFERENCE_PASSES, *INDUCTOR_PASSES),
            "backward": (*INDUCTOR_PASSES, *BACKWARD_PASSES),
        }.get(kind, INDUCTOR_PASSES)
        run_passes(gm, passes, ctx, graph=kind + tag)
        return inner(gm, example_inputs, *args, **kwargs)

    return inner_compile


def _execute(
    gm: torch.fx.GraphModule, example_inputs: list, ctx: CompileContext, record: CompiledGraph, tag: str = ""
):
    # codegen="triton" generates its own fused kernels: the AOT graphs then run as FX
    # (the eager executor) whatever `executor` says, or Inductor would fuse them again.
    if ctx.config.executor == "eager" or ctx.config.codegen == "triton":
        backend = aot_autograd(
            fw_compiler=_aten_compiler(ctx, record, "forward" + tag),
            bw_compiler=_aten_compiler(ctx, record, "backward" + tag),
            inference_compiler=_aten_compiler(ctx, record, "inference" + tag),
        )
        compiled = backend(gm, example_inputs)
    else:
        from torch._inductor.compile_fx import compile_fx

        ops.refresh_inductor_decompositions()
        # Inductor's own compiler unless dumping; quantize decompositions leave grid marks.
        with dump.capture_inductor(record, tag) as inner, ops.grid_marks():
            compiled = compile_fx(
                gm,
                example_inputs,
                inner_compile=_inductor_compiler(inner, ctx, tag),
                config_patches=_config_patches(ctx, tag, record),
            )
    dump.graph_compiled(record, gm, tag)  # LOWPREC_DUMP: write what was done to this graph
    return compiled


def uses_cpp_wrapper(wrapper: str, example_inputs: Sequence[Any]) -> bool:
    """Whether Inductor generates C++ rather than Python to call a graph's kernels
    (``wrapper="auto"``: for graphs whose tensors are all on the CPU)."""
    if wrapper != "auto":
        return wrapper == "cpp"
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(x.device.type == "cpu" for x in tensors)


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
    if config.matmul == "bf16" and (why := cpu_gemm.unavailable()):
        raise ValueError(f"matmul='bf16': lowprec's bf16 matmul kernel cannot run here: {why}")
    ctx = CompileContext(config=config, graph_id=next(_graph_ids), stream=graph_stream(gm))
    record = CompiledGraph(ctx.graph_id, ctx.stream, config, ctx.sites, ctx.records, fused=ctx.kernels)
    COMPILED_GRAPHS.append(record)
    inductor = config.executor == "inductor" and config.codegen != "triton"
    if config.pipeline is not None:
        passes = (*GRAPH_PASSES, *PIPELINE_GRAPH_PASSES)
    else:
        passes = GRAPH_PASSES if config.quantizes else ()
    if inductor and (config.pipeline is not None or any(map(is_pipe_split, gm.graph.nodes))):
        passes = (*passes, remove_pipe_splits)  # stage markers, which Inductor cannot lower
    if passes:
        gm = run_passes(own_copy(gm), passes, ctx, graph="dynamo")
    if inductor and prefers_contiguous_layout(gm):  # small CPU convolutions: see passes/layout.py
        record.inductor_options["layout_optimization"] = False
        ctx.contiguous_layout = True
    if inductor and uses_cpp_wrapper(config.wrapper, example_inputs):
        record.inductor_options["cpp_wrapper"] = True
    inputs = list(example_inputs)
    if not ctx.inputs:
        return _execute(gm, inputs, ctx, record)
    layout = ctx.adaptive
    model_input = model_key_input(gm)
    counter = (ctx.stream, config, torch.is_grad_enabled())

    def extras(adaptive: dict[str, Any], args: Sequence[Any], step: int | None) -> list[torch.Tensor]:
        values = adaptive
        if SEED_INPUT in ctx.inputs:
            if step is None:
                step = next_step(model_key(args, model_input, _NO_MODEL), counter)
            values = {**values, SEED_INPUT: step_seed(config.seed, step)}
        values = {**values, **{name: read(args) for name, read in ctx.readers.items()}}
        return [values[name] for name in ctx.inputs]

    def compile_variant(graph: torch.fx.GraphModule, adaptive: dict[str, torch.Tensor], tag: str = ""):
        return _execute(graph, [*inputs, *extras(adaptive, inputs, 0)], ctx, record, tag)

    if layout is None:
        compiled = compile_variant(gm, {})
        return lambda *args: compiled(*args, *extras({}, args, None))
    # Adaptive loss scaling: refresh calls run a variant that records gradient statistics.
    states = record.adaptive = WeakIdKeyDictionary()
    key_input = next((i for i in layout.weight_inputs if i is not None), None)

    def state_for(args: Sequence[Any]) -> AdaptiveScaleState:
        key = model_key(args, key_input, _NO_MODEL)
        state = states.get(key)
        if state is None:
            state = states[key] = layout.new_state(tuple(args))
        return state

    first = state_for(inputs)
    recording = compile_variant(own_copy(gm), first.example_inputs(True), "[stats]")
    plain = compile_variant(gm, first.example_inputs(False))

    def run(*args: Any) -> Any:
        adaptive, refresh = state_for(args).next_inputs()
        return (recording if refresh else plain)(*args, *extras(adaptive, args, None))

    return run
