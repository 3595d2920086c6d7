"""Graph rewrites and the one ordered driver that runs and records them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx

from lpcompile.adaptive import AdaptiveLayout
from lpcompile.config import LowPrecConfig


@dataclass
class Site:
    """One inserted lowprec node: what it quantizes and with which stream."""

    offset: int
    role: str
    layer: str
    fmt: str
    rounding: str
    overflow: str
    op: str  # "quantize" (forward) or "quantize_grad" (quantizes in the backward)

    def meta(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PassRecord:
    """What one pass did to one graph."""

    name: str
    graph: str
    seconds: float
    nodes_added: int
    nodes_removed: int
    code_before: str
    code_after: str


@dataclass
class CompileContext:
    """State shared by the passes over one Dynamo graph and its AOT graphs."""

    config: LowPrecConfig
    graph_id: int  # order of compilation in this process (names in dumps)
    stream: int  # from the graph's layers: keys its random streams, whatever was compiled before
    sites: dict[int, Site] = field(default_factory=dict)
    inputs: dict[str, torch.fx.Node] = field(default_factory=dict)
    # inputs whose value is read afresh at every call from the call's own inputs
    # (e.g. an optimizer's buffers for the parameter passed in): read(args)
    readers: dict[str, Callable[[Sequence[Any]], Any]] = field(default_factory=dict)
    adaptive: AdaptiveLayout | None = None
    # Inductor's channels-last layout is off for this graph (small CPU convolutions)
    contiguous_layout: bool = False
    records: list[PassRecord] = field(default_factory=list)
    kernels: list[Any] = field(default_factory=list)  # lpcompile.codegen.KernelRecord, one per fused kernel

    def new_offset(self) -> int:
        """A random-stream offset unique to this graph and site."""
        return (self.stream << 16) | len(self.sites)

    def add_input(self, gm: torch.fx.GraphModule, name: str, example: torch.Tensor) -> torch.fx.Node:
        """A graph input of lowprec's own (once per name), after the existing ones.

        The backend passes these after the user's inputs, in the order added.
        """
        if name not in self.inputs:
            placeholders = gm.graph.find_nodes(op="placeholder")
            with gm.graph.inserting_after(placeholders[-1]):
                node = gm.graph.placeholder(name)
            node.meta["example_value"] = example
            node._dynamo_source = None  # an input of ours, not of user code
            self.inputs[name] = node
        return self.inputs[name]


GraphPass = Callable[[torch.fx.GraphModule, CompileContext], None]


def run_passes(
    gm: torch.fx.GraphModule, passes: Sequence[GraphPass], ctx: CompileContext, graph: str
) -> torch.fx.GraphModule:
    """Run ``passes`` over ``gm`` in order, recording each one in ``ctx.records``."""
    for graph_pass in passes:
        before = set(gm.graph.nodes)
        code_before = gm.code
        start = time.perf_counter()
        graph_pass(gm, ctx)
        gm.graph.lint()
        gm.recompile()
        after = set(gm.graph.nodes)
        ctx.records.append(
            PassRecord(
                name=graph_pass.__name__,
                graph=graph,
                seconds=time.perf_counter() - start,
                nodes_added=len(after - before),
                nodes_removed=len(before - after),
                code_before=code_before,
                code_after=gm.code,
            )
        )
    return gm
