"""The one driver that runs passes in order and records what each did, and the
context the passes over one Dynamo graph (and its AOT graphs) share."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx

from lpcompile.config import LowPrecConfig, per_matmul_option
from lpcompile.numerics.quantize import scaling_argument


@dataclass
class Site:
    """One inserted lowprec node: what it quantizes and with which stream."""

    offset: int
    role: str
    layer: str
    fmt: str
    rounding: str
    overflow: str
    scaling: str
    op: str  # "quantize" (forward) or "quantize_grad" (quantizes in the backward)
    # the backward matmul of its layer it rounds the role for ("input_grad", "weight_grad"),
    # where an option rounds the role another way there (``LowPrecConfig.in_matmul``)
    matmul: str | None = None

    def meta(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @property
    def option(self) -> str:
        """The option that says how it rounds: its role, or the role's option for its matmul
        (``"weight_for_input_grad"``)."""
        return self.role if self.matmul is None else per_matmul_option(self.role, self.matmul)

    def spec(self) -> str:
        """How it rounds, in words: ``"e5m2 nearest saturate"``, and the scaling, if any."""
        return " ".join([self.fmt, self.rounding, self.overflow, *scaling_argument(self.scaling)])


@dataclass(frozen=True)
class KeptProduct:
    """A product the passes left in higher precision, and why."""

    layer: str
    op: str
    reason: str


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


@dataclass(frozen=True)
class PredictionInput:
    """A graph input read afresh at every call: the weight-prediction ``field``
    (``"buffer"`` or ``"lr"``) of the parameter passed as user input ``index``, from
    the optimizer that trains it (the backend looks it up at each call)."""

    index: int
    mode: str
    delay: int
    field: str


@dataclass
class CompileContext:
    """State shared by the passes over one Dynamo graph and its AOT graphs."""

    config: LowPrecConfig
    graph_id: int  # order of compilation in this process (names in dumps)
    stream: int  # from the graph's layers: keys its random streams, whatever was compiled before
    sites: dict[int, Site] = field(default_factory=dict)
    # sites the joint graph's passes add, by (the site they derive from, what they round):
    # every compile of the graph (the adaptive variants') rounds with the same streams
    derived_sites: dict[tuple, Site] = field(default_factory=dict)
    kept: list[KeptProduct] = field(default_factory=list)  # products left in higher precision
    # the sites whose saturation the graph's last output counts (option saturation)
    counted: list[Site] = field(default_factory=list)
    # the gradient sites whose saturation the probe input's gradient counts (option saturation)
    counted_grads: list[Site] = field(default_factory=list)
    inputs: dict[str, torch.fx.Node] = field(default_factory=dict)
    # inputs read afresh at every call for the parameters of that call
    call_inputs: dict[str, PredictionInput] = field(default_factory=dict)
    adaptive: Any = None  # passes.dynamo.loss_scale.AdaptiveLayout, when loss scaling is adaptive
    partition: Any = None  # passes.stages.Partition, when the graph is split into pipeline stages
    # Inductor's channels-last layout is off for this graph (small CPU convolutions)
    contiguous_layout: bool = False
    # in a piece of a graph Dynamo's DDPOptimizer split at DDP's gradient buckets, the graph
    # id of the first piece: the pieces' adaptive scales chain as one graph's layers
    split_from: int | None = None
    # what part of the model running the graph is, where it is not the whole model (a block
    # compiled on its own, a frame after a graph break, a DDP bucket's piece), in words
    piece: str = ""
    # the exclude patterns that match no layer of the graph, and the graph in words (the
    # backend warns about those no graph of the model matches); None without patterns
    unmatched_excludes: tuple[list[str], str] | None = None
    records: list[PassRecord] = field(default_factory=list)
    kernels: list[Any] = field(default_factory=list)  # lpcompile.codegen.KernelRecord, one per fused kernel
    # what the joint graph's passes warned (see warn_from_joint_graph)
    joint_warnings: list[str] = field(default_factory=list)

    def new_offset(self) -> int:
        """A random-stream offset unique to this graph and site."""
        return (self.stream << 16) | len(self.sites)

    def warn_from_joint_graph(self, message: str) -> None:
        """Warn ``message`` (a pass over the joint graph) and keep it in ``joint_warnings``:
        a compile that AOT autograd's cache serves runs no joint pass, so the backend
        repeats them from there."""
        warnings.warn(message, stacklevel=2)
        self.joint_warnings.append(message)

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
# Whether a pass applies to this graph: (graph module, context, graph kind) -> bool
Condition = Callable[[torch.fx.GraphModule, CompileContext, str], bool]


def always(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return True


@dataclass(frozen=True)
class Pass:
    """A pass in a phase's ordered list, and when it applies."""

    run: GraphPass
    when: Condition = always

    @property
    def __name__(self) -> str:
        return self.run.__name__


def applicable(
    passes: Sequence[Pass | GraphPass], gm: torch.fx.GraphModule, ctx: CompileContext, kind: str
) -> list[GraphPass]:
    """The passes of a list that apply to ``gm`` (a bare function always does)."""
    items = [p if isinstance(p, Pass) else Pass(p) for p in passes]
    return [p.run for p in items if p.when(gm, ctx, kind)]


def run_passes(
    gm: torch.fx.GraphModule, passes: Sequence[Pass | GraphPass], ctx: CompileContext, graph: str
) -> torch.fx.GraphModule:
    """Run the ``passes`` that apply to ``gm`` in order, recording each one in ``ctx.records``.

    ``graph`` names the graph (``"dynamo"``, ``"joint"``, ``"forward"``, ...; a variant
    of the Dynamo graph appends its tag): the records and the conditions read it. Each
    condition is asked just before its pass, on the graph the passes before it left.
    """
    for item in passes:
        if not applicable([item], gm, ctx, graph):
            continue
        graph_pass = item.run if isinstance(item, Pass) else item
        before = _all_nodes(gm)
        code_before = gm.code
        start = time.perf_counter()
        graph_pass(gm, ctx)
        gm.graph.lint()
        gm.recompile()
        after = _all_nodes(gm)
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


def _all_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes of ``gm`` and of its subgraphs (checkpoint bodies, ``torch.cond`` branches)."""
    return {
        node
        for module in gm.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    }
