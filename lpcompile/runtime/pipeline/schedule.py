"""One step of fine-grained pipelined backpropagation over a run of contiguous stages.

:class:`StageRunner` is the per-step stage logic that the single-process simulator
(all S stages in one runner) and the ``torch.distributed`` runner (one runner per
rank, holding its group of contiguous stages) share, so that both compute the same
bits. At step ``t`` it

1. runs the forward of every stage that has an input, first to last: the first
   stage's input comes from outside (the fed sample, or the previous rank's
   activation), the others' from the stage before at step ``t - 1``; the last
   stage's output goes outside (to the next rank) as soon as it exists;
2. runs the backward of every stage that has an error, last to first: the loss
   for the pipeline's last stage, else the error the stage after sent at step
   ``t - 1`` (from outside for the runner's last stage); the first stage's input
   gradients go outside (to the previous rank);
3. steps the optimizer (one param group per stage) and clears the gradients.

What comes from and goes to outside is a :class:`Transport`'s business. Within a
step the stages' computations are independent of each other (each reads only
messages of step ``t - 1`` and its own weights), so their order does not change
the bits. Ops that draw from torch's random generators (dropout) draw from the stage's
own stream (:class:`StageRandom`), whichever process runs the stage.

Messages between stages are conformed to the layout (strides) of the stage graph's
example value before they are handed on, in both runners: a transport rebuilds
each tensor in that layout, and the simulator must hand on the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from lpcompile.backend.state import REGISTRY
from lpcompile.passes.stages import StageGraph
from lpcompile.runtime.pipeline.optim import PipelineSGD
from lpcompile.runtime.pipeline.scaling import ScalesRead, StageScale, back_off_layers, refresh_layers
from lpcompile.runtime.scaler import LossScaleConfig


@dataclass
class Event:
    """One forward or backward of one stage, as :attr:`PipelinedTrainer.history` records it."""

    step: int
    stage: int
    kind: str  # "forward" or "backward"
    sample: int
    forward_step: int  # the step of the forward whose gradient this is (= step for a forward)


@dataclass(frozen=True)
class TensorMeta:
    """Shape, strides and dtype of a value sent between stages (from the stage graph)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)

    @property
    def differentiable(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def dense_order(meta: TensorMeta) -> list[int]:
    """The dimensions from the outermost to the innermost in memory (``meta`` is dense)."""
    return sorted(range(len(meta.shape)), key=lambda d: (-meta.stride[d], -meta.shape[d]))


def _is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Non-overlapping and dense: some permutation of the dimensions is contiguous."""
    dims = sorted((st, size) for size, st in zip(shape, stride, strict=True) if size != 1)
    expected = 1
    for st, size in dims:
        if st != expected:
            return False
        expected *= size
    return True


def message_meta(value: Any) -> TensorMeta | None:
    """The layout a message value is handed on in: the example value's, made contiguous
    where it is not dense (a broadcast or overlapping view); ``None`` for a non-tensor."""
    if not isinstance(value, torch.Tensor):
        return None
    shape, stride = tuple(int(s) for s in value.shape), tuple(int(s) for s in value.stride())
    if not _is_dense(shape, stride):
        stride = _contiguous_strides(shape)
    return TensorMeta(shape, stride, value.dtype)


def stage_input_metas(graph: StageGraph) -> list[TensorMeta | None]:
    """The layouts of what ``graph`` receives, from its placeholders' example values."""
    placeholders = graph.module.graph.find_nodes(op="placeholder")
    values = placeholders[len(graph.state) :]
    return [message_meta(node.meta.get("example_value", node.meta.get("val"))) for node in values]


def conform(value: Any, meta: TensorMeta | None) -> Any:
    """``value`` in the layout of ``meta`` (itself when it already is)."""
    if meta is None or not isinstance(value, torch.Tensor):
        return value
    if tuple(value.stride()) == meta.stride or value.numel() <= 1:
        return value
    out = torch.empty_strided(meta.shape, meta.stride, dtype=value.dtype, device=value.device)
    return out.copy_(value)


class StageRandom:
    """A stage's own stream of torch's random numbers (dropout, ...).

    The stage's forwards and backwards run with its state in the default generators
    (the CPU's, and each CUDA device's the stage runs on) and hand the process's back
    afterwards, so a stage draws the same numbers whichever process runs it and
    whatever stages run beside it: in the simulator as on ranks. Stage ``index``
    starts from a seed derived from ``seed`` and ``index``.
    """

    def __init__(self, seed: int, index: int, devices: Sequence[torch.device] = ()) -> None:
        digest = hashlib.sha256(f"lowprec-stage:{seed}:{index}".encode()).digest()
        start = int.from_bytes(digest[:8], "little") >> 1
        self.devices = [torch.device("cpu"), *sorted({d for d in devices if d.type == "cuda"}, key=str)]
        self.states = [torch.Generator(d).manual_seed(start).get_state() for d in self.devices]

    @contextlib.contextmanager
    def active(self):
        """The stage's stream in place of the process's, for the duration."""
        defaults = [_default_generator(d) for d in self.devices]
        saved = [g.get_state() for g in defaults]
        for g, state in zip(defaults, self.states, strict=True):
            g.set_state(state)
        try:
            yield
        finally:
            self.states = [g.get_state() for g in defaults]
            for g, state in zip(defaults, saved, strict=True):
                g.set_state(state)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(d): state.clone() for d, state in zip(self.devices, self.states, strict=True)}

    def loader(self, saved: Any, index: int) -> Callable[[], None]:
        """A check of ``saved`` (:meth:`state_dict`) now, and its load for later."""
        names = [str(d) for d in self.devices]
        if not isinstance(saved, dict) or sorted(saved) != sorted(names):
            have = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(f"stage {index}'s random state must hold the generators of {names}, got {have}")
        for name, state in zip(names, self.states, strict=True):
            value = saved[name]
            kind = (value.dtype, value.shape) if isinstance(value, torch.Tensor) else None
            if kind != (state.dtype, state.shape):
                raise ValueError(f"stage {index}'s saved {name} random state is not a generator state")

        def load() -> None:
            self.states = [saved[name].clone() for name in names]

        return load


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


@dataclass
class InFlight:
    sample: int
    step: int
    inputs: list[Any]
    outputs: Any
    slots: list[nn.Parameter]
    label: Any = None
    # per adaptive-scaling state of the stage's graphs: the layer scales this forward read
    scales_read: list[ScalesRead] = field(default_factory=list)


@dataclass
class Stage:
    """A stage of the pipeline: its graph, its parameters, its delay and what is in flight."""

    index: int
    delay: int
    graph: StageGraph
    params: list[nn.Parameter]  # the model's trained parameters this stage owns
    runner: Callable  # runner(*state, *inputs) -> outputs
    random: StageRandom
    ring: list[list[torch.Tensor]]  # D+1 state lists: Parameter slots (and buffers) per forward
    trained: list[bool]  # which state entries are slots of trained parameters
    inputs: list[TensorMeta | None] = field(default_factory=list)  # layouts of what it receives
    queue: deque = field(default_factory=deque)
    # what the registry keys the stage's per-model state by where no parameter does (a stage
    # without parameters: its graphs would be keyed by their first input, new at every call);
    # the trainer saves its call counts
    key: torch.Tensor = field(default_factory=REGISTRY.owned_key)


def build_stage(
    graph: StageGraph,
    delay: int,
    state: Sequence[torch.Tensor],
    trained_ids: set[int],
    compile: dict[str, Any] | None,
    random: StageRandom,
) -> Stage:
    """A :class:`Stage` for ``graph``: ``state`` are its parameters and buffers (in the
    graph's order), those in ``trained_ids`` get a ring of ``delay + 1`` weight slots."""
    params = [v for v in state if id(v) in trained_ids]
    runner = graph.module
    if compile is not None:
        # one seed for all ranks: each stage draws the bits it draws in the simulator
        options = {**compile, "seed_per_rank": False}
        runner = torch.compile(graph.module, backend="lowprec", options=options, dynamic=False)
    # per in-flight forward: a Parameter slot per trained weight; buffers as they are
    trained = [id(v) in trained_ids for v in state]
    ring = [[_slot(v) if t else v for v, t in zip(state, trained, strict=True)] for _ in range(delay + 1)]
    metas = stage_input_metas(graph) if graph.index > 0 else []
    return Stage(graph.index, delay, graph, params, runner, random, ring, trained, metas)


def _slot(param: torch.Tensor) -> nn.Parameter:
    """A weight slot for one in-flight forward; compiled stages key per-model state
    (adaptive loss scales, call counts) by the model's own parameter, not by the slot."""
    slot = nn.Parameter(torch.empty_like(param))
    REGISTRY.alias(slot, param)
    return slot


def grad_inputs(values: Sequence[Any], key: torch.Tensor) -> list[Any]:
    """Detached copies of a message; floating tensors become leaves that collect their
    gradient, standing for ``key`` in the registry (the stage's call counts stay with it)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            v = v.detach()
            if v.is_floating_point():
                v.requires_grad_(True)
                REGISTRY.alias(v, key)
        out.append(v)
    return out


# A forward message: (sample, values, label); a backward one: (sample, gradients or None,
# the loss scale they were computed at).
ForwardMessage = tuple[int, list[Any], Any]
BackwardMessage = tuple[int, list[Any], float]


class Transport(Protocol):
    """What crosses the ends of a :class:`StageRunner`'s stages."""

    def begin_step(self, t: int) -> None:
        """Step ``t`` starts (post receives, collect finished sends)."""

    def forward_message(self, t: int) -> ForwardMessage | None:
        """The input of the runner's first stage at step ``t``, if it has one."""

    def backward_message(self, t: int) -> BackwardMessage | None:
        """The error of the runner's last stage at step ``t`` (it is not the pipeline's last)."""

    def send_forward(self, t: int, message: ForwardMessage) -> None:
        """The output of the runner's last stage at step ``t`` (not the pipeline's last)."""

    def send_backward(self, t: int, message: BackwardMessage) -> None:
        """The input gradients of the runner's first stage at step ``t`` (not stage 0)."""


@dataclass
class Timings:
    """Where a runner's steps went (seconds, summed over :attr:`steps`)."""

    steps: int = 0
    step: float = 0.0  # whole steps
    transport: float = 0.0  # in the transport: waiting for messages, packing and posting sends

    @property
    def compute(self) -> float:
        """Stage forwards, backwards and the optimizer step."""
        return self.step - self.transport

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "step_s": self.step,
            "transport_s": self.transport,
            "compute_s": self.compute,
        }


class StageRunner:
    """Runs contiguous stages of a pipeline of ``num_stages`` for one step at a time (module doc)."""

    def __init__(
        self,
        stages: list[Stage],
        num_stages: int,
        optimizer: PipelineSGD,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        loss_scale: LossScaleConfig | None,
        adaptive: bool,
        weight_stash: bool,
        record: bool,
        history: list[Event],
        losses: list[float],
        next_inputs: list[TensorMeta | None] | None = None,
    ) -> None:
        self.stages = stages
        # the layouts of what the stage after the runner's last receives (another rank's)
        self.next_inputs = next_inputs or []
        self.num_stages = num_stages
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        #: per stage: its loss scale (``None``: not scaled, gradients not checked)
        self.scales = [None if loss_scale is None else StageScale(loss_scale) for _ in stages]
        if adaptive and loss_scale is None:
            raise ValueError("stages with per-layer adaptive scales check their gradients: give a loss_scale")
        #: whether the stages are compiled with per-layer adaptive loss scaling: their layers
        #: back off after an overflow that ``loss_scale``'s checks find
        self.adaptive = adaptive
        self.weight_stash = weight_stash
        self.record = record
        self.history = history
        self.losses = losses
        self.timings = Timings()
        n = len(stages)
        # messages between the runner's own stages, for the next step
        self._fwd: list[ForwardMessage | None] = [None] * n
        self._bwd: list[BackwardMessage | None] = [None] * n

    def pending(self) -> int:
        """Samples held by the runner's stages (in flight, or as messages between them)."""
        return (
            sum(len(s.queue) for s in self.stages)
            + sum(m is not None for m in self._fwd)
            + sum(m is not None for m in self._bwd)
        )

    @contextlib.contextmanager
    def _timed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings.transport += time.perf_counter() - start

    # -- one stage ----------------------------------------------------------------------

    def _forward(self, stage: Stage, sample: int, values: list[Any], label: Any, t: int) -> InFlight:
        state = stage.ring[t % len(stage.ring)]
        slots = [v for v, t in zip(state, stage.trained, strict=True) if t]
        with torch.no_grad():
            for slot, p in zip(slots, stage.params, strict=True):
                slot.data.copy_(self.optimizer.predicted_weight(p))
                slot.grad = None
        inputs = values if stage.index == 0 else grad_inputs(values, stage.key)
        calls = {id(s): s.calls for s in REGISTRY.adaptive_states()} if self.adaptive else {}
        with torch.enable_grad(), stage.random.active():
            outputs = stage.runner(*state, *inputs)
        if self.record:
            self.history.append(Event(t, stage.index, "forward", sample, t))
        # the states of the graphs this forward ran (their call counts moved, or they are new).
        # The call refreshed nothing (_backward does, after each sample): the scales and the
        # calibrating flag are what it read, and it was the state's last call
        read = [
            ScalesRead(s, s.scales, s.calibrating, s.calls - 1, s.rounds)
            for s in (REGISTRY.adaptive_states() if self.adaptive else [])
            if calls.get(id(s)) != s.calls
        ]
        return InFlight(sample, t, inputs, outputs, slots, label, read)

    def _backward(
        self, i: int, item: InFlight, grads: Sequence[Any] | None, sent_at: float, t: int
    ) -> tuple[list[Any], float]:
        """Stage ``i``'s backward of ``item``, from the loss (``grads`` ``None``) or from an
        error computed at loss scale ``sent_at``; returns its input gradients (all ``None``
        for an update skipped here or after) and the scale they were computed at."""
        stage, scale = self.stages[i], self.scales[i]
        if not self.weight_stash and stage.delay > 0:
            with torch.no_grad():
                for slot, p in zip(item.slots, stage.params, strict=True):
                    slot.data.copy_(p.detach())  # the current weights; no version bump
        used = 1.0 if scale is None else scale.value
        if grads is None:  # last stage: the loss
            outputs = item.outputs
            output = outputs[0] if isinstance(outputs, tuple) and len(outputs) == 1 else outputs
            with stage.random.active():
                loss = self.loss_fn(output, item.label)
            self.losses.append(loss.item())
            tensors = [loss * used if used != 1.0 else loss]
            grad_tensors: list[Any] = [None]
        else:
            if scale is not None:
                grads = scale.rescale(grads, sent_at)
            pairs = [
                (o, g)
                for o, g in zip(item.outputs, grads, strict=True)
                if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
            ]
            tensors = [o for o, _ in pairs]
            grad_tensors = [g for _, g in pairs]
        if tensors:
            with stage.random.active():
                torch.autograd.backward(tensors, grad_tensors)
        inputs = [v for v in item.inputs if isinstance(v, torch.Tensor) and v.requires_grad]
        skipped = bool(tensors) and scale is not None and scale.unscale(item.slots, inputs)
        if tensors and self.adaptive:
            back_off_layers(item.scales_read, item.slots, stage.params, skipped)
            if refresh_layers(item.scales_read) and not skipped:
                scale.skip_calibrating()
                skipped = True
        for slot, p in zip(item.slots, stage.params, strict=True):
            p.grad = None if skipped else slot.grad
            slot.grad = None
        if self.record:
            self.history.append(Event(t, stage.index, "backward", item.sample, item.step))
        grads_in = [
            v.grad if isinstance(v, torch.Tensor) and v.requires_grad and not skipped else None
            for v in item.inputs
        ]
        metas = stage.inputs or [None] * len(grads_in)
        return [conform(g, m) for g, m in zip(grads_in, metas, strict=True)], used

    def warm_up(self, first_inputs: Sequence[Any]) -> None:
        """Compile the stages, forward and backward, with one call each on stand-in inputs
        (``first_inputs`` for stage 0, zeros in the received layouts for the others).

        A compiled stage otherwise compiles at its first forward and backward, in the
        middle of a run, where a rank's neighbours would wait for it. The calls leave no
        trace (:meth:`Registry.unrecorded`; torch's random state is restored), and the
        backward is compiled with the forward (AOT autograd's
        ``force_non_lazy_backward_lowering``), so no backward call is needed.
        """
        from torch._functorch import config as functorch_config

        devices = sorted({p.device for stage in self.stages for p in stage.params if p.is_cuda}, key=str)
        with (
            REGISTRY.unrecorded(),
            torch.random.fork_rng(devices=devices),
            functorch_config.patch(force_non_lazy_backward_lowering=True),
        ):
            for stage in self.stages:
                if stage.index == 0:
                    inputs = list(first_inputs)
                elif any(m is None for m in stage.inputs):
                    continue  # a value that is not a tensor: no stand-in; it compiles at its first call
                else:
                    device = next((p.device for p in stage.params), None) or _device_of(first_inputs)
                    inputs = grad_inputs([_zeros(m, device) for m in stage.inputs], stage.key)
                state = stage.ring[0]
                slots = [v for v, t in zip(state, stage.trained, strict=True) if t]
                with torch.no_grad():
                    for slot, p in zip(slots, stage.params, strict=True):
                        slot.data.copy_(p.detach())
                with torch.enable_grad():
                    stage.runner(*state, *inputs)
                for slot in slots:
                    slot.grad = None

    # -- one step ----------------------------------------------------------------------

    def step(self, t: int, transport: Transport) -> float | None:
        """Step ``t`` of the runner's stages; returns the loss of the sample that finished
        at the pipeline's last stage, if it is one of them and a sample reached it."""
        start = time.perf_counter()
        last = self.num_stages - 1
        n = len(self.stages)
        fwd_next: list[ForwardMessage | None] = [None] * n
        bwd_next: list[BackwardMessage | None] = [None] * n
        loss = None
        forwarded_last = False
        with self._timed():
            transport.begin_step(t)
            incoming = transport.forward_message(t)
        for i, stage in enumerate(self.stages):
            message = self._fwd[i] if i > 0 else incoming
            if message is None:
                continue
            sample, values, label = message
            item = self._forward(stage, sample, values, label, t)
            stage.queue.append(item)
            if stage.index == last:
                forwarded_last = True
                continue
            following = self.stages[i + 1].inputs if i + 1 < n else self.next_inputs
            outs = [
                conform(o.detach(), m) if isinstance(o, torch.Tensor) else o
                for o, m in zip(item.outputs, following, strict=True)
            ]
            if i + 1 < n:
                fwd_next[i + 1] = (sample, outs, label)
            else:
                with self._timed():
                    transport.send_forward(t, (sample, outs, label))
        for i in reversed(range(n)):
            stage = self.stages[i]
            if stage.index == last:
                if not forwarded_last:
                    continue
                item = stage.queue.popleft()
                grads_in, used = self._backward(i, item, None, 1.0, t)
                loss = self.losses[-1]
                sample = item.sample
            else:
                if i < n - 1:
                    message = self._bwd[i]
                else:
                    with self._timed():
                        message = transport.backward_message(t)
                if message is None:
                    continue
                sample, grads, sent_at = message
                item = stage.queue.popleft()
                if item.sample != sample:
                    raise RuntimeError(
                        f"stage {stage.index}: error of sample {sample} met forward of sample {item.sample}"
                    )
                grads_in, used = self._backward(i, item, grads, sent_at, t)
            if stage.index == 0:
                continue
            if i > 0:
                bwd_next[i - 1] = (sample, grads_in, used)
            else:
                with self._timed():
                    transport.send_backward(t, (sample, grads_in, used))
        self.optimizer.step()
        for stage in self.stages:
            for p in stage.params:
                p.grad = None
        self._fwd, self._bwd = fwd_next, bwd_next
        self.timings.steps += 1
        self.timings.step += time.perf_counter() - start
        return loss


def _device_of(values: Sequence[Any]) -> torch.device:
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))


def _zeros(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device).zero_()
