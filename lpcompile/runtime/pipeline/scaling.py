"""Loss scaling per pipeline stage.

Each stage s of a :class:`~lpcompile.runtime.pipeline.PipelinedTrainer` keeps a scale
``S_s`` of its own, under the rule of a :class:`~lpcompile.runtime.scaler.LossScaleConfig`
mode (``"static"``, ``"dynamic"``, ``"enhanced"``) applied per sample:

* the last stage multiplies its loss by ``S_s``; any other stage multiplies the error it
  receives by ``S_s / σ``, where ``σ`` is the scale the error was computed at (it travels
  with the error);
* after a stage's backward its weight gradients are multiplied by ``1 / S_s`` and, with
  its input gradients, checked for inf/NaN. A non-finite one skips the stage's update for
  that sample, and the stages before it receive no error for the sample (they skip it as
  well, their scales unchanged);
* then ``S_s`` follows the mode: ``"dynamic"`` multiplies it by ``backoff_factor`` after
  an overflow and by ``growth_factor`` after ``growth_interval`` consecutive clean
  samples (``torch.amp.GradScaler``'s rule, per sample), ``"enhanced"`` also keeps it at
  or above its floor after as many samples as the stage has backpropagated,
  ``"static"`` keeps it.

Stages compiled with per-layer adaptive loss scaling (``loss_scale="adaptive"`` in the
stages' ``compile`` options) always check their gradients (at a static scale of 1 if no
other is asked for). After each backward they back off the layers of the stage whose
gradients overflowed (:func:`back_off_layers`), as ``LossScaler("adaptive")`` does after
a step, and turn the sample's statistics into scales (:func:`refresh_layers`). A sample
whose forward read scales still calibrating is skipped like an overflow where its
statistics raise a layer's scale more than a binade above what it read (its errors were
quantized where they underflow), as ``LossScaler("adaptive")`` skips such a step. The
samples in flight when calibration ends are judged by their own statistics too: a
stage's forwards run ahead of its backwards, so several read the first, initial scales.

A stage's decisions read only its own gradients and the errors it receives, so ranks
compute the simulator's bits and exchange nothing more than ``σ``. A skipped update is
per stage: an overflow in one stage's backward neither backs off nor skips the stages
after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lpcompile.backend.adaptive import AdaptiveScaleState, back_off_states
from lpcompile.numerics.checks import check_count, check_fp32_scale
from lpcompile.runtime.scaler import LossScaleConfig, unscale_grads

STATE_KEYS = ("scale", "growth_tracker", "samples", "skipped", "calibration")
# Keys a state saved by an earlier version may lack (their counts start at 0)
OPTIONAL_KEYS = ("calibration",)


@dataclass(frozen=True, eq=False)
class ScalesRead:
    """What one forward of a stage read from an adaptive-scaling state of its graphs."""

    state: AdaptiveScaleState
    scales: torch.Tensor  # a state's scales are replaced, never changed in place
    calibrating: bool  # whether the state was still calibrating them
    call: int  # the forward's call index in the state
    rounds: int  # the state's rounds of refreshes before it


def back_off_layers(
    reads: Sequence[ScalesRead],
    slots: Sequence[torch.Tensor],
    params: Sequence[nn.Parameter],
    found_inf: bool,
) -> None:
    """After one backward of a stage compiled with per-layer adaptive loss scaling, back
    off each of its layers whose gradients overflowed (as ``LossScaler("adaptive")`` does
    after a step), to half the scale its forward read at most: ``reads`` are what that
    forward read from the states of the stage's graphs, ``slots`` the weight slots the
    backward wrote the gradients of ``params`` to, ``found_inf`` whether the stage's check
    found inf/NaN (module doc)."""
    grads = {id(p): slot.grad for slot, p in zip(slots, params, strict=True) if slot.grad is not None}
    hit = [r for r in reads if found_inf or r.state.flags.grad is not None]
    back_off_states([r.state for r in hit], found_inf, grads, [r.scales for r in hit])


def refresh_layers(reads: Sequence[ScalesRead]) -> bool:
    """After one backward of a stage compiled with per-layer adaptive loss scaling, turn
    the statistics it recorded into scales, each state's against the scales its forward
    read (``reads``); whether the sample is to be skipped: scales it read while they
    calibrated were raised more than a binade, and calibration goes on (module doc)."""
    unconfirmed = [r.state.refresh_sample(r.scales, r.call, r.rounds) for r in reads]  # every state
    return any(off and r.calibrating for off, r in zip(unconfirmed, reads, strict=True))


def loss_scale_config(loss_scale: float | str | LossScaleConfig) -> LossScaleConfig | None:
    """The per-stage scaling ``PipelinedTrainer(loss_scale=...)`` asks for: ``None`` for 1.0
    (no scaling, no checks), mode ``"static"`` for another number, a mode's defaults for
    its name."""
    if isinstance(loss_scale, str):
        loss_scale = LossScaleConfig(loss_scale)
    if isinstance(loss_scale, LossScaleConfig):
        if loss_scale.mode == "adaptive":
            raise ValueError(
                "PipelinedTrainer scales per stage with mode 'static', 'dynamic' or 'enhanced'; "
                "per-layer adaptive scales are compiled into the stages: "
                "compile={'recipe': ..., 'loss_scale': 'adaptive'}"
            )
        return loss_scale
    check_fp32_scale("loss_scale", loss_scale)
    return None if loss_scale == 1.0 else LossScaleConfig("static", init_scale=float(loss_scale))


class StageScale:
    """One stage's loss scale and its counts (module doc)."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self._scale = torch.full((), max(config.init_scale, config.min_scale_at(0) or 0.0))
        self._tracker = torch.zeros((), dtype=torch.int32)
        self.samples = 0  # backwards that reached the stage with an error
        self.skipped = 0  # of those, updates skipped for inf/NaN in this stage's gradients, or to calibrate
        self.calibration = 0  # of those, skipped while the stage's adaptive scales calibrated

    @property
    def value(self) -> float:
        """The scale the stage's next backward runs at."""
        return float(self._scale)

    def rescale(self, grads: Sequence[Any], sent_at: float) -> list[Any]:
        """An error computed at scale ``sent_at``, at this stage's scale."""
        ratio = self.value / sent_at
        if ratio == 1.0:
            return list(grads)
        return [g * ratio if isinstance(g, torch.Tensor) else g for g in grads]

    def unscale(self, weights: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> bool:
        """Divide the ``grad`` of ``weights`` by the scale in place; whether that of any
        of ``weights`` or ``inputs`` holds inf/NaN. Updates the scale by the mode's rule."""
        inv = self._scale.double().reciprocal().float()
        flags = [
            *unscale_grads([w for w in weights if w.grad is not None], inv).values(),
            *unscale_grads([v for v in inputs if v.grad is not None], torch.ones(())).values(),
        ]
        found = any(bool(flag) for flag in flags)
        self.samples += 1
        self.skipped += int(found)
        if self.config.mode != "static":
            cfg = self.config
            flag = torch.full((), float(found))
            torch._amp_update_scale_(
                self._scale, self._tracker, flag, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval
            )
        floor = self.config.min_scale_at(self.samples)
        if floor is not None:
            self._scale.clamp_(min=floor)
        return found

    def skip_calibrating(self) -> None:
        """Count a sample skipped while the stage's adaptive scales calibrated."""
        self.skipped += 1
        self.calibration += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.value,
            "growth_tracker": int(self._tracker),
            "samples": self.samples,
            "skipped": self.skipped,
            "calibration": self.calibration,
        }

    def loader(self, saved: Any, stage: int) -> Callable[[], None]:
        """A function that loads ``saved`` (:meth:`state_dict`'s) into the stage, once all
        of it is checked; a bad one raises ``ValueError`` naming ``stage``."""
        required = [key for key in STATE_KEYS if key not in OPTIONAL_KEYS]
        if not isinstance(saved, dict) or not set(required) <= set(saved) <= set(STATE_KEYS):
            have = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(
                f"stage {stage}'s loss scale state must have the keys {required} "
                f"(and may have {list(OPTIONAL_KEYS)}), got {have}"
            )
        saved = {**dict.fromkeys(OPTIONAL_KEYS, 0), **saved}
        check_fp32_scale(f"stage {stage}'s saved scale", saved["scale"])
        for key in STATE_KEYS[1:]:
            check_count(f"stage {stage}'s saved {key!r}", saved[key])

        def load() -> None:
            self._scale.fill_(float(saved["scale"]))
            self._tracker.fill_(int(saved["growth_tracker"]))
            self.samples, self.skipped = int(saved["samples"]), int(saved["skipped"])
            self.calibration = int(saved["calibration"])

        return load
