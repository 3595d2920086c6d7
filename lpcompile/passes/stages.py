"""Pipeline stages of an FX graph: partition, tags, delays, extraction.

Stage boundaries are ``torch.ops.pippy._pipe_split`` nodes, the marker that
``torch.distributed.pipelining.pipe_split()`` leaves in a Dynamo graph (and
that ``torch.distributed.pipelining.pipeline`` splits at). They come from the
model's own ``pipe_split()`` calls, or :func:`partition_graph` inserts them:

* ``stages=None``: the model's markers only (none: one stage);
* ``stages=S``: S contiguous stages balanced by a cost model, cutting only in
  front of a layer (matmul/conv) so that a layer keeps its norm and activation;
* ``stages="layer"``: one stage per layer, the paper's fine-grained split.

The cost of a node is its FLOPs (``2*MACs`` for matmuls and convolutions, one
per output element otherwise) plus the bytes of the parameters it reads, from
the shapes in ``node.meta`` (``example_value`` in Dynamo graphs, ``val`` in
AOT graphs). With symbolic shapes the cost is a ``SymInt`` expression
(sympy underneath); the partition compares the expressions at the example's
sizes (``optimization_hint``) and the :class:`Partition` keeps them as text.
The balanced split minimises the largest stage cost (dynamic programming over
the cut positions).

Every node then carries ``node.meta["stage"]``; a boundary node belongs to the
stage it opens and has ``node.meta["stage_boundary"] = True``. Parameters and
buffers belong to the stage that reads them; model inputs to stage 0. The tag
is also written to ``node.meta["custom"]["pipeline_stage"]``, which AOT
autograd copies onto the ATen nodes it traces from a node, forward and
backward, so the ATen graphs can be tagged too (:func:`tag_aten_graph`).

Delay. In fine-grained pipelined backpropagation each step every stage does
one forward and one backward and then updates. A sample enters stage 0 at the
step it is fed and moves one stage per step, so stage ``s`` runs its forward
``s`` steps after it entered; the last stage runs forward, loss and backward of
a sample in the same step; its error then moves back one stage per step, so
stage ``s`` runs the sample's backward ``S-1-s`` steps after the last stage
did. Between the forward and the backward of a sample at stage ``s`` there are
therefore ``D_s = 2*(S-1-s)`` steps (:func:`stage_delays`), and the gradient
stage ``s`` applies at step ``t`` comes from its forward of step ``t - D_s``.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.pipelining  # noqa: F401  (registers torch.ops.pippy._pipe_split)
import torch.fx

from lpcompile.numerics.compat import optimization_hint
from lpcompile.passes.graph import (
    CAST,
    CONV_TARGETS,
    CONV_TRANSPOSE_TARGETS,
    LINEAR_TARGETS,
    is_layer_call,
    layer_name,
    product_operands,
    state_name,
)

STAGE = "stage"
BOUNDARY = "stage_boundary"
CUSTOM_KEY = "pipeline_stage"
KEPT_GRAPHARG = "pipeline_grapharg"  # a copy of Dynamo's "grapharg", which it deletes after compiling
PIPE_SPLIT = torch.ops.pippy._pipe_split.default
PIPE_SPLIT_TARGETS = (PIPE_SPLIT, torch.ops.pippy._pipe_split)

BATCHNORM_TARGETS = {
    torch.nn.functional.batch_norm,
    torch.batch_norm,
    torch.ops.aten.batch_norm.default,
    torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit_functional.default,
    torch.ops.aten.native_batch_norm.default,
}
BATCHNORM_ADVICE = (
    "BatchNorm does not work in pipelined backpropagation: every stage processes batches of "
    "one sample. Use GroupNorm instead (e.g. nn.GroupNorm(num_groups, channels)), as Kosson et "
    "al. 2020 do, or a normalization that does not depend on the batch"
)


def stage_delays(num_stages: int) -> list[int]:
    """``D_s = 2*(S-1-s)``: steps from a sample's forward to its backward at stage s."""
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {num_stages}")
    return [2 * (num_stages - 1 - s) for s in range(num_stages)]


def is_pipe_split(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in PIPE_SPLIT_TARGETS


def is_state(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a parameter or buffer of the model (not a model input)."""
    if node.op == "get_attr":
        return True
    if node.op != "placeholder":
        return False
    kept = node.meta.get(KEPT_GRAPHARG)
    if kept is not None:
        return kept.state
    grapharg = node.meta.get("grapharg")
    return grapharg is not None and _grapharg_is_state(grapharg)


def _grapharg_is_state(grapharg: Any) -> bool:
    if isinstance(grapharg.example, torch.nn.Parameter):
        return True
    source = grapharg.source.name if isinstance(grapharg.source.name, str) else grapharg.source.name()
    return "_buffers[" in source or source.startswith("L['self']")


@dataclass(frozen=True)
class CapturedArg:
    """What :func:`keep_grapharg` keeps of a Dynamo placeholder's ``grapharg``."""

    state: bool  # a parameter or buffer
    example: torch.Tensor | None  # the tensor itself, for state only
    position: int | None = None  # a model input: its index among the call's arguments


def keep_grapharg(gm: torch.fx.GraphModule) -> None:
    """Keep what the partition needs of the placeholders' ``grapharg`` (Dynamo drops it).

    Dynamo orders input placeholders by first use, not by argument position: a
    model input's position comes from its source, ``L['args'][i]``.
    """
    for node in gm.graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        if grapharg is not None:
            state = _grapharg_is_state(grapharg)
            source = grapharg.source.name if isinstance(grapharg.source.name, str) else grapharg.source.name()
            match = re.fullmatch(r"L\['args'\]\[(\d+)\]", source)
            position = int(match.group(1)) if match and not state else None
            node.meta[KEPT_GRAPHARG] = CapturedArg(state, grapharg.example if state else None, position)


def check_no_batchnorm(gm: torch.fx.GraphModule) -> None:
    """Raise a clear error when the graph normalizes over the batch."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in BATCHNORM_TARGETS:
            raise ValueError(f"{BATCHNORM_ADVICE} (found {node.name} in layer {layer_name(node)!r})")
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                raise ValueError(f"{BATCHNORM_ADVICE} (found {type(module).__name__} {node.target!r})")


# -- cost model ------------------------------------------------------------------


def _value(node: Any) -> Any:
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def _numel(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (tuple, list)):
        return sum((_numel(v) for v in value), 0)
    return 0


def node_cost(node: torch.fx.Node) -> Any:
    """FLOPs of ``node`` plus the bytes of the parameters it reads (an int or a SymInt)."""
    if node.op not in ("call_function", "call_method", "call_module") or is_pipe_split(node):
        return 0
    out = _numel(_value(node))
    flops = out
    if (operands := product_operands(node)) is not None:
        first, second = (_value(node.args[i]) for i in operands[:2])
        weight = second
        if isinstance(weight, torch.Tensor) and weight.dim() >= 1:
            elements = out  # products are counted per output element, with these exceptions
            if node.target in CONV_TARGETS:
                per_element = weight.numel() // weight.shape[0]  # Cin/groups * prod(kernel)
            elif node.target in CONV_TRANSPOSE_TARGETS:  # per input element: Cout/groups * prod(kernel)
                elements = _numel(first)
                per_element = weight.numel() // weight.shape[0]
            elif node.target in LINEAR_TARGETS:
                per_element = weight.shape[-1]
            else:  # matmul and the others: contraction dimension of the first operand
                per_element = first.shape[-1] if isinstance(first, torch.Tensor) else 1
            flops = 2 * elements * per_element
    param_bytes = 0
    for arg in node.all_input_nodes:
        value = _value(arg)
        if is_state(arg) and isinstance(value, torch.Tensor):
            param_bytes = param_bytes + value.numel() * value.element_size()
    return flops + param_bytes


def _hint(cost: Any) -> int:
    return optimization_hint(cost) if isinstance(cost, torch.SymInt) else int(cost)


def _text(cost: Any) -> str:
    return str(cost.node.expr) if isinstance(cost, torch.SymInt) else str(cost)


def balanced_cuts(costs: Sequence[int], stages: int) -> list[int]:
    """Cut ``costs`` into ``stages`` contiguous groups minimising the largest sum.

    Returns the start index of every group after the first.
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: smallest largest-group cost of the first i items in k groups
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    starts, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return sorted(starts)


# -- tagging -------------------------------------------------------------------------


@dataclass
class Partition:
    """How a graph was cut into stages."""

    num_stages: int
    source: str  # "pipe_split" (the model's markers), "balanced" or "layer"
    costs: list[int] = field(default_factory=list)  # per stage, at the example's sizes
    cost_exprs: list[str] = field(default_factory=list)  # per stage, symbolic where shapes are

    @property
    def delays(self) -> list[int]:
        return stage_delays(self.num_stages)


def _insert_boundaries(gm: torch.fx.GraphModule, stages: int | str) -> str:
    layers = [n for n in gm.graph.nodes if is_layer_call(n)]
    if not layers:
        raise ValueError("automatic pipeline partition needs matmul/conv layers to cut between")
    if stages == "layer":
        starts = list(range(1, len(layers)))
        source = "layer"
    else:
        if stages > len(layers):
            raise ValueError(
                f"stages={stages} but the graph has only {len(layers)} layers (matmul/conv) to put "
                f"in stages; use stages <= {len(layers)} or 'layer'"
            )
        nodes = list(gm.graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        bounds = [0] + [position[n] for n in layers[1:]] + [len(nodes)]
        costs = [
            sum(_hint(node_cost(n)) for n in nodes[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)
        ]
        starts = balanced_cuts(costs, stages)
        source = "balanced"
    for index in starts:
        with gm.graph.inserting_before(_cut_point(layers[index])):
            gm.graph.call_function(PIPE_SPLIT, ())
    return source


def _is_lowprec(node: torch.fx.Node) -> bool:
    """A lowprec operator, or a node lowprec inserted to prepare a product (:data:`CAST`)."""
    target = node.target
    return (node.op == "call_function" and getattr(target, "namespace", None) == "lowprec") or bool(
        node.meta.get(CAST)
    )


def _cut_point(layer: torch.fx.Node) -> torch.fx.Node:
    """The node a boundary in front of ``layer`` goes before.

    The lowprec nodes that earlier passes put right in front of a layer to
    prepare its inputs (quantize, quantize_grad, scale_grad, predict_weight, an
    operand's cast to FP32, the entry of the region without autocast it runs in,
    whose exit follows it) stay in the layer's stage.
    """
    cut = layer
    chain = {layer}
    while (
        cut.prev.op != "root"
        and _is_lowprec(cut.prev)
        and all(u in chain or u.target is torch.amp._exit_autocast for u in cut.prev.users)
    ):
        cut = cut.prev
        chain.add(cut)
    return cut


def partition_graph(gm: torch.fx.GraphModule, stages: int | str | None = None) -> Partition:
    """Tag every node of ``gm`` with its stage (``node.meta["stage"]``); see the module doc.

    Inserts ``pipe_split`` nodes for an automatic partition; keeps the model's
    own markers otherwise. Raises on BatchNorm and on a parameter read by two
    stages (weight tying across stages).
    """
    check_no_batchnorm(gm)
    markers = [n for n in gm.graph.nodes if is_pipe_split(n)]
    if stages is not None and not (stages == "layer" or (type(stages) is int and stages >= 1)):
        raise ValueError(f"stages must be None, an int >= 1 or 'layer', got {stages!r}")
    if markers:
        if stages == "layer" or (isinstance(stages, int) and stages != len(markers) + 1):
            raise ValueError(
                f"the model marks {len(markers) + 1} stages with pipe_split(); got stages={stages!r}. "
                "Leave 'stages' unset to use the markers, or remove them for an automatic partition"
            )
        source = "pipe_split"
    elif stages is None or stages == 1:
        if stages is None:
            warnings.warn(
                "lowprec: stages=None and the model has no pipe_split() markers: the pipeline has one"
                " stage, so nothing is pipelined. Mark stage boundaries with lpcompile.pipe_split(), or"
                " pass stages=S (a balanced partition) or stages='layer'",
                stacklevel=2,
            )
        source = "pipe_split" if stages is None else "balanced"
    else:
        source = _insert_boundaries(gm, stages)

    stage = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if is_pipe_split(node):
            stage += 1
            node.meta[BOUNDARY] = True
        node.meta[STAGE] = stage
    num_stages = stage + 1
    for node in gm.graph.nodes:
        if node.op == "output":
            node.meta[STAGE] = num_stages - 1
        elif node.op in ("placeholder", "get_attr"):
            readers = {u.meta[STAGE] for u in node.users if u.op != "output"}
            if is_state(node):
                if len(readers) > 1:
                    raise ValueError(
                        f"{state_name(node)} is read by stages {sorted(readers)}: a parameter or buffer "
                        "shared between pipeline stages (weight tying, or one buffer read on both sides "
                        "of a cut) is not supported; move the cut, or give each stage its own copy (HF "
                        "transformers' tied embeddings: tie_word_embeddings=False in the model's config)"
                    )
                node.meta[STAGE] = min(readers, default=0)
            else:
                node.meta[STAGE] = 0
    for node in gm.graph.nodes:  # a new dict: nodes may share one "custom" dict
        node.meta["custom"] = {**(node.meta.get("custom") or {}), CUSTOM_KEY: node.meta[STAGE]}
    costs: list[Any] = [0] * num_stages
    for node in gm.graph.nodes:
        costs[node.meta[STAGE]] = costs[node.meta[STAGE]] + node_cost(node)
    return Partition(num_stages, source, [_hint(c) for c in costs], [_text(c) for c in costs])


def tag_aten_graph(gm: torch.fx.GraphModule, backward: bool = False) -> int:
    """Copy the stage tags AOT autograd carried in ``meta["custom"]`` to ``meta["stage"]``.

    Nodes without a carried tag take the stage of their first tagged input
    (else of a user); placeholders the first stage that reads them (the last,
    in a backward graph); the output node the last stage of the graph's order.
    Returns the number of stages seen.
    """
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if is_pipe_split(node):
            node.meta[BOUNDARY] = True
        carried = (node.meta.get("custom") or {}).get(CUSTOM_KEY)
        if carried is not None and node.op not in ("placeholder", "output"):
            node.meta[STAGE] = carried
    for node in nodes:
        if node.op in ("placeholder", "output") or STAGE in node.meta:
            continue
        tagged = [a for a in node.all_input_nodes if STAGE in a.meta and a.op != "placeholder"]
        if tagged:
            node.meta[STAGE] = tagged[0].meta[STAGE]
    for node in reversed(nodes):
        if node.op not in ("placeholder", "output") and STAGE not in node.meta:
            tagged = [u.meta[STAGE] for u in node.users if STAGE in u.meta]
            node.meta[STAGE] = tagged[0] if tagged else 0
    stages = [n.meta[STAGE] for n in nodes if n.op not in ("placeholder", "output")] or [0]
    pick = max if backward else min
    for node in nodes:
        if node.op == "placeholder":
            readers = [u.meta[STAGE] for u in node.users if u.op != "output"]
            node.meta[STAGE] = pick(readers) if readers else (min(stages) if backward else max(stages))
        elif node.op == "output":
            node.meta[STAGE] = min(stages) if backward else max(stages)
    return max(stages) + 1


# -- extraction ----------------------------------------------------------------------


def _copy_graph(
    gm: torch.fx.GraphModule,
    inputs: Sequence[torch.fx.Node],
    body: Sequence[torch.fx.Node],
    outputs: Any,
) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in body:
        if node.op == "get_attr":
            env[node] = graph.get_attr(node.target)
            env[node].meta = dict(node.meta)
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(torch.fx.map_arg(outputs, lambda a: env[a]))
    graph.lint()
    return torch.fx.GraphModule(gm, graph)


def extract_stage(gm: torch.fx.GraphModule, stage: int) -> torch.fx.GraphModule:
    """Stage ``stage`` of a tagged graph (Dynamo, AOT forward or AOT backward) as a GraphModule.

    Its inputs are the graph's placeholders and other stages' values that the
    stage reads, in graph order; its outputs (a tuple) the stage's values that
    other stages or the graph's output read. Boundary nodes are left out.
    """
    body = [
        n
        for n in gm.graph.nodes
        if n.meta.get(STAGE) == stage and n.op not in ("placeholder", "output") and not n.meta.get(BOUNDARY)
    ]
    members = set(body)
    inputs = [
        n
        for n in gm.graph.nodes
        if n not in members and n.op != "output" and any(u in members for u in n.users)
    ]
    outputs = tuple(n for n in body if any(u not in members for u in n.users))
    return _copy_graph(gm, inputs, body, outputs)


@dataclass
class StageGraph:
    """One stage of a pipeline: ``module(*state, *inputs) -> outputs``.

    ``state`` are the names of the parameters/buffers the stage owns;
    ``inputs`` the values it receives from the previous stage (for stage 0 the
    model's inputs, in argument order), ``outputs`` those it sends to the next
    one (the graph outputs, a tuple, for the last stage). A value that a later
    stage needs is handed through every stage in between, as a pipeline would.
    ``positions``: for stage 0, the argument index of each input (arguments the
    graph does not read have none).
    """

    index: int
    module: torch.fx.GraphModule
    state: list[str]
    inputs: list[str]
    outputs: list[str]
    positions: list[int] = field(default_factory=list)


def split_pipeline(gm: torch.fx.GraphModule) -> list[StageGraph]:
    """Cut a graph tagged by :func:`partition_graph` into its stage GraphModules."""
    nodes = [n for n in gm.graph.nodes if not n.meta.get(BOUNDARY)]
    num_stages = 1 + max(n.meta[STAGE] for n in nodes)
    output_node = next(n for n in nodes if n.op == "output")

    def last_reader(node: torch.fx.Node) -> int:
        return max((num_stages if u.op == "output" else u.meta[STAGE]) for u in node.users)

    values = [n for n in nodes if n.op != "output" and not is_state(n) and n.users]
    # live[b]: values made before boundary b (in stages < b) that stage b or later reads
    live = [[n for n in values if n.meta[STAGE] < b <= last_reader(n)] for b in range(num_stages + 1)]
    model_inputs = sorted(
        (n for n in nodes if n.op == "placeholder" and not is_state(n)), key=_argument_position
    )
    result = []
    for s in range(num_stages):
        state = [n for n in nodes if is_state(n) and n.meta[STAGE] == s]
        inputs = model_inputs if s == 0 else live[s]
        body = [n for n in nodes if n.meta[STAGE] == s and n.op not in ("placeholder", "output")]
        body = [n for n in body if not is_state(n)]
        state_attrs = [n for n in state if n.op == "get_attr"]
        state_inputs = [n for n in state if n.op == "placeholder"]
        outputs = output_node.args[0] if s == num_stages - 1 else tuple(live[s + 1])
        module = _copy_graph(gm, [*state_inputs, *inputs], [*state_attrs, *body], outputs)
        result.append(
            StageGraph(
                s,
                module,
                [n.name for n in state_inputs],
                [n.name for n in inputs],
                [n.name for n in live[s + 1]] if s < num_stages - 1 else ["output"],
                [_argument_position(n) for n in inputs] if s == 0 else [],
            )
        )
    return result


def _argument_position(node: torch.fx.Node) -> int:
    kept = node.meta.get(KEPT_GRAPHARG)
    if kept is None or kept.position is None:
        raise ValueError(f"model input {node.name} is not one of the call's arguments")
    return kept.position


def stage_graphs(record) -> dict[tuple[str, int], torch.fx.GraphModule]:
    """Each stage of a compiled graph's AOT graphs, ``{(kind, stage): GraphModule}``.

    ``record`` is a :class:`lpcompile.backend.CompiledGraph` compiled with the
    pipeline option and ``executor="eager"`` (Inductor keeps its ATen graphs).
    """
    out = {}
    for kind, gm in record.aten_graphs.items():
        stages = sorted({n.meta[STAGE] for n in gm.graph.nodes if STAGE in n.meta})
        for stage in stages:
            out[(kind, stage)] = extract_stage(gm, stage)
    return out
