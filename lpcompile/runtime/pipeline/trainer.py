"""Fine-grained pipelined backpropagation, simulated in one process.

:class:`PipelinedTrainer` runs a model cut into S stages exactly as a
pipeline of S workers would: at every step each stage does one forward (of
the newest sample that reached it) and one backward (of the oldest sample
whose error reached it), then updates its weights; batch size 1 per stage, and
no fill/drain flush once the pipeline is full. Messages between stages take
one step: stage s's output at step t is stage s+1's input at step t+1, and
stage s+1's input gradient at step t is stage s's output gradient at step t+1.
The last stage runs forward, loss and backward of a sample in one step.

Schedule (derivation in :mod:`lpcompile.passes.stages`): sample n enters
stage 0 at step n, is at stage s at step ``n + s`` and back at stage s at step
``n + 2(S-1) - s``, so stage s applies at step t the gradient of its forward of
step ``t - D_s`` with ``D_s = 2(S-1-s)``. During warm-up (``t < s + D_s``,
before the first sample's gradient is back) a stage does not step. :attr:`PipelinedTrainer.history`
records every forward and backward so tests can check this.

Weights. The forward of stage s at step t reads ``w_t`` (the weights after the
updates of steps ``< t``), or their prediction ``D_s`` steps ahead
(``prediction="lwp_v"``/``"lwp_w"``, :class:`PipelineSGD`), through a copy
made for that forward. The backward at step ``t + D_s`` then reads
``w_{t+D_s}``, the stage's current weights, as real PB hardware does
(the copy is refreshed in place just before the backward, so activations
saved by the forward stay those of the forward), or, with
``weight_stash=True``, the copy its forward read (PipeDream's weight
stashing). Tensors that the stage derives from a weight in its forward and
saves for the backward (e.g. an FP8-rounded copy of the weight in a stage
compiled with an FP8 recipe) are not refreshed: they keep the forward's value.

Stages come from the model's Dynamo graph (one graph, no graph breaks),
partitioned by :func:`lpcompile.passes.stages.partition_graph`; each is
run eagerly as an FX GraphModule or, with ``compile=options``, compiled with
``torch.compile(backend="lowprec", options=options)`` (FP8 recipes etc.).

Checkpoints: after :meth:`PipelinedTrainer.drain`, the model's ``state_dict()``
and :meth:`PipelinedTrainer.state_dict` (the optimizer's state, the step and
sample counts, and the stages' stream call counts and adaptive scales) resume the
run bit for bit in a new trainer.

Not done: running the stages as ``torch.distributed`` ranks; dynamic loss
scaling (a static ``loss_scale`` is supported); BatchNorm (refused).
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lpcompile.backend.state import REGISTRY, check_streams_state
from lpcompile.config import LowPrecConfig
from lpcompile.numerics.checks import check_count, check_positive
from lpcompile.passes.stages import (
    BATCHNORM_ADVICE,
    KEPT_GRAPHARG,
    Partition,
    StageGraph,
    keep_grapharg,
    partition_graph,
    split_pipeline,
    stage_delays,
)
from lpcompile.runtime.pipeline.optim import PipelineSGD


def capture_graph(model: nn.Module, *example_inputs: Any) -> torch.fx.GraphModule:
    """The Dynamo graph of ``model(*example_inputs)``: one graph, parameters as placeholders.

    The model runs once (without gradients) to be traced. The capture uses its
    own code object, so it neither touches nor fills the cache of other
    ``torch.compile`` calls on the same model.
    """
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable:
        keep_grapharg(gm)  # Dynamo drops "grapharg" afterwards
        graphs.append(gm)
        return gm.forward

    def call(module, *args):
        return module(*args)

    fresh = types.FunctionType(
        call.__code__.replace(co_name="lowprec_pipeline_capture"),
        call.__globals__,
        "lowprec_pipeline_capture",
    )
    with torch.no_grad():
        torch.compile(fresh, backend=backend, fullgraph=True, dynamic=False)(model, *example_inputs)
    if len(graphs) != 1:
        raise RuntimeError(f"expected one Dynamo graph for the model, got {len(graphs)}")
    return graphs[0]


@dataclass
class Event:
    """One forward or backward of one stage, as :attr:`PipelinedTrainer.history` records it."""

    step: int
    stage: int
    kind: str  # "forward" or "backward"
    sample: int
    forward_step: int  # the step of the forward whose gradient this is (= step for a forward)


@dataclass
class _InFlight:
    sample: int
    step: int
    inputs: list[Any]
    outputs: Any
    slots: list[nn.Parameter]
    label: Any = None


@dataclass
class Stage:
    """A stage of the pipeline: its graph, its parameters, its delay and what is in flight."""

    index: int
    delay: int
    graph: StageGraph
    params: list[nn.Parameter]  # the model's trained parameters this stage owns
    runner: Callable  # runner(*state, *inputs) -> outputs
    ring: list[list[torch.Tensor]]  # D+1 state lists: Parameter slots (and buffers) per forward
    trained: list[bool]  # which state entries are slots of trained parameters
    queue: deque = field(default_factory=deque)


def _grad_inputs(values: Sequence[Any]) -> list[Any]:
    """Detached copies of a message; floating tensors become leaves that collect their gradient."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            v = v.detach()
            if v.is_floating_point():
                v.requires_grad_(True)
        out.append(v)
    return out


class PipelinedTrainer:
    """Fine-grained pipelined backpropagation of ``model`` with :class:`PipelineSGD`.

    Args:
        model: the model; its parameters are trained in place. BatchNorm is refused.
        example_input: one sample with its batch dimension (batch size 1), to trace the
            model (a tuple for several inputs).
        stages: ``None`` (the model's ``pipe_split()`` markers), an int S (balanced
            partition) or ``"layer"`` (one stage per matmul/conv layer).
        lr, momentum, weight_decay: SGD's hyperparameters (per sample: batch size 1;
            see :func:`lpcompile.runtime.pipeline.scale_hyperparameters`).
        spike_compensation, prediction: see :class:`PipelineSGD`.
        weight_stash: the backward reads the weights its forward read, not the current ones.
        loss_fn: ``loss_fn(output, target)``; ``output`` is what the traced graph
            returns: the model's output tensor, or a tuple of the tensors of an output
            with several (a dict's values, a tuple's tensors, in order; non-tensor
            values are not returned).
        compile: ``None`` (stages run as eager FX) or lowprec ``options`` to compile each stage.
        loss_scale: a static loss scale; gradients are divided by it before the update.
        record: keep :attr:`history` (one :class:`Event` per forward and backward).
    """

    def __init__(
        self,
        model: nn.Module,
        example_input: torch.Tensor,
        *,
        stages: int | str | None = None,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        spike_compensation: bool = False,
        prediction: str = "none",
        weight_stash: bool = False,
        loss_fn: Callable[[Any, Any], torch.Tensor] = F.cross_entropy,
        compile: dict[str, Any] | None = None,
        loss_scale: float = 1.0,
        record: bool = False,
    ) -> None:
        for name, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                raise ValueError(f"{BATCHNORM_ADVICE} (found {type(module).__name__} {name!r})")
        if compile is not None:
            if "pipeline" in compile:
                raise ValueError(
                    "compile options for the stages must not set 'pipeline': the trainer is the pipeline"
                )
            LowPrecConfig.from_options(compile)  # bad options fail here, not at the first step
        check_positive("loss_scale", loss_scale)
        if not isinstance(weight_stash, bool):
            raise ValueError(f"weight_stash must be a bool, got {weight_stash!r}")
        example = example_input if isinstance(example_input, tuple) else (example_input,)
        batches = [v.shape[0] for v in example if isinstance(v, torch.Tensor) and v.dim() > 0]
        if any(b != 1 for b in batches):
            raise ValueError(
                f"example_input must be one sample (batch dimension 1), got batch sizes {batches}: "
                "pipelined backpropagation feeds one sample per step"
            )
        self.model = model
        self.loss_fn = loss_fn
        self.weight_stash = weight_stash
        self.loss_scale = float(loss_scale)
        self.record = record
        # the stage graphs hold the train()/eval() behaviour of the capture (dropout, ...)
        self._modes = _modes(model)
        # what step() checks each sample against: the graph is traced for these shapes
        self._example_shapes = [getattr(v, "shape", None) for v in example]
        gm = capture_graph(model, *example)
        self.partition: Partition = partition_graph(gm, stages)
        self.graph = gm
        params = {id(p): p for p in model.parameters() if p.requires_grad}
        self.delays = stage_delays(self.partition.num_stages)
        self.stages: list[Stage] = []
        placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
        for graph, delay in zip(split_pipeline(gm), self.delays, strict=True):
            state = [placeholders[name].meta[KEPT_GRAPHARG].example for name in graph.state]
            stage_params = [params[id(v)] for v in state if id(v) in params]
            runner = graph.module
            if compile is not None:
                runner = torch.compile(graph.module, backend="lowprec", options=dict(compile), dynamic=False)
            # per in-flight forward: a Parameter slot per trained weight; buffers as they are
            trained = [id(v) in params for v in state]
            ring = [
                [_slot(v) if t else v for v, t in zip(state, trained, strict=True)] for _ in range(delay + 1)
            ]
            self.stages.append(Stage(graph.index, delay, graph, stage_params, runner, ring, trained))
        groups = [{"params": stage.params, "delay": stage.delay} for stage in self.stages if stage.params]
        self.optimizer = PipelineSGD(
            groups,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            spike_compensation=spike_compensation,
            prediction=prediction,
        )
        self.steps = 0  # steps run
        self.samples = 0  # samples fed
        self.losses: list[float] = []  # per sample, in the order they finished
        self.history: list[Event] = []
        self._fwd: list[tuple[int, list[Any], Any] | None] = [None] * self.num_stages
        self._bwd: list[tuple[int, list[Any]] | None] = [None] * self.num_stages

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def _pending(self) -> int:
        return (
            sum(len(s.queue) for s in self.stages)
            + sum(m is not None for m in self._fwd)
            + sum(m is not None for m in self._bwd)
        )

    # -- one stage ----------------------------------------------------------------------

    def _forward(self, stage: Stage, sample: int, values: list[Any], label: Any, t: int) -> _InFlight:
        state = stage.ring[t % len(stage.ring)]
        slots = [v for v, t in zip(state, stage.trained, strict=True) if t]
        with torch.no_grad():
            for slot, p in zip(slots, stage.params, strict=True):
                slot.data.copy_(self.optimizer.predicted_weight(p))
                slot.grad = None
        inputs = values if stage.index == 0 else _grad_inputs(values)
        with torch.enable_grad():
            outputs = stage.runner(*state, *inputs)
        if self.record:
            self.history.append(Event(t, stage.index, "forward", sample, t))
        return _InFlight(sample, t, inputs, outputs, slots, label)

    def _backward(self, stage: Stage, item: _InFlight, grads: Sequence[Any] | None, t: int) -> list[Any]:
        if not self.weight_stash and stage.delay > 0:
            with torch.no_grad():
                for slot, p in zip(item.slots, stage.params, strict=True):
                    slot.data.copy_(p.detach())  # the current weights; no version bump
        if grads is None:  # last stage: the loss
            outputs = item.outputs
            output = outputs[0] if isinstance(outputs, tuple) and len(outputs) == 1 else outputs
            loss = self.loss_fn(output, item.label)
            self.losses.append(loss.item())
            tensors = [loss * self.loss_scale if self.loss_scale != 1.0 else loss]
            grad_tensors: list[Any] = [None]
        else:
            pairs = [
                (o, g)
                for o, g in zip(item.outputs, grads, strict=True)
                if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
            ]
            tensors = [o for o, _ in pairs]
            grad_tensors = [g for _, g in pairs]
        if tensors:
            torch.autograd.backward(tensors, grad_tensors)
        for slot, p in zip(item.slots, stage.params, strict=True):
            grad = slot.grad
            if grad is not None and self.loss_scale != 1.0:
                grad = grad / self.loss_scale
            p.grad = grad
            slot.grad = None
        if self.record:
            self.history.append(Event(t, stage.index, "backward", item.sample, item.step))
        return [v.grad if isinstance(v, torch.Tensor) and v.requires_grad else None for v in item.inputs]

    # -- the pipeline -------------------------------------------------------------------

    def step(self, x: Any = None, y: Any = None) -> float | None:
        """One pipeline step, feeding the sample ``(x, y)`` (``x=None``: nothing new, to drain).

        ``x`` is one sample with its batch dimension of 1 (or a tuple of the
        model's inputs). Returns the loss of the sample that reached the last
        stage at this step, if any.
        """
        if _modes(self.model) != self._modes:
            raise RuntimeError(
                "the model's train()/eval() modes changed since the trainer traced it; its stage "
                "graphs keep the traced behaviour (dropout, ...): switch the modes back (e.g. "
                "model.train() after evaluating) or build a new trainer"
            )
        t = self.steps
        last = self.num_stages - 1
        fwd_next: list[Any] = [None] * self.num_stages
        bwd_next: list[Any] = [None] * self.num_stages
        if x is not None:
            args = list(x) if isinstance(x, tuple) else [x]
            shapes = [getattr(v, "shape", None) for v in args]
            if shapes != self._example_shapes:
                raise ValueError(
                    f"the model was traced for inputs of shapes {self._example_shapes}, got {shapes}: "
                    "each step feeds one sample shaped as example_input (batch dimension 1)"
                )
            self._fwd[0] = (self.samples, [args[i] for i in self.stages[0].graph.positions], y)
            self.samples += 1
        loss = None
        for stage in self.stages:
            s = stage.index
            message = self._fwd[s]
            if message is not None:
                sample, values, label = message
                item = self._forward(stage, sample, values, label, t)
                if s < last:
                    outs = item.outputs
                    fwd_next[s + 1] = (
                        sample,
                        [o.detach() if isinstance(o, torch.Tensor) else o for o in outs],
                        label,
                    )
                stage.queue.append(item)
            if s == last:
                if message is not None:
                    grads_in = self._backward(stage, stage.queue.popleft(), None, t)
                    loss = self.losses[-1]
                    if s > 0:
                        bwd_next[s - 1] = (message[0], grads_in)
            elif self._bwd[s] is not None:
                sample, grads = self._bwd[s]
                item = stage.queue.popleft()
                if item.sample != sample:
                    raise RuntimeError(
                        f"stage {s}: error of sample {sample} met forward of sample {item.sample}"
                    )
                grads_in = self._backward(stage, item, grads, t)
                if s > 0:
                    bwd_next[s - 1] = (sample, grads_in)
        self.optimizer.step()
        for stage in self.stages:
            for p in stage.params:
                p.grad = None
        self._fwd, self._bwd = fwd_next, bwd_next
        self.steps += 1
        return loss

    def drain(self) -> None:
        """Run steps without new samples until every sample's backward is done."""
        while self._pending():
            self.step()

    def state_dict(self) -> dict[str, Any]:
        """What resumes this trainer bit for bit, with the model's own ``state_dict()``: the
        optimizer's state, the step and sample counts, the stream call counts and adaptive
        scales of the stage graphs. Only a drained pipeline (:meth:`drain`) has one."""
        self._check_drained("save")
        return {
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "samples": self.samples,
            "streams": REGISTRY.streams_state(),
            "adaptive": [state.state_dict() for state in REGISTRY.adaptive_states(self.model)],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (load the model's weights first). Checked whole: a bad
        one raises ``ValueError`` and changes nothing."""
        self._check_drained("load")
        missing = [
            key for key in ("optimizer", "steps", "samples", "streams", "adaptive") if key not in state_dict
        ]
        if missing:
            raise ValueError(
                f"not a PipelinedTrainer state dict: it lacks {missing}, it has {sorted(state_dict)}"
            )
        for key in ("steps", "samples"):
            check_count(f"the state dict's {key!r}", state_dict[key])
        check_streams_state(state_dict["streams"])
        load_adaptive = REGISTRY.adaptive_loader(state_dict["adaptive"], self.model)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.steps, self.samples = int(state_dict["steps"]), int(state_dict["samples"])
        REGISTRY.load_streams_state(state_dict["streams"])
        load_adaptive()

    def _check_drained(self, what: str) -> None:
        if self._pending():
            raise RuntimeError(
                f"cannot {what} the trainer's state while samples are in the pipeline: "
                "call drain() first (their activations and errors are not part of the state)"
            )

    def fit(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        epochs: int = 1,
        *,
        seed: int = 0,
        drain: bool = True,
        callback: Callable[[PipelinedTrainer], None] | None = None,
    ) -> list[float]:
        """Feed ``x``/``y`` one sample per step, in a new random order each epoch.

        ``x`` is a tensor of samples, or a tuple of them for a model with several
        inputs. The pipeline keeps running across epochs (no flush); with ``drain``
        it is emptied at the end. ``callback(trainer)`` runs after every epoch
        (a callback that evaluates the model in ``eval()`` must switch it back to
        ``train()``). Returns the per-sample losses of this call.
        """
        check_count("epochs", epochs)
        inputs = x if isinstance(x, tuple) else (x,)
        if any(len(v) != len(y) for v in inputs):
            sizes = [len(v) for v in inputs]
            raise ValueError(f"x and y must hold as many samples, got {sizes} and {len(y)}")
        order = torch.Generator().manual_seed(seed)
        start = len(self.losses)
        for _ in range(epochs):
            for i in torch.randperm(len(y), generator=order).tolist():
                sample = tuple(v[i : i + 1] for v in inputs)
                self.step(sample if isinstance(x, tuple) else sample[0], y[i : i + 1])
            if callback is not None:
                callback(self)
        if drain:
            self.drain()
        return self.losses[start:]


def _modes(model: nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]


def _slot(param: torch.Tensor) -> nn.Parameter:
    """A weight slot for one in-flight forward; compiled stages key per-model state
    (adaptive loss scales) by the model's own parameter, not by the slot."""
    slot = nn.Parameter(torch.empty_like(param))
    REGISTRY.alias(slot, param)
    return slot
