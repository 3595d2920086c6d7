"""Fine-grained pipelined backpropagation, simulated in one process or run on ranks.

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

The per-step stage logic is :class:`~lpcompile.runtime.pipeline.schedule.StageRunner`'s.
In the simulator one runner holds every stage. With ``distributed=True`` each rank of
a ``torch.distributed`` process group (``torchrun --nproc_per_node=R``, R dividing S)
builds the same stage graphs and runs a runner with its ``S/R`` contiguous stages;
activations and errors cross between ranks as point-to-point messages
(:mod:`lpcompile.runtime.pipeline.distributed`), on the same schedule, so the ranks
compute the simulator's bits. :meth:`PipelinedTrainer.full_state_dict` gathers the
whole model onto every rank (in the simulator: a copy of the model's).

Checkpoints: after :meth:`PipelinedTrainer.drain`, the model's ``state_dict()``
and :meth:`PipelinedTrainer.state_dict` (the optimizer's state, the step and
sample counts, and the stages' stream call counts and adaptive scales) resume the
run bit for bit in a new trainer; distributed, each rank's state dict also holds its
stages' weights and is loaded by the same rank of a run with the same world size.

Loss scaling is per stage (:mod:`lpcompile.runtime.pipeline.scaling`): each stage
keeps its own static, dynamic or enhanced scale and skips its update for a sample whose
gradients overflowed in it; stages compiled with per-layer adaptive scaling also back
off the layers that overflowed, and skip the samples quantized at scales still calibrating.

Random numbers (dropout, ...): each stage draws from a stream of its own
(:class:`~lpcompile.runtime.pipeline.schedule.StageRandom`), seeded from ``seed`` and
the stage's index, so ranks and simulator draw the same; the streams travel in
:meth:`PipelinedTrainer.state_dict`.

Not done: BatchNorm (refused).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lpcompile.backend.distributed import TRACES_THROUGH_LOWPREC
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
from lpcompile.runtime.pipeline.scaling import StageScale, loss_scale_config
from lpcompile.runtime.pipeline.schedule import (
    Event,
    ForwardMessage,
    Stage,
    StageRandom,
    StageRunner,
    build_stage,
    stage_input_metas,
)
from lpcompile.runtime.scaler import LossScaleConfig

__all__ = ["Event", "PipelinedTrainer", "Stage", "capture_graph"]


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

    setattr(backend, TRACES_THROUGH_LOWPREC, True)  # (a block compiled with lowprec is the model's)

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
        compile: ``None`` (stages run as eager FX) or lowprec ``options`` to compile each
            stage; compiled stages are compiled (forward and backward) when the trainer is built.
        loss_scale: per-stage loss scaling (:mod:`~lpcompile.runtime.pipeline.scaling`): a
            mode of :class:`~lpcompile.runtime.scaler.LossScaleConfig` (``"dynamic"``,
            ``"enhanced"``, ``"static"``) by its name (its defaults) or as a config, or a
            number, a static scale. Every stage starts at the config's ``init_scale``,
            unscales its gradients and skips its update for a sample whose gradients
            overflowed in it. The default 1.0 scales nothing and checks nothing, except
            in stages compiled with per-layer adaptive scaling (``compile`` with
            ``loss_scale="adaptive"``), which always check, back off their layers, and
            skip the samples whose errors were quantized at scales still calibrating.
        record: keep :attr:`history` (one :class:`Event` per forward and backward).
        distributed: run the stages on the ranks of a ``torch.distributed`` process group
            (``torchrun --nproc_per_node=R``; the group is initialised from torchrun's
            environment unless it already is: gloo on CPUs, NCCL on CUDA, each rank on
            ``cuda:LOCAL_RANK``). R must divide S; rank r runs the S/R contiguous stages
            from ``r*S/R``. Every rank builds the trainer with the same model (same seed),
            example input and arguments, and calls :meth:`step` with the same arguments.
        seed: the seed of the stages' random streams (dropout, ...; each stage draws from
            its own, derived from ``seed`` and its index). ``None``: torch's
            ``initial_seed()``, the seed of the last ``torch.manual_seed``. Distributed,
            every rank must use the same (checked at start-up).
        timeout: seconds a rank waits for a neighbour's message before it stops with
            :class:`~lpcompile.runtime.pipeline.distributed.LostRankError` naming the
            rank lost (distributed only).
        setup_timeout: seconds for building the trainer on every rank (joining the
            process group, compiling the stages) (distributed only).
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
        loss_scale: float | str | LossScaleConfig = 1.0,
        record: bool = False,
        distributed: bool = False,
        seed: int | None = None,
        timeout: float = 300.0,
        setup_timeout: float = 1800.0,
    ) -> None:
        for name, module in model.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                raise ValueError(f"{BATCHNORM_ADVICE} (found {type(module).__name__} {name!r})")
        if compile is not None:
            if "pipeline" in compile:
                raise ValueError(
                    "compile options for the stages must not set 'pipeline': the trainer is the pipeline"
                )
            # bad options fail here, not at the first step
            adaptive = LowPrecConfig.from_options(compile).loss_scale == "adaptive"
        else:
            adaptive = False
        scaling = loss_scale_config(loss_scale)
        for name, value in (("weight_stash", weight_stash), ("distributed", distributed)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if seed is None:
            seed = torch.initial_seed()
        check_count("seed", seed)
        check_positive("timeout", timeout)
        check_positive("setup_timeout", setup_timeout)
        example = example_input if isinstance(example_input, tuple) else (example_input,)
        batches = [v.shape[0] for v in example if isinstance(v, torch.Tensor) and v.dim() > 0]
        if any(b != 1 for b in batches):
            raise ValueError(
                f"example_input must be one sample (batch dimension 1), got batch sizes {batches}: "
                "pipelined backpropagation feeds one sample per step"
            )
        ranks = None
        if distributed:
            from lpcompile.runtime.pipeline.distributed import Ranks

            ranks = Ranks.from_environment()
            if isinstance(stages, int) and not isinstance(stages, bool) and stages >= 1:
                ranks.stages(stages)  # a world size that does not fit: refused before anything runs
            if ranks.device.type == "cuda":
                model.to(ranks.device)
                example = tuple(v.to(ranks.device) if isinstance(v, torch.Tensor) else v for v in example)
        self.model = model
        self.loss_fn = loss_fn
        self.weight_stash = weight_stash
        #: the stages' loss scaling (``None``: none)
        self.loss_scale_config = scaling
        self.record = record
        self.distributed = distributed
        self.timeout = float(timeout)
        # the stage graphs hold the train()/eval() behaviour of the capture (dropout, ...)
        self._modes = _modes(model)
        # what step() checks each sample against: the graph is traced for these shapes
        self._example_shapes = [getattr(v, "shape", None) for v in example]
        gm = capture_graph(model, *example)
        self.partition: Partition = partition_graph(gm, stages)
        self.graph = gm
        num_stages = self.partition.num_stages
        self.delays = stage_delays(num_stages)
        graphs = split_pipeline(gm)
        self._positions = graphs[0].positions  # the model's arguments stage 0 reads
        local = range(num_stages) if ranks is None else ranks.stages(num_stages)
        #: this process's rank and the number of ranks (0 and 1 in the simulator)
        self.rank, self.world_size = (0, 1) if ranks is None else (ranks.rank, ranks.world_size)
        trained = {id(p): p for p in model.parameters() if p.requires_grad}
        placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
        if ranks is not None:
            _check_messages(graphs, local)
            _check_ranks_train(graphs, placeholders, trained, len(local))
            agreed = {"loss_scale": repr(scaling), "seed": seed}
            ranks.join(setup_timeout, {**_summary(self.partition, graphs), **agreed})
        #: the stages this process runs (all of them in the simulator)
        self.stages: list[Stage] = []
        for index in local:
            graph = graphs[index]
            state = [placeholders[name].meta[KEPT_GRAPHARG].example for name in graph.state]
            devices = [v.device for v in (*state, *example) if isinstance(v, torch.Tensor)]
            random = StageRandom(seed, index, devices)
            self.stages.append(build_stage(graph, self.delays[index], state, set(trained), compile, random))
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
        self.losses: list[float] = []  # per sample, in the order they finished (the last stage's rank)
        self.history: list[Event] = []
        self._last_fed: int | None = None  # the step that fed the newest sample
        following = stage_input_metas(graphs[local.stop]) if local.stop < num_stages else None
        self._runner = StageRunner(
            self.stages,
            num_stages,
            self.optimizer,
            loss_fn=loss_fn,
            # adaptive stages check their gradients unscaled when not scaled per stage
            loss_scale=LossScaleConfig("static", init_scale=1.0) if adaptive and scaling is None else scaling,
            adaptive=adaptive,
            weight_stash=weight_stash,
            record=record,
            history=self.history,
            losses=self.losses,
            next_inputs=following,
        )
        if compile is not None:
            first_inputs = [example[i] for i in graphs[0].positions]
            self._runner.warm_up(first_inputs)
        self._ranks = ranks
        self._transport: Any
        if ranks is None:
            self._transport = _Feed()
        else:
            from lpcompile.runtime.pipeline.distributed import P2PTransport

            self._transport = P2PTransport(
                ranks,
                local.start,
                len(local),
                num_stages,
                self.stages[0].inputs,
                following or [],
                self.timeout,
            )
            ranks.barrier(setup_timeout)

    @property
    def num_stages(self) -> int:
        """S, the pipeline's stages (on every rank; :attr:`stages` holds this process's)."""
        return self.partition.num_stages

    @property
    def loss_scales(self) -> dict[int, float]:
        """Per stage this process runs (by index): the loss scale its next backward runs at
        (1.0 without scaling)."""
        return {index: 1.0 if scale is None else scale.value for index, scale in self._scales().items()}

    @property
    def skipped_samples(self) -> dict[int, int]:
        """Per stage this process runs: the samples whose update it skipped because its
        gradients overflowed, or its adaptive scales calibrated (:attr:`calibration_samples`);
        a stage before it skips those too, uncounted."""
        return {index: 0 if scale is None else scale.skipped for index, scale in self._scales().items()}

    @property
    def calibration_samples(self) -> dict[int, int]:
        """Per stage this process runs: of :attr:`skipped_samples`, those skipped because
        the stage's per-layer adaptive scales they were quantized at were still calibrating."""
        return {index: 0 if scale is None else scale.calibration for index, scale in self._scales().items()}

    def _scales(self) -> dict[int, StageScale | None]:
        """The loss scales of this process's stages, by stage index."""
        return {stage.index: scale for stage, scale in zip(self.stages, self._runner.scales, strict=True)}

    @property
    def timings(self) -> dict[str, float]:
        """This process's steps so far: their number and seconds in all (``step_s``), in the
        messages between ranks (``transport_s``: waiting, packing, posting) and in the
        stages (``compute_s``: forwards, backwards, optimizer). Host clock: on CUDA the
        split shows where the host waited, not where the device worked."""
        return self._runner.timings.as_dict()

    def _pending(self) -> bool:
        """Whether a sample is still in the pipeline (on any rank): the newest one's
        backward reaches stage 0 ``2(S-1)`` steps after it was fed."""
        return self._last_fed is not None and self.steps <= self._last_fed + 2 * (self.num_stages - 1)

    # -- the pipeline -------------------------------------------------------------------

    def step(self, x: Any = None, y: Any = None) -> float | None:
        """One pipeline step, feeding the sample ``(x, y)`` (``x=None``: nothing new, to drain).

        ``x`` is one sample with its batch dimension of 1 (or a tuple of the
        model's inputs). Returns the loss of the sample that reached the last
        stage at this step, if any (distributed: on the rank of the last stage;
        ``None`` on the others). Distributed, every rank calls it with the same
        arguments: the first rank reads ``x``, the last ``y``.
        """
        if _modes(self.model) != self._modes:
            raise RuntimeError(
                "the model's train()/eval() modes changed since the trainer traced it; its stage "
                "graphs keep the traced behaviour (dropout, ...): switch the modes back (e.g. "
                "model.train() after evaluating) or build a new trainer"
            )
        t = self.steps
        message = None
        if x is not None:
            args = list(x) if isinstance(x, tuple) else [x]
            shapes = [getattr(v, "shape", None) for v in args]
            if shapes != self._example_shapes:
                raise ValueError(
                    f"the model was traced for inputs of shapes {self._example_shapes}, got {shapes}: "
                    "each step feeds one sample shaped as example_input (batch dimension 1)"
                )
            message = (self.samples, [args[i] for i in self._positions], y)
            self.samples += 1
            self._last_fed = t
        self._transport.feed(t, message)
        loss = self._runner.step(t, self._transport)
        self.steps += 1
        return loss

    def drain(self) -> None:
        """Run steps without new samples until every sample's backward is done."""
        while self._pending():
            self.step()
        self._transport.flush()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict()``, as CPU copies, with every stage's current
        weights: distributed, each rank's stages' parameters are gathered onto every rank
        (every rank must call it, at the same step)."""
        entries = self.model.state_dict(keep_vars=True)
        if self._ranks is None:
            return {name: value.detach().to("cpu", copy=True) for name, value in entries.items()}
        self._transport.flush()
        owned = {id(p) for stage in self.stages for p in stage.params}
        names = {id(p): name for name, p in self.model.named_parameters()}
        gathered = self._ranks.gather({names[id(p)]: p for p in self.model.parameters() if id(p) in owned})
        return {
            name: gathered[names[id(value)]]
            if names.get(id(value)) in gathered
            else value.detach().to("cpu", copy=True)
            for name, value in entries.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """What resumes this trainer bit for bit, with the model's own ``state_dict()``: the
        optimizer's state, the step and sample counts, the stages' loss scales and random
        streams, the stream call counts and adaptive scales of the stage graphs. Only a
        drained pipeline (:meth:`drain`) has one.

        Distributed, each rank's holds its own stages and also their weights (``"params"``,
        by the model's parameter names) and where they sit (``"placement"``): save one per
        rank, load each into the rank that saved it (same world size and stages)."""
        self._check_drained("save")
        state = {
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "samples": self.samples,
            "streams": REGISTRY.streams_state(),
            "adaptive": [state.state_dict() for state in self._adaptive_states()],
            "loss_scales": {
                index: scale.state_dict() for index, scale in self._scales().items() if scale is not None
            },
            "random": {stage.index: stage.random.state_dict() for stage in self.stages},
            "stage_streams": {stage.index: REGISTRY.steps_state(stage.key) for stage in self.stages},
        }
        if self._ranks is not None:
            state["params"] = {name: p.detach().clone() for name, p in self._owned_parameters()}
            state["placement"] = self._placement()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (simulator: load the model's weights first; distributed,
        the rank's weights come with it). Checked whole: a bad one raises ``ValueError``
        and changes nothing."""
        self._check_drained("load")
        keys = ("optimizer", "steps", "samples", "streams", "adaptive", "random")
        missing = [key for key in keys if key not in state_dict]
        if self._ranks is not None:
            missing += [key for key in ("params", "placement") if key not in state_dict]
        if missing:
            raise ValueError(
                f"not a PipelinedTrainer state dict: it lacks {missing}, it has {sorted(state_dict)}"
            )
        for key in ("steps", "samples"):
            check_count(f"the state dict's {key!r}", state_dict[key])
        check_streams_state(state_dict["streams"])
        load_params = None
        if self._ranks is not None:
            if state_dict["placement"] != self._placement():
                raise ValueError(
                    f"the state dict was saved by a rank placed at {state_dict['placement']}, this one is "
                    f"at {self._placement()}: load each rank's state into the rank that saved it, with "
                    "the same world size and stages"
                )
            load_params = self._params_loader(state_dict["params"])
        load_scales = self._scales_loader(state_dict.get("loss_scales", {}))
        load_random = self._random_loader(state_dict["random"])
        load_stage_streams = self._stage_streams_loader(state_dict.get("stage_streams"))
        load_adaptive = REGISTRY.adaptive_loader(state_dict["adaptive"], self._adaptive_model())
        self.optimizer.load_state_dict(state_dict["optimizer"])  # (checked before it loads)
        if load_params is not None:
            load_params()  # before the streams: the saved counts find their model by its weights
        self.steps, self.samples = int(state_dict["steps"]), int(state_dict["samples"])
        self._last_fed = None
        REGISTRY.load_streams_state(state_dict["streams"])
        load_adaptive()
        for load in (*load_scales, *load_random, *load_stage_streams):
            load()

    def _stage_streams_loader(self, saved: Any) -> list[Callable[[], None]]:
        """What loads the call counts the stages' own keys hold (stages without parameters);
        from a state dict saved before it held them, what restarts those counts."""
        if saved is None:
            return [functools.partial(REGISTRY.load_steps_state, stage.key, []) for stage in self.stages]
        indices = self._check_by_stage(saved, "stage_streams", "the call counts")
        for index in indices:
            try:
                check_streams_state([{"model": "", "steps": saved[index]}])
            except ValueError as error:
                raise ValueError(f"the state dict's 'stage_streams' of stage {index}: {error}") from None
        return [
            functools.partial(REGISTRY.load_steps_state, stage.key, saved[stage.index])
            for stage in self.stages
        ]

    def _check_by_stage(self, saved: Any, key: str, what: str) -> list[int]:
        """This process's stage indices, which the state dict's ``key`` (``what`` of each
        stage) must have as its keys; else ``ValueError``."""
        indices = [stage.index for stage in self.stages]
        if not isinstance(saved, dict) or sorted(saved) != indices:
            have = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(
                f"the state dict's {key!r} must hold {what} of stages {indices}, it holds {have}"
            )
        return indices

    def _random_loader(self, saved: Any) -> list[Callable[[], None]]:
        self._check_by_stage(saved, "random", "the random streams")
        return [stage.random.loader(saved[stage.index], stage.index) for stage in self.stages]

    def _scales_loader(self, saved: Any) -> list[Callable[[], None]]:
        scaled = {index: scale for index, scale in self._scales().items() if scale is not None}
        if self.loss_scale_config is None and saved == {}:
            return []  # adaptive stages' checks scale nothing: only their counts, which restart
        if not isinstance(saved, dict) or set(saved) != set(scaled):
            have = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(
                f"the state dict's 'loss_scales' must hold the loss scales of stages {sorted(scaled)} "
                f"(this trainer's loss_scale={self.loss_scale_config}), it holds stages {have}"
            )
        return [scale.loader(saved[index], index) for index, scale in scaled.items()]

    def _owned_parameters(self) -> list[tuple[str, nn.Parameter]]:
        owned = {id(p) for stage in self.stages for p in stage.params}
        return [(name, p) for name, p in self.model.named_parameters() if id(p) in owned]

    def _placement(self) -> dict[str, int]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "num_stages": self.num_stages,
            "first_stage": self.stages[0].index,
        }

    def _params_loader(self, saved: Any) -> Callable[[], None]:
        owned = dict(self._owned_parameters())
        if not isinstance(saved, dict) or set(saved) != set(owned):
            have = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(f"the state dict's 'params' must be this rank's {sorted(owned)}, got {have}")
        for name, p in owned.items():
            value = saved[name]
            if not isinstance(value, torch.Tensor) or value.shape != p.shape or value.dtype != p.dtype:
                raise ValueError(
                    f"the saved {name!r} is not a {p.dtype} tensor of shape {tuple(p.shape)}: "
                    f"{getattr(value, 'dtype', type(value).__name__)} {tuple(getattr(value, 'shape', ()))}"
                )

        def load() -> None:
            with torch.no_grad():
                for name, p in owned.items():
                    p.copy_(saved[name])

        return load

    def _adaptive_model(self) -> nn.Module:
        """What owns this process's adaptive states: the model, or (distributed) its stages."""
        if self._ranks is None:
            return self.model
        holder = nn.Module()
        holder.params = nn.ParameterList([p for stage in self.stages for p in stage.params])
        return holder

    def _adaptive_states(self) -> list[Any]:
        return REGISTRY.adaptive_states(self._adaptive_model())

    def _check_drained(self, what: str) -> None:
        if self._pending():
            raise RuntimeError(
                f"cannot {what} the trainer's state while samples are in the pipeline: "
                "call drain() first (their activations and errors are not part of the state)"
            )
        self._transport.flush()

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
        ``train()``). Returns the per-sample losses of this call (distributed: on the
        rank of the last stage). Distributed, every rank calls it with the same data.
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


class _Feed:
    """The simulator's transport: the sample fed at this step enters stage 0; nothing
    else crosses (its runner holds every stage)."""

    def __init__(self) -> None:
        self._message: ForwardMessage | None = None

    def feed(self, t: int, message: ForwardMessage | None) -> None:
        self._message = message

    def begin_step(self, t: int) -> None:
        pass

    def forward_message(self, t: int) -> ForwardMessage | None:
        return self._message

    def flush(self) -> None:
        pass


def _check_ranks_train(
    graphs: Sequence[StageGraph],
    placeholders: dict[str, torch.fx.Node],
    trained: dict[int, Any],
    per_rank: int,
) -> None:
    """Distributed: refuse, on every rank before joining, stages placed so that a rank's
    (``per_rank`` of them each) hold no trained parameter (its optimizer would have none)."""
    world = len(graphs) // per_rank

    def trains(graph: StageGraph) -> bool:
        return any(id(placeholders[name].meta[KEPT_GRAPHARG].example) in trained for name in graph.state)

    idle = [r for r in range(world) if not any(map(trains, graphs[r * per_rank : (r + 1) * per_rank]))]
    if idle:
        stages = [list(range(r * per_rank, (r + 1) * per_rank)) for r in idle]
        raise ValueError(
            f"ranks {idle} would run stages {stages}, which hold no trained parameter: place the "
            "boundaries so that each rank's stages hold one, or run fewer ranks"
        )


def _check_messages(graphs: Sequence[StageGraph], local: range) -> None:
    """Distributed: what crosses between ranks must be tensors (sent point to point)."""
    for boundary in (local.start, local.stop):
        if 0 < boundary < len(graphs):
            graph = graphs[boundary]
            metas = stage_input_metas(graph)
            bad = [name for name, meta in zip(graph.inputs, metas, strict=True) if meta is None]
            if bad:
                raise ValueError(
                    f"stage {boundary} receives {bad} from stage {boundary - 1}, which are not tensors: "
                    "only tensors cross between ranks; move the stage boundary (pipe_split) so that "
                    "they do not cross it"
                )


def _summary(partition: Partition, graphs: Sequence[StageGraph]) -> dict[str, Any]:
    """What every rank's pipeline must agree on."""
    return {
        "stages": partition.num_stages,
        "source": partition.source,
        "costs": list(partition.costs),
        "messages": [[str(m) for m in stage_input_metas(g)] for g in graphs[1:]],
    }


def _modes(model: nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]
