"""Loss scaling with the ``torch.amp.GradScaler`` interface.

:class:`LossScaler` multiplies the loss by a scale before ``backward`` so that
small gradients survive low-precision formats, checks the gradients for
inf/NaN, unscales them, skips the optimizer step when any is non-finite, and
updates the scale. Modes (:data:`MODES`):

* ``"static"``: a fixed scale; steps with non-finite gradients are still skipped.
* ``"dynamic"``: ``GradScaler``'s rule: multiply the scale by ``backoff_factor``
  (and skip) on overflow, by ``growth_factor`` after ``growth_interval``
  consecutive clean steps.
* ``"enhanced"``: Mellempudi et al. 2019: dynamic, but the scale never falls
  below ``min_scale``; ``min_scale_schedule={iteration: new_min}`` raises the
  floor during training (FP8's short subnormal range punishes a scale that
  collapsed after a spurious overflow). ``iteration`` counts ``update()`` calls.
* ``"adaptive"``: for models compiled with ``loss_scale="adaptive"`` (per-layer
  scales in the graph, Zhao et al. 2019). The loss itself is not scaled
  (``init_scale`` defaults to 1); steps with non-finite gradients are skipped
  and ``update`` halves the scale of each layer whose gradients overflowed,
  among the models whose parameters the stepped optimizers hold (two models
  with their own scalers do not back off each other's layers). Until a model's
  scales have been set from its gradient statistics (the first call, and any
  refreshes after it that still raise a scale by more than a binade), its steps
  are skipped as well: their errors were quantized at scales that flush or, with
  stochastic rounding, blow up the small ones (``calibration_steps`` counts them).
  ``state_dict`` carries the per-layer scales and telemetry (of every compiled model).

``state_dict`` also carries the call counts that seed stochastic rounding in every
compiled model (``"streams"``), so that model, optimizer and scaler state dicts
resume a run bit for bit; a state dict without them (a ``GradScaler``'s) warns, at
the first stochastically rounded call, that the streams restart.

Usage is ``GradScaler``'s::

    scaler = LossScaler("enhanced", min_scale=2.0**10)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)            # optional, e.g. before gradient clipping
    scaler.step(opt)
    scaler.update()

Data and pipeline parallelism (DDP, FSDP2, ``torch.distributed.pipelining``): with
``process_group="auto"`` (the default) and ``torch.distributed`` initialized with more
than one rank, the scaler agrees with the other ranks of that group (the whole world by
default): the inf/NaN flag is all-reduced before the skip decision, so an overflow on
one rank skips the step on every rank. In ``"adaptive"`` mode the ranks also skip the
steps any of them calibrates on together, and each adaptive state (one per set of layers,
whichever of its graphs a rank ran) sums its gradient statistics, in :meth:`step`, over
the ranks whose states have the same layer names (a stage's data-parallel replicas: the
whole group under plain data parallelism, a process group made for them under pipeline
stages) before choosing scales, and backs off a layer that overflowed on any of them, so
replicas scale each layer alike. Pipeline stages without the loss need not call
:meth:`scale`. Pass a group to agree within it, or ``None`` to decide per rank.

Optimizers that set ``_step_supports_amp_scaling`` (torch's fused optimizers,
:class:`lpcompile.runtime.optim.MasterWeightOptimizer`) unscale and skip by themselves:
``step`` hands them ``optimizer.grad_scale`` and ``optimizer.found_inf``, as
``GradScaler`` does.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from lpcompile.backend.adaptive import AdaptiveScaleState, back_off_states
from lpcompile.backend.state import REGISTRY, check_streams_state
from lpcompile.numerics.checks import check_count, check_fp32_scale, is_real

MODES = ("static", "dynamic", "enhanced", "adaptive")


@dataclass(frozen=True)
class LossScaleConfig:
    """Validated loss-scaling settings; see the module docstring for the modes.

    ``min_scale`` and ``min_scale_schedule`` apply to ``"enhanced"`` only
    (``min_scale`` defaults to 1.0 there; the scale starts at
    ``max(init_scale, min_scale_at(0))``). ``growth_factor``,
    ``backoff_factor`` and ``growth_interval`` are ignored by ``"static"``.
    """

    mode: str = "dynamic"
    init_scale: float | None = None  # 2**16, or 1 in "adaptive" mode
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = None
    min_scale_schedule: Mapping[int, float] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"loss scaling mode must be one of {MODES}, got {self.mode!r}")
        if self.init_scale is None:
            object.__setattr__(self, "init_scale", 1.0 if self.mode == "adaptive" else 2.0**16)
        check_fp32_scale("init_scale", self.init_scale)
        growth = self.growth_factor
        if not (is_real(growth) and math.isfinite(growth) and growth > 1.0):
            raise ValueError(f"growth_factor must be a finite number > 1, got {growth!r}")
        if not (is_real(self.backoff_factor) and 0.0 < self.backoff_factor < 1.0):
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int):
            raise ValueError(f"growth_interval must be an int >= 1, got {self.growth_interval!r}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {self.growth_interval!r}")
        if self.mode != "enhanced":
            for name in ("min_scale", "min_scale_schedule"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} applies to mode='enhanced' only, not {self.mode!r}")
            return
        if self.min_scale is None:
            object.__setattr__(self, "min_scale", 1.0)
        check_fp32_scale("min_scale", self.min_scale)
        schedule = dict(sorted((int(k), float(v)) for k, v in (self.min_scale_schedule or {}).items()))
        floor = self.min_scale
        for step, value in schedule.items():
            if step < 0:
                raise ValueError(f"min_scale_schedule steps must be >= 0, got {step}")
            check_fp32_scale(f"min_scale_schedule[{step}]", value)
            if value < floor:
                raise ValueError(
                    f"min_scale_schedule must only raise the floor: {value} at step {step} is below {floor}"
                )
            floor = value
        object.__setattr__(self, "min_scale_schedule", schedule or None)

    def min_scale_at(self, iteration: int) -> float | None:
        """The floor after ``iteration`` updates (``None`` outside ``"enhanced"``)."""
        if self.mode != "enhanced":
            return None
        floor = self.min_scale
        for step, value in (self.min_scale_schedule or {}).items():
            if step <= iteration:
                floor = value
        return floor


# Keys every state dict of a scaler has (GradScaler's included); and the counters
# only LossScaler's have (0 when missing).
STATE_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
COUNTERS = ("iteration", "skipped_steps", "calibration_steps")


def _check_adaptive_models() -> None:
    """Mode ``"adaptive"`` scales nothing itself: refuse to step without a model that
    does, and warn about loaded per-layer states whose layers no compiled model has
    (a renamed or different model: they will never be used)."""
    states = REGISTRY.adaptive_states()
    if not states:
        raise RuntimeError(
            "LossScaler('adaptive') found no model compiled with loss_scale='adaptive': the loss "
            "is not scaled in this mode, so nothing would be. Compile the model with "
            "options={..., 'loss_scale': 'adaptive'}, or use another mode"
        )
    compiled = [list(state.layers) for state in states]
    stray = [
        list(saved["layers"]) for saved in REGISTRY.pending_states() if list(saved["layers"]) not in compiled
    ]
    if stray:
        warnings.warn(
            f"lowprec: the loaded LossScaler state has per-layer scales for layers {stray}, which"
            f" no compiled model has (compiled: {compiled}); they are not used",
            stacklevel=3,
        )


def _trained_states(
    states: list[AdaptiveScaleState], groups: list[dict[str, Any]]
) -> list[AdaptiveScaleState]:
    """The adaptive states whose layers the optimizers with these param groups train.

    Optimizers that hold copies of the weights (FP32 masters kept apart) train no
    state by identity: then every state is theirs, as with one model.
    """
    params = {id(p) for group in groups for p in group["params"]}
    return [state for state in states if state.trained_by(params)] or states


def _warn_unreached(states: list[AdaptiveScaleState]) -> None:
    """Warn, once per set of layers, where a call recorded statistics that its backward did
    not return (:meth:`AdaptiveScaleState.statistics_unreached`) and no graph of those
    layers ever received any: a graph run without backward (an ``eval()`` forward with
    grad on) beside one that trains is no cause."""
    same: dict[tuple, list[AdaptiveScaleState]] = {}
    for state in states:  # the graphs of one model's layers (two models' alike apart)
        same.setdefault((tuple(state.layers), state.weight_keys()), []).append(state)
    for (layers, _), group in same.items():
        if any(s.warned_unreached or s.received_statistics() for s in group):
            continue
        if any(s.statistics_unreached() for s in group):
            for s in group:
                s.warned_unreached = True
            warnings.warn(
                f"lowprec: adaptive loss scaling got no gradient statistics from the graph of layers "
                f"{', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''}: gradients "
                "computed by torch.autograd.grad or backward(inputs=...) (zero-bubble pipeline "
                "schedules) do not return them, so its scales stay as they are. Use loss.backward() "
                "without inputs=, or a loss_scale other than 'adaptive'",
                stacklevel=3,
            )


def _replica_ranks(
    states: list[AdaptiveScaleState], ranks: Any, scaled: bool, device: torch.device, groups: dict
) -> Any:
    """The ranks of ``ranks`` whose adaptive states scale the same layers as this rank's
    (by name: its data-parallel replicas, one pipeline stage's), as a process group
    (``None``: this rank alone), their statistics to be summed. ``groups`` caches the
    groups made, by members.

    Raises on every rank of ``ranks`` together (no rank left waiting in a collective)
    where none scaled a loss, or where ranks with the same layers disagree on computing
    one (pipeline stages whose layers have the same names)."""
    dist = torch.distributed
    # each graph of distinct layers once (an eval() graph's state repeats its layers; identical
    # blocks' states are distinct, and counted)
    layers = sorted("\t".join(s.layers) for s in _first_states(states))
    key = zlib.crc32("\n".join(layers).encode())
    mine = torch.tensor([key, int(scaled)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(ranks))]
    dist.all_gather(gathered, mine, group=ranks)
    every = [tuple(pair) for pair in torch.stack(gathered).tolist()]
    members = dist.get_process_group_ranks(ranks)
    if not any(scaled for _, scaled in every):
        raise RuntimeError(
            "step() called before scale() on every rank of the scaler's process_group: no loss "
            "was scaled this iteration"
        )
    if mixed := [
        rank for rank, (other, theirs) in zip(members, every, strict=True) if (other, 1 - theirs) in every
    ]:
        names = sorted({name for s in states for name in s.layers})
        listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        raise ValueError(
            f"ranks {', '.join(map(str, mixed))} of the scaler's process_group step adaptive "
            "scales of layers with the same names, but only some computed a loss (called "
            f"scale()) (this rank's layers: {listed or 'none'}): LossScaler(mode='adaptive') "
            "takes ranks whose layers have the same names for replicas and sums their gradient "
            "statistics. Where these are pipeline stages, give their layers distinct names "
            "(build each stage from the whole model, keeping its layers' names in it); where they "
            "are replicas, scale the loss on each"
        )
    replicas = [rank for rank, (other, _) in zip(members, every, strict=True) if other == key]
    if len(replicas) == len(members):
        return ranks
    if len(replicas) == 1:
        return None
    if tuple(replicas) not in groups:
        # only these ranks create their group: each replica set makes its own, at the same step
        groups[tuple(replicas)] = dist.new_group(replicas, use_local_synchronization=True)
    return groups[tuple(replicas)]


def _members(group: Any) -> tuple[int, ...] | None:
    return None if group is None else tuple(torch.distributed.get_process_group_ranks(group))


def _first_states(states: list[AdaptiveScaleState]) -> list[AdaptiveScaleState]:
    """The oldest state of each set of layers among ``states``, ordered by the layers' names
    (graphs of identical blocks, whose names are relative to the block, in graph order;
    blocks without weights cannot be told apart, and share one): the states that agree
    over the replicas, which all hold them. The graphs of the same layers share one state
    (:meth:`AdaptiveScaleState.interchangeable`); a later state of them, of a graph that
    could not (one compiled with other options), may exist on some replicas only: it
    decides by its rank's statistics, issuing no collective."""
    first: dict[tuple, AdaptiveScaleState] = {}
    for state in states:  # oldest graph first
        first.setdefault((tuple(state.layers), state.weight_keys()), state)
    return sorted(first.values(), key=lambda state: state.layers)


def _agree_replicas(firsts: list[AdaptiveScaleState], replicas: Any, device: torch.device) -> None:
    """Where one of ``firsts`` is new to ``replicas`` on some replica (the first step, a new
    model), each replica joins its state of those layers to the first replica's
    (:meth:`AdaptiveScaleState.join_replicas`); where one holds statistics on some replica,
    they are summed over them (:meth:`AdaptiveScaleState.agree_statistics`), once."""
    members = _members(replicas)
    new = [float(_members(s.ranks) != members) for s in firsts]
    held = [float(s.hist.grad is not None and not s.agreed) for s in firsts]  # (a second optimizer's)
    flags = torch.tensor([new, held], device=device)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=replicas)
    for state, (joins, holds) in zip(firsts, flags.t().tolist(), strict=True):
        if joins:
            state.join_replicas(replicas)
        state.ranks = replicas
        if holds:
            state.agree_statistics()


@torch.no_grad()
def unscale_grads(
    params: Iterable[torch.Tensor], inv_scale: torch.Tensor
) -> dict[torch.device, torch.Tensor]:
    """Multiply the ``grad`` of each of ``params`` by ``inv_scale`` in place (torch's fused
    check-and-unscale, on DTensors apart from plain tensors: a tensor-parallel model's
    check reduces its flag over the mesh); returns one flag per device, non-zero where a
    gradient held inf/NaN."""
    grouped: dict[torch.device, dict[tuple, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
    for param in params:
        grad = param.grad
        if grad.is_sparse:
            if grad.dtype is torch.float16:  # duplicates could overflow when summed
                param.grad = grad = grad.coalesce()
            grad = grad._values()
        # a DTensor's check reduces its flag over the first gradient's mesh, if split
        kind = (grad.dtype, type(grad), getattr(grad, "device_mesh", None), getattr(grad, "placements", None))
        grouped[grad.device][kind].append(grad)
    found: dict[torch.device, torch.Tensor] = {}
    for device, per_kind in grouped.items():
        flag = torch.zeros((), dtype=torch.float32, device=device)
        local_inv = inv_scale.to(device)
        for grads in per_kind.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, local_inv)
        found[device] = flag
    return found


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh_state() -> dict[str, Any]:
    return {"stage": _Stage.READY, "found_inf_per_device": {}, "param_groups": [], "agreed": False}


class _ScalerJoinHook(JoinHook):
    """What a rank that ran out of inputs under ``Join`` does for the scaler: its inf/NaN
    all-reduces, as many per iteration as the scaler's last one made (a flag of its own that
    found none), then, once every rank has joined, the scale of a last joiner. ``Join``
    runs the main hook once per forward of the model that leads it (DDP's): an iteration of
    the scaler's last one spans as many forwards as it had :meth:`LossScaler.scale` calls
    (microbatches of gradient accumulation), counted on from a step this rank left
    unfinished; once per iteration where the scaler leads."""

    def __init__(self, scaler: LossScaler) -> None:
        self.scaler = scaler

    def main_hook(self) -> None:
        scaler, ranks = self.scaler, self.scaler._ranks()
        # the others' forward, counted on from the step this rank left unfinished, if any
        scaler._scales += 1
        if not scaler._join_config.is_first_joinable and scaler._scales < scaler._last_scales:
            return
        scaler._scales = 0
        for _ in range(scaler._last_reductions):
            flag = torch.zeros((), dtype=torch.float32, device=scaler.join_device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=ranks)

    def post_hook(self, is_last_joiner: bool) -> None:
        scaler, ranks = self.scaler, self.scaler._ranks()
        device = scaler.join_device
        scaler._lazy_init(device)
        rank = torch.distributed.get_rank()
        source = torch.tensor([rank if is_last_joiner else -1], device=device)
        torch.distributed.all_reduce(source, op=torch.distributed.ReduceOp.MAX, group=ranks)
        values = [scaler._scale.item(), scaler._tracker.item(), scaler._iteration]
        state = torch.tensor(values, dtype=torch.float64, device=device)
        torch.distributed.broadcast(state, src=int(source.item()), group=ranks)
        scale, tracker, iteration = state.tolist()
        scaler._scale.fill_(scale)
        scaler._tracker.fill_(int(tracker))
        scaler._iteration, scaler._scales = int(iteration), 0


class LossScaler(Joinable):
    """Static, dynamic or enhanced loss scaling with ``GradScaler``'s interface.

    Keyword arguments build a :class:`LossScaleConfig` (validated; bad values
    raise ``ValueError`` naming the valid ones). With ``enabled=False`` every
    method is a pass-through, as in ``GradScaler``. The scale is an FP32 tensor
    on the device of the first tensor given to :meth:`scale`; gradients may be
    on any devices. ``process_group``: the ranks whose skip decisions and adaptive
    scales agree (see the module docstring).

    A :class:`~torch.distributed.algorithms.Joinable`: under ``Join([ddp_model, scaler])``
    a rank that ran out of inputs does the scaler's collectives of each iteration the
    others still run, and all ranks end with the scale of the last to join (modes other
    than ``"adaptive"``, whose per-layer collectives vary by iteration: ``Join`` refuses it).
    """

    def __init__(
        self,
        mode: str = "dynamic",
        *,
        init_scale: float | None = None,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float | None = None,
        min_scale_schedule: Mapping[int, float] | None = None,
        enabled: bool = True,
        process_group: Any = "auto",
    ) -> None:
        config = LossScaleConfig(
            mode, init_scale, growth_factor, backoff_factor, growth_interval, min_scale, min_scale_schedule
        )
        self._setup(config, enabled, process_group)

    @classmethod
    def from_config(
        cls, config: LossScaleConfig, enabled: bool = True, process_group: Any = "auto"
    ) -> LossScaler:
        """A scaler with the settings of ``config``."""
        scaler = cls.__new__(cls)
        scaler._setup(config, enabled, process_group)
        return scaler

    def _setup(self, config: LossScaleConfig, enabled: bool, process_group: Any) -> None:
        if isinstance(process_group, str) and process_group != "auto":
            raise ValueError(f"process_group must be 'auto', None or a process group, got {process_group!r}")
        Joinable.__init__(self)
        self._process_group = process_group
        self._config = config
        self._enabled = bool(enabled)
        self._iteration = 0  # update() calls so far
        self.skipped_steps = 0  # steps skipped for non-finite gradients, or to calibrate
        self.calibration_steps = 0  # those skipped while adaptive scales were calibrating
        self._init_scale = max(config.init_scale, config.min_scale_at(0) or 0.0)
        self._init_tracker = 0
        self._scale: torch.Tensor | None = None
        self._tracker: torch.Tensor | None = None
        self._scaled = False  # whether scale() was called since update() (a pipeline stage's loss)
        # inf/NaN flags all-reduced and scale() calls since update(), and in the last
        # iteration: what a joined rank shadows, and how often (see _ScalerJoinHook)
        self._reductions, self._last_reductions = 0, 1
        self._scales, self._last_scales = 0, 1
        self._replica_groups: dict[tuple[int, ...], Any] = {}  # process groups by members
        self._replicated: weakref.WeakSet = weakref.WeakSet()  # the states step() gave replicas
        self._per_optimizer: dict[int, dict[str, Any]] = defaultdict(_fresh_state)

    @property
    def config(self) -> LossScaleConfig:
        return self._config

    @property
    def mode(self) -> str:
        return self._config.mode

    def is_enabled(self) -> bool:
        return self._enabled

    def _ranks(self) -> Any:
        """The process group whose ranks agree with this one, or ``None`` (decide alone)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD if self._process_group == "auto" else self._process_group
        return group if group is not None and dist.get_world_size(group) > 1 else None

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``Join`` runs on a rank out of inputs (:class:`_ScalerJoinHook`); raises
        ``RuntimeError`` in ``"adaptive"`` mode across ranks."""
        if self._enabled and self.mode == "adaptive" and self._ranks() is not None:
            raise RuntimeError(
                "LossScaler('adaptive') cannot join: its per-layer statistics and back-offs "
                "issue collectives that vary from one iteration to the next, which a rank out of "
                "inputs cannot shadow. Give every rank the same number of batches "
                "(DistributedSampler(drop_last=True)), or pass process_group=None"
            )
        return _ScalerJoinHook(self) if self._enabled and self._ranks() is not None else JoinHook()

    @property
    def join_device(self) -> torch.device:
        """The scale's device (before the first :meth:`scale`, the CPU, or the current GPU
        under NCCL)."""
        if self._scale is not None:
            return self._scale.device
        ranks = self._ranks()
        nccl = ranks is not None and torch.distributed.get_backend(ranks) == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        """The scaler's process group (the world for ``None`` too, as ``DDP``'s default)."""
        group = self._process_group
        return torch.distributed.group.WORLD if group in ("auto", None) else group

    def _lazy_init(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            self._tracker = torch.full((), self._init_tracker, dtype=torch.int32, device=device)
        return self._scale

    def _require_scale(self, what: str) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError(f"{what}() called before scale(): no loss was scaled this iteration")
        return self._scale

    def _stage_scale(self, optimizer: torch.optim.Optimizer, what: str) -> torch.Tensor:
        """The scale, also on a rank that scaled no loss where adaptive ranks agree (a pipeline
        stage without the loss: the scale is the others', ``init_scale``; ``step`` checks that
        some rank scaled one)."""
        if self.mode == "adaptive" and self._ranks() is not None:
            params = (p for group in optimizer.param_groups for p in group["params"])
            self._lazy_init(self._scale.device if self._scale is not None else next(params).device)
        return self._require_scale(what)

    def scale(self, outputs: torch.Tensor | Iterable[Any]) -> Any:
        """Multiply a tensor (or nested lists/tuples of tensors) by the scale."""
        if not self._enabled:
            return outputs

        if not self._scaled:  # Join's count of ranks still training, if the scaler leads it
            Join.notify_join_context(self)
        self._scales += 1

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                self._scaled = True
                scale = self._lazy_init(value.device)
                return value * scale.to(device=value.device, non_blocking=True)
            if isinstance(value, (list, tuple)):
                return type(value)(apply(v) for v in value)
            if isinstance(value, Iterable):
                return map(apply, value)
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def _unscale_grads(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor
    ) -> dict[torch.device, torch.Tensor]:
        """Multiply every grad by ``inv_scale`` in place; one found-inf flag per device, this
        rank's (:meth:`_found_inf` agrees them with the other ranks)."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return unscale_grads(params, inv_scale)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record inf/NaN.

        Call at most once per optimizer between :meth:`update` calls (a second
        call raises ``RuntimeError``). 16-bit gradients are unscaled in their
        own dtype; letting :meth:`step` unscale a
        :class:`~lpcompile.runtime.optim.MasterWeightOptimizer` unscales in FP32 instead.
        """
        if not self._enabled:
            return
        scale = self._stage_scale(optimizer, "unscale_")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update()")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = scale.double().reciprocal().float()
        state["found_inf_per_device"] = self._unscale_grads(optimizer, inv_scale)
        state["param_groups"] = optimizer.param_groups
        state["stage"] = _Stage.UNSCALED

    def _found_inf(self, state: dict[str, Any], device: torch.device) -> torch.Tensor:
        """Whether ``state``'s optimizer saw inf/NaN on any rank, as a tensor: its flags are
        agreed at the first read (in :meth:`step` or :meth:`update`, which every rank calls
        alike), not in :meth:`unscale_`, which some ranks may skip (clipping on one stage)."""
        if (ranks := self._ranks()) is not None and not state["agreed"]:
            for flag in state["found_inf_per_device"].values():
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=ranks)
                self._reductions += 1
            state["agreed"] = True
        flags = [f.to(device) for f in state["found_inf_per_device"].values()]
        return sum(flags[1:], flags[0]) if flags else torch.zeros((), device=device)

    def _found_inf_bool(self, state: dict[str, Any], device: torch.device) -> bool:
        """Whether ``state``'s optimizer saw inf/NaN (read once, by ``step``, or here)."""
        if "found_inf" not in state:
            state["found_inf"] = bool(self._found_inf(state, device).item())
        return state["found_inf"]

    def _calibrating(self, state: dict[str, Any]) -> bool:
        """Whether a backward since :meth:`update`, through an adaptive model this optimizer
        trains, ran at scales not yet set from statistics (its gradients are not to be
        stepped on)."""
        if self.mode != "adaptive":
            return False
        states = REGISTRY.adaptive_states()
        calibrating = False
        if any(s.calibrating or s.unsettled for s in states):  # else the common case: one pass
            mine = [s for s in _trained_states(states, state["param_groups"]) if s.calibrating or s.unsettled]
            for s in mine:  # a backward's statistics tell whether the scales it ran at were set
                s.refresh_pending()
            calibrating = any(s.unsettled for s in mine)
        return self._anywhere(calibrating)

    def _anywhere(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the scaler's process group (pipeline stages
        skip a step together)."""
        ranks = self._ranks()
        if ranks is None:
            return flag
        agreed = torch.tensor(float(flag), device=self._scale.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=ranks)
        return bool(agreed.item())

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` did) and step ``optimizer`` if all grads are finite.

        Returns ``optimizer.step``'s result, or ``None`` for a skipped step
        (weights and optimizer state untouched). Closures are not supported.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if kwargs.get("closure") is not None or any(map(callable, args)):  # step(closure) too
            raise RuntimeError(
                "closure use is not supported while loss scaling is enabled: the closure's backward "
                "would run after the gradients were unscaled: step a closure optimizer (LBFGS) without the "
                "scaler, or with LossScaler(enabled=False)"
            )
        if self.mode == "adaptive":
            _check_adaptive_models()
            states = _trained_states(REGISTRY.adaptive_states(), optimizer.param_groups)
            _warn_unreached(states)
            scale = self._stage_scale(optimizer, "step")
            replicas = None
            if (ranks := self._ranks()) is not None:
                replicas = _replica_ranks(states, ranks, self._scaled, scale.device, self._replica_groups)
            firsts = _first_states(states)
            if replicas is not None:
                _agree_replicas(firsts, replicas, scale.device)
            for s in states:
                s.ranks = replicas if s in firsts else None
                if s.ranks is not None:
                    self._replicated.add(s)
        scale = self._require_scale("step")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # The optimizer unscales and skips by itself (GradScaler's protocol).
            if state["stage"] is _Stage.READY:
                state["found_inf_per_device"] = self._unscale_grads(optimizer, torch.ones_like(scale))
                state["param_groups"] = optimizer.param_groups
            optimizer.grad_scale = None if state["stage"] is _Stage.UNSCALED else scale
            optimizer.found_inf = self._found_inf(state, scale.device)
            state["found_inf"] = bool(optimizer.found_inf.item())
            calibrating = not state["found_inf"] and self._calibrating(state)
            if calibrating:
                optimizer.found_inf = torch.ones_like(optimizer.found_inf)
            self.calibration_steps += int(calibrating)
            self.skipped_steps += int(state["found_inf"] or calibrating)
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale, optimizer.found_inf
            state["stage"] = _Stage.STEPPED
            return retval
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        if not state["found_inf_per_device"]:
            raise RuntimeError("step() found no gradients on this optimizer's parameters")
        retval = None
        found_inf = self._found_inf_bool(state, scale.device)
        calibrating = not found_inf and self._calibrating(state)
        if found_inf or calibrating:
            self.skipped_steps += 1
            self.calibration_steps += int(calibrating)
        else:
            retval = optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: adjust the scale by the mode's rule (or set ``new_scale``).

        In ``"enhanced"`` mode the result, ``new_scale`` included, is raised
        to the current floor (``min_scale``, or the schedule's value).
        """
        if not self._enabled:
            return
        scale = self._require_scale("update")
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or new_scale.requires_grad:
                    raise ValueError("new_scale must be a float or a 1-element tensor without grad")
                scale.copy_(new_scale.reshape(()))
            else:
                check_fp32_scale("new_scale", new_scale)
                scale.fill_(float(new_scale))
        else:
            optimizers = list(self._per_optimizer.values())
            if not any(state["found_inf_per_device"] for state in optimizers):
                raise RuntimeError("update() found no inf checks: call step() (or unscale_()) first")
            if self.mode == "adaptive":
                found_inf = any(self._found_inf_bool(state, scale.device) for state in optimizers)
                groups = [group for state in optimizers for group in state["param_groups"]]
                trained = _trained_states(REGISTRY.adaptive_states(), groups)
                for s in list(self._replicated):
                    if s not in trained:  # no step of this scaler agrees them now: its rank's
                        s.ranks = None
                        self._replicated.discard(s)
                # without inf/NaN in the step, only states whose in-graph probes counted some,
                # and those agreeing over replicas (which may have counted some)
                states = [s for s in trained if found_inf or s.flags.grad is not None or s.ranks is not None]
                back_off_states(sorted(states, key=lambda s: s.layers), found_inf, anywhere=self._anywhere)
            elif self.mode != "static":
                flags = [self._found_inf(state, scale.device) for state in optimizers]
                torch._amp_update_scale_(
                    scale,
                    self._tracker,
                    sum(flags[1:], flags[0]),
                    self._config.growth_factor,
                    self._config.backoff_factor,
                    self._config.growth_interval,
                )
        if self.mode == "adaptive":
            self._settle()
        self._scaled = False
        self._last_reductions, self._reductions = self._reductions, 0
        self._last_scales, self._scales = max(self._scales, 1), 0
        self._iteration += 1
        floor = self._config.min_scale_at(self._iteration)
        if floor is not None:
            scale.clamp_(min=floor)
        self._per_optimizer = defaultdict(_fresh_state)

    def _settle(self) -> None:
        """End the calibration veto of this iteration's backwards (their gradients are spent):
        statistics a skipped step left pending are turned into scales now, not held against
        the next iteration."""
        states = REGISTRY.adaptive_states()
        if any(s.unsettled or s.calibrating for s in states):
            groups = [group for state in self._per_optimizer.values() for group in state["param_groups"]]
            for s in _trained_states(states, groups):
                s.refresh_pending()
                s.unsettled = False

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled)."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_min_scale(self) -> float | None:
        """The current floor of ``"enhanced"`` mode, else ``None``."""
        return self._config.min_scale_at(self._iteration)

    def _growth_tracker(self) -> int:
        return self._init_tracker if self._tracker is None else int(self._tracker.item())

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (``GradScaler``'s keys plus mode, floor and iteration) and the
        compiled models' adaptive scales and stream call counts; ``{}`` if disabled."""
        if not self._enabled:
            return {}
        cfg = self._config
        return {
            "scale": self.get_scale(),
            "growth_factor": cfg.growth_factor,
            "backoff_factor": cfg.backoff_factor,
            "growth_interval": cfg.growth_interval,
            "_growth_tracker": self._growth_tracker(),
            "mode": cfg.mode,
            "min_scale": cfg.min_scale,
            "min_scale_schedule": dict(cfg.min_scale_schedule) if cfg.min_scale_schedule else None,
            "iteration": self._iteration,
            "skipped_steps": self.skipped_steps,
            "calibration_steps": self.calibration_steps,
            "adaptive": (
                [state.state_dict() for state in REGISTRY.adaptive_states()]
                if cfg.mode == "adaptive"
                else None
            ),
            "streams": REGISTRY.streams_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output.

        A ``GradScaler`` state dict also loads, except in ``"adaptive"`` mode (it
        lacks the per-layer state); keys it lacks keep this scaler's values. The
        adaptive state loads into the compiled graphs, or, when none is compiled
        yet (a fresh process), into each graph's state as it compiles. The whole
        dict is checked before any of it is applied: a bad one raises
        ``ValueError`` and leaves the scaler as it was.
        """
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("the state dict is empty: it was saved from a disabled scaler")
        missing = [key for key in STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(f"not a loss scaler state dict: it lacks {missing}, it has {sorted(state_dict)}")
        mode = state_dict.get("mode", self.mode)
        if mode != self.mode:
            raise ValueError(f"state dict is for mode {mode!r}, this scaler's mode is {self.mode!r}")
        changes = {k: state_dict[k] for k in ("growth_factor", "backoff_factor", "growth_interval")}
        if self.mode == "enhanced":
            changes["min_scale"] = state_dict.get("min_scale", self._config.min_scale)
            changes["min_scale_schedule"] = state_dict.get(
                "min_scale_schedule", self._config.min_scale_schedule
            )
        config = dataclasses.replace(self._config, **changes)  # validates them
        check_fp32_scale("scale", state_dict["scale"])
        counts = {key: state_dict.get(key, 0) for key in ("_growth_tracker", *COUNTERS)}
        for key, value in counts.items():
            check_count(f"the state dict's {key!r}", value)
        streams = state_dict.get("streams")
        if streams is not None:
            check_streams_state(streams)
        load_adaptive = None
        if self.mode == "adaptive":
            saved = state_dict.get("adaptive")
            if not isinstance(saved, list):
                raise ValueError(
                    "mode 'adaptive' needs the per-layer state (the 'adaptive' list of LossScaler."
                    f"state_dict()); this state dict has {saved!r} (a GradScaler's has none)"
                )
            load_adaptive = REGISTRY.adaptive_loader(saved)
        self._config = config
        self._iteration = int(counts["iteration"])
        self.skipped_steps = int(counts["skipped_steps"])
        self.calibration_steps = int(counts["calibration_steps"])
        REGISTRY.load_streams_state(streams)
        if load_adaptive is not None:
            load_adaptive()
        floor = self._config.min_scale_at(self._iteration)
        self._init_scale = max(float(state_dict["scale"]), floor or 0.0)
        self._init_tracker = int(counts["_growth_tracker"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._tracker.fill_(self._init_tracker)
