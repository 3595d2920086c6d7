"""The per-call wrapper of a compiled graph: the inputs of lowprec's own that follow
the user's (the step's seed, the adaptive scales and probes, the weight-prediction
buffers), read afresh at every call.

Seeds: every call of a model's graphs gets the next call number of its
(random stream, settings, grad mode), counted in the registry per model, so a
recompile for new shapes continues the count, two instances of one class (which
share Dynamo's compiled graph) count apart, and evaluation under ``no_grad`` does
not shift the training steps' bits. The user seed is folded with the process's rank in
the default process group (:func:`~lpcompile.backend.distributed.rank_seed`):
data-parallel ranks draw different bits, each reproducibly; a graph of DTensors folds its
device mesh's first rank instead (:func:`~lpcompile.backend.distributed.mesh_seed_rank`).
Blocks compiled one by one run one graph with one stream: each folds its FQN in the model
running into the seed (:func:`instance_seed`), so that identical blocks do not draw
identical bits. A call on fake tensors (DDPOptimizer runs each compiled piece of a split
graph on them to compile the next) counts nothing.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from lpcompile.backend.adaptive import AdaptiveScaleState
from lpcompile.backend.distributed import current_rank, mesh_seed_rank, rank_seed
from lpcompile.backend.state import REGISTRY
from lpcompile.numerics.scale_grad import count_probe
from lpcompile.passes.driver import CompileContext, Site
from lpcompile.passes.dynamo.loss_scale import RECORD_IN_VARIANT
from lpcompile.passes.dynamo.quantize import SEED_INPUT
from lpcompile.passes.dynamo.saturation import SATURATION_INPUT
from lpcompile.passes.graph import ROOT_PATH, parameter_of, relative_state_name, shown_name


def step_seed(seed: int, step: int, rank: int = 0) -> torch.Tensor:
    """The seed tensor a compiled graph of rank ``rank`` reads at call number ``step``: the
    user seed folded with the rank (:func:`rank_seed`; rank 0 keeps it) in the high 32
    bits, the call count below (as a signed int64)."""
    return torch.tensor((rank_seed(seed, rank) << 32 | (step & 0xFFFFFFFF)) - (1 << 63))


def instance_seed(seed: int, path: str) -> int:
    """The user seed of the graphs a model's module at ``path`` runs (``""``: the model
    itself, whose seed it is): ``seed`` XOR the CRC-32 of ``path``."""
    return seed ^ zlib.crc32(path.encode()) if path else seed


def parameter_input(gm: torch.fx.GraphModule) -> int | None:
    """The index of the Dynamo graph's first input that is a parameter, if any."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    return next((i for i, node in enumerate(placeholders) if parameter_of(node) is not None), None)


def model_key_input(gm: torch.fx.GraphModule) -> int | None:
    """The index of the Dynamo graph input that names the model at each call: its first
    parameter, else (functional code) its first input that requires grad."""
    if (found := parameter_input(gm)) is not None:
        return found
    values = [node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")]
    return next((i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.requires_grad), None)


def model_key_name(gm: torch.fx.GraphModule) -> str | None:
    """The FQN of the parameter that names the model (:func:`model_key_input`) from the
    module the graph's frame calls ``self``; None without one."""
    index = model_key_input(gm)
    return None if index is None else relative_state_name(gm.graph.find_nodes(op="placeholder")[index])


def model_key(args: Sequence[Any], index: int | None) -> torch.Tensor:
    """The tensor that stands for the model in this call: no model's where it was computed
    in this call (an activation, the first input requiring grad of a frame without
    parameters after a graph break, new at every call: its graphs count their calls per
    stream and settings in the process, as those with no such input do)."""
    if index is None:
        return REGISTRY.no_model
    key = args[index]
    return (
        REGISTRY.no_model
        if key.grad_fn is not None and not isinstance(key, FakeTensor)
        else REGISTRY.key(key)
    )


def compiled_model_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> torch.Tensor:
    """The tensor that stands for the model a graph is compiled for. A fake example input
    (DDPOptimizer compiles each piece of a split graph on fake tensors) is replaced by the
    parameter Dynamo recorded for that input."""
    index = model_key_input(gm)
    if index is not None and isinstance(example_inputs[index], FakeTensor):
        param = parameter_of(gm.graph.find_nodes(op="placeholder")[index])
        return REGISTRY.no_model if param is None else REGISTRY.key(param)
    return model_key(example_inputs, index)


def wrap(
    gm: torch.fx.GraphModule, inputs: list, ctx: CompileContext, compile_variant: Callable[..., Callable]
) -> Callable:
    """Compile ``gm`` (through ``compile_variant(inputs, tag)``) and return what Dynamo
    calls: the compiled graph with lowprec's inputs appended at every call, and its
    saturation counts (option ``saturation``) taken off its outputs."""
    model_input = model_key_input(gm)
    # a graph named from the model's root (ROOT_PATH) is the one module of its class there
    relative = None if ROOT_PATH in gm.meta else model_key_name(gm)
    run = _with_inputs(inputs, ctx, compile_variant, model_input, relative, parameter_input(gm))
    if not ctx.counted:
        return run
    sites, strict = ctx.counted, ctx.config.saturation == "raise"

    def counted(*args: Any) -> Any:
        *outputs, counts = run(*args)
        if isinstance(counts, FakeTensor):  # DDPOptimizer propagating shapes through a piece
            return outputs
        REGISTRY.count_saturation(model_key(args, model_input), ctx.graph_id, sites, counts)
        if strict and bool(counts[:, 1].any()):
            raise FloatingPointError(nonfinite_message(sites, counts))
        return outputs

    return counted


def nonfinite_message(sites: Sequence[Site], counts: torch.Tensor) -> str:
    """What a call whose quantize inputs held inf or NaN says (``saturation="raise"``)."""
    found = [
        f"{shown_name(site.layer)} ({site.role} to {site.fmt}: {n} value(s))"
        for site, n in zip(sites, counts[:, 1].tolist(), strict=True)
        if n
    ]
    return (
        f"lowprec: inf or NaN entered the quantize of {', '.join(found)}. Quantizing "
        "saturates infinities to the format's largest value and keeps NaN, so the output need not "
        "show it; the option saturation='raise' stops here (saturation='count' only counts)"
    )


def static_examples(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """lowprec's own example inputs as fake tensors of static shape in Dynamo's fake mode.

    AOT autograd would give a real tensor it has no Dynamo record of a symbolic size
    per dimension: the number of scaled layers would then be a symbol, and the forward
    of the recording variant would return it for its backward, which makes it differ
    from the plain variant's forward (otherwise the same graph, found in Inductor's cache).
    """
    context = torch._guards.TracingContext.try_get()
    if context is None or context.fake_mode is None:
        return list(tensors)
    return [context.fake_mode.from_tensor(t, static_shapes=True) for t in tensors]


def _with_inputs(
    inputs: list,
    ctx: CompileContext,
    compile_variant: Callable[..., Callable],
    model_input: int | None,
    relative: str | None,
    first_parameter: int | None,
) -> Callable:
    """The compiled graph, called with lowprec's own inputs appended. ``relative``: the FQN
    of the parameter at ``model_input`` from the module the graph's frame calls ``self``;
    ``first_parameter``: the graph's first parameter input, if any."""

    def instance(key: torch.Tensor) -> str | None:
        """Note a real call for ``key``: the FQN of the calling module in the model running
        ("" for the model itself); None for a call on fakes (DDPOptimizer's), noting nothing."""
        return None if isinstance(key, FakeTensor) else REGISTRY.instance_path(key, ctx.graph_id, relative)

    if not ctx.inputs:
        compiled = compile_variant(inputs)

        def call(*args: Any) -> Any:
            instance(model_key(args, model_input))
            return compiled(*args)

        return call
    config, layout = ctx.config, ctx.adaptive
    counter = (ctx.stream, repr(config), torch.is_grad_enabled())
    shared_rank = mesh_seed_rank(inputs)

    def extras(adaptive: dict[str, Any], args: Sequence[Any], step: int | None) -> list[torch.Tensor]:
        values = dict(adaptive)
        key = model_key(args, model_input)
        path = instance(key) if step is None else ""
        called = step is None and path is not None  # not compiling, not on fakes
        if SEED_INPUT in ctx.inputs:
            if called:
                step = REGISTRY.next_step(key, counter)
            rank = (current_rank() if shared_rank is None else shared_rank) if config.seed_per_rank else 0
            values[SEED_INPUT] = step_seed(instance_seed(config.seed, path or ""), step or 0, rank)
        if SATURATION_INPUT in ctx.inputs:
            device = ctx.inputs[SATURATION_INPUT].meta["example_value"].device
            sites = ctx.counted_grads
            if called:
                values[SATURATION_INPUT] = REGISTRY.gradient_probe(key, ctx.graph_id, sites, device)
            else:  # counts nothing
                values[SATURATION_INPUT] = count_probe(len(sites), device)
        for name, spec in ctx.call_inputs.items():
            values[name] = REGISTRY.prediction_input(args[spec.index], spec)
        return [values[name] for name in ctx.inputs]

    if layout is None:
        compiled = compile_variant([*inputs, *static_examples(extras({}, inputs, 0))])
        return lambda *args: compiled(*args, *extras({}, args, None))
    # Adaptive loss scaling: refresh calls record gradient statistics, in the one compiled
    # graph (under torch.cond, or at every call), else in a variant of their own.
    # (a graph whose layers have no weight of their own, Functions': its first parameter;
    # without one, no model: an input batch changes at every call)
    key_input = next((i for i in layout.weight_inputs if i is not None), first_parameter)

    def state_for(key: torch.Tensor, args: Sequence[Any]) -> AdaptiveScaleState:
        return REGISTRY.adaptive_state(key, ctx.graph_id, layout, tuple(args), ctx.split_from)

    first = state_for(model_key(inputs, key_input), inputs)
    variants = layout.recording == RECORD_IN_VARIANT
    recording = compile_variant(
        [*inputs, *static_examples(extras(first.example_inputs(True), inputs, 0))],
        "[stats]" if variants else "",
    )
    plain = recording
    if variants:
        plain = compile_variant([*inputs, *static_examples(extras(first.example_inputs(False), inputs, 0))])

    def run(*args: Any) -> Any:
        key = model_key(args, key_input)
        # DDPOptimizer runs a piece on fake tensors to compile the next: the compile's state
        adaptive, refresh = (first if isinstance(key, FakeTensor) else state_for(key, args)).next_inputs()
        return (recording if refresh else plain)(*args, *extras(adaptive, args, None))

    return run
