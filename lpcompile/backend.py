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

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from lpcompile.config import LowPrecConfig
from lpcompile.passes import CompileContext, PassRecord, Site, run_passes
from lpcompile.passes.quantize import annotate_lowprec_nodes, insert_quantize

# The ordered pass lists: graph-level rewrites, then passes over each AOT graph.
GRAPH_PASSES = (insert_quantize,)
ATEN_PASSES = (annotate_lowprec_nodes,)

_graph_ids = itertools.count()


@dataclass
class CompiledGraph:
    """What the backend did to one Dynamo graph."""

    graph_id: int
    config: LowPrecConfig
    sites: dict[int, Site]
    records: list[PassRecord]
    aten_graphs: dict[str, torch.fx.GraphModule] = field(default_factory=dict)


COMPILED_GRAPHS: list[CompiledGraph] = []


class SeedStepper:
    """The per-call seed: the user seed in the high 32 bits, the call count below."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.step = 0

    def next(self) -> torch.Tensor:
        value = torch.tensor(((self.seed & 0xFFFFFFFF) << 32 | (self.step & 0xFFFFFFFF)) - (1 << 63))
        self.step += 1
        return value


def step_seed(seed: int, step: int) -> torch.Tensor:
    """The seed tensor the compiled graph reads at call number ``step``."""
    stepper = SeedStepper(seed)
    stepper.step = step
    return stepper.next()


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


def _aten_compiler(ctx: CompileContext, record: CompiledGraph, kind: str) -> Callable:
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
        run_passes(gm, ATEN_PASSES, ctx, graph=kind)
        record.aten_graphs[kind] = gm
        return make_boxed_func(gm)

    return compile_graph


def _execute(gm: torch.fx.GraphModule, example_inputs: list, ctx: CompileContext, record: CompiledGraph):
    if ctx.config.executor == "eager":
        backend = aot_autograd(
            fw_compiler=_aten_compiler(ctx, record, "forward"),
            bw_compiler=_aten_compiler(ctx, record, "backward"),
            inference_compiler=_aten_compiler(ctx, record, "inference"),
        )
        return backend(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def lowprec(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None
) -> Callable:
    """The backend: rewrite ``gm`` for low-precision training and compile it."""
    config = LowPrecConfig.from_options(options)
    ctx = CompileContext(config=config, graph_id=next(_graph_ids))
    record = CompiledGraph(ctx.graph_id, config, ctx.sites, ctx.records)
    COMPILED_GRAPHS.append(record)
    if config.quantizes:
        gm = run_passes(own_copy(gm), GRAPH_PASSES, ctx, graph="dynamo")
    inputs = list(example_inputs)
    if ctx.seed_node is None:
        return _execute(gm, inputs, ctx, record)
    stepper = SeedStepper(config.seed)
    compiled = _execute(gm, [*inputs, stepper.next()], ctx, record)
    stepper.step = 0

    def run(*args: Any) -> Any:
        return compiled(*args, stepper.next())

    return run
