"""Pipeline passes (Kosson, Chiley et al. 2020): stage boundaries and weight prediction.

Run when ``options={"pipeline": {...}}`` is set, after the quantize passes:

* ``split_stages`` (Dynamo graph): tags every node with its stage and makes
  the boundaries visible ``pippy._pipe_split`` nodes
  (:func:`lpcompile.passes.stages.partition_graph`); the stage tags ride
  along into the AOT graphs in ``node.meta["custom"]``.
* ``insert_predict_weight`` (Dynamo graph): every parameter read at a stage
  with delay ``D_s > 0`` goes through ``lowprec::predict_weight(w, buf, lr,
  D_s, mode)`` before anything else reads it (before the weight's quantize
  nodes, so that with FP8 the prediction and the quantize are adjacent).
  ``buf`` and ``lr`` are graph inputs that the backend reads at every call
  from the :class:`~lpcompile.runtime.pipeline.PipelineSGD` owning the parameter
  (without one the prediction is the weight itself). The last stage
  (``D = 0``) reads its weights as they are.
* ``remove_pipe_splits`` (Inductor only): erases the markers, which Inductor
  cannot lower. ``lpcompile.passes.aot.stages.tag_stages`` then tags the AOT
  graphs' nodes from the carried tags.

Running such a graph in an ordinary training loop is not pipelining: it is
what each stage of a pipeline computes. :class:`lpcompile.runtime.pipeline.PipelinedTrainer`
runs the pipeline.
"""

from __future__ import annotations

import torch
import torch.fx

import lpcompile.numerics.predict  # noqa: F401  (defines lowprec::predict_weight)
from lpcompile.passes.driver import CompileContext, PredictionInput
from lpcompile.passes.stages import CUSTOM_KEY, STAGE, is_pipe_split, partition_graph, stage_delays

PREDICT_WEIGHT = torch.ops.lowprec.predict_weight.default


def split_stages(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Tag the Dynamo graph's nodes with their stage; boundaries become pipe_split nodes."""
    ctx.partition = partition_graph(gm, ctx.config.pipeline.stages)


def _tag(node: torch.fx.Node, stage: int) -> None:
    node.meta[STAGE] = stage
    node.meta["custom"] = {**(node.meta.get("custom") or {}), CUSTOM_KEY: stage}


def insert_predict_weight(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Read each parameter of a stage with delay D > 0 through ``lowprec::predict_weight``."""
    mode = ctx.config.pipeline.prediction
    if mode == "none":
        return
    delays = stage_delays(ctx.partition.num_stages)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    ours = set(ctx.inputs.values())
    user_inputs = [n for n in gm.graph.find_nodes(op="placeholder") if n not in ours]
    for index, node in enumerate(user_inputs):
        grapharg = node.meta.get("grapharg")
        param = grapharg.example if grapharg is not None else None
        if not isinstance(param, torch.nn.Parameter) or not node.users:
            continue
        stage = node.meta[STAGE]
        delay = delays[stage]
        if delay == 0:
            continue
        buf_name, lr_name = f"lowprec_predict_buf_{node.name}", f"lowprec_predict_lr_{node.name}"
        buf = ctx.add_input(gm, buf_name, torch.zeros_like(param))
        lr = ctx.add_input(gm, lr_name, torch.zeros((), dtype=torch.float32))
        # read at each call for the parameter of that call: Dynamo may reuse the compiled
        # graph for another module of the same class
        ctx.call_inputs[buf_name] = PredictionInput(index, mode, delay, "buffer")
        ctx.call_inputs[lr_name] = PredictionInput(index, mode, delay, "lr")
        first = min(node.users, key=position.__getitem__)
        with gm.graph.inserting_before(first):
            predicted = gm.graph.call_function(PREDICT_WEIGHT, (node, buf, lr, delay, mode))
        node.replace_all_uses_with(predicted, delete_user_cb=lambda user, new=predicted: user is not new)
        if "example_value" in node.meta:
            predicted.meta["example_value"] = node.meta["example_value"]
        predicted.meta["lowprec"] = {"op": "predict_weight", "mode": mode, "delay": delay, "stage": stage}
        for new in (buf, lr, predicted):
            _tag(new, stage)


def remove_pipe_splits(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Erase the stage-boundary markers from a graph for Inductor, which cannot lower
    ``pippy._pipe_split`` (a no-op; the stage tags stay in the nodes' meta)."""
    for node in [n for n in gm.graph.nodes if is_pipe_split(n)]:
        gm.graph.erase_node(node)
