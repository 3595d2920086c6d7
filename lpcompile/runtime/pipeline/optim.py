"""SGD with momentum for pipelined backpropagation (Kosson, Chiley et al. 2020).

:class:`PipelineSGD` is SGD with momentum (``v <- m*v + g; w <- w - lr*v``,
``torch.optim.SGD``'s update, bit for bit when nothing below is switched on)
where each parameter group carries the ``delay`` D of its pipeline stage: the
gradient it receives at step t was computed from a forward pass made D steps
earlier. Two mitigations of that delay:

* **Spike Compensation** (``spike_compensation=True``): ``w <- w - lr*(a*v + b*g)``
  with ``a = m**D`` and ``b = (1 - m**D) / (1 - m)``. A delayed gradient then
  moves the weights by ``lr*g/(1 - m)`` in total, as without delay, and the
  part that would have been applied during the D steps of delay is applied at
  once (the "spike").
* **Linear Weight Prediction** (``prediction="lwp_v"`` or ``"lwp_w"``): the
  forward pass reads a prediction of the weights D steps ahead (when its
  gradient will come back) instead of the current ones:
  LWP^v ``w - lr*D*v`` or LWP^w ``w + D*(w_t - w_{t-1})``. The optimizer keeps
  the buffers (``v``, or ``w_{t-1}``) and the learning rate as tensors;
  :meth:`PipelineSGD.prediction_inputs` hands them to whoever computes the
  prediction: :class:`lpcompile.runtime.pipeline.PipelinedTrainer`, or a graph
  compiled with ``options={"pipeline": {...}}``, whose ``lowprec::predict_weight``
  nodes read them as graph inputs (the backend's registry looks the optimizer up).

:func:`scale_hyperparameters` is the batch-size scaling rule of the paper:
``lr' = lr*B'/B`` and ``m' = m**(B'/B)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from lpcompile.backend.state import REGISTRY
from lpcompile.numerics.checks import check_count, check_nonnegative, is_real
from lpcompile.numerics.predict import PREDICTIONS, predict_weight, predict_weight_reference


def scale_hyperparameters(
    lr: float, momentum: float, batch_size: int, new_batch_size: int = 1
) -> tuple[float, float]:
    """``(lr*B'/B, momentum**(B'/B))``: keep SGD's dynamics per sample when B changes to B'."""
    if batch_size <= 0 or new_batch_size <= 0:
        raise ValueError(f"batch sizes must be positive, got {batch_size} and {new_batch_size}")
    ratio = new_batch_size / batch_size
    return lr * ratio, momentum**ratio


def spike_coefficients(momentum: float, delay: int) -> tuple[float, float]:
    """Spike Compensation's ``(a, b) = (m**D, (1 - m**D)/(1 - m))``; ``(1, 0)`` for D = 0."""
    a = momentum**delay
    b = float(delay) if momentum == 1.0 else (1.0 - a) / (1.0 - momentum)
    return a, b


@dataclass(frozen=True)
class PredictionInputs:
    """What a ``lowprec::predict_weight`` node reads for one parameter."""

    mode: str  # "lwp_v" or "lwp_w"
    buffer: torch.Tensor  # v for lwp_v, w_{t-1} for lwp_w
    lr: torch.Tensor  # 0-dim float32
    delay: int

    def predict(self, weight: torch.Tensor) -> torch.Tensor:
        """``lowprec::predict_weight`` of ``weight``; without autograd, its kernel called directly."""
        if torch.is_grad_enabled() and weight.requires_grad:
            return predict_weight(weight, self.buffer, self.lr, self.delay, self.mode)
        return predict_weight_reference(weight, self.buffer, self.lr, self.delay, self.mode)


class PipelineSGD(torch.optim.Optimizer):
    """SGD with momentum, per-group delay, Spike Compensation and weight-prediction buffers.

    Args:
        params: parameters or param-group dicts; a group may set its own
            ``delay``, ``spike_compensation``, ``prediction``, ``lr``, ...
        lr, momentum, weight_decay: as ``torch.optim.SGD`` (no dampening, no Nesterov).
        delay: D, the steps between the forward pass that made a gradient and
            the step that applies it (the pipeline stage's delay).
        spike_compensation: apply ``w <- w - lr*(a*v + b*g)`` (see the module doc).
        prediction: ``"none"``, ``"lwp_v"`` or ``"lwp_w"``: which buffer
            :meth:`prediction_inputs` serves and :meth:`predicted_weight` uses.

    Parameters whose ``grad`` is ``None`` are skipped, as in ``torch.optim.SGD``
    (a pipeline stage that has no gradient yet during warm-up does not step).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.0,
        *,
        weight_decay: float = 0.0,
        delay: int = 0,
        spike_compensation: bool = False,
        prediction: str = "none",
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            delay=delay,
            spike_compensation=spike_compensation,
            prediction=prediction,
        )
        self._groups: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate(group)
        for p in group["params"]:
            self._groups[id(p)] = (p, group)
            REGISTRY.serve_predictions([p], self)

    def _group_of(self, param: torch.Tensor) -> dict[str, Any]:
        entry = self._groups.get(id(param))
        if entry is None or entry[0] is not param or not any(g is entry[1] for g in self.param_groups):
            # param_groups may have been replaced (load_state_dict): look again
            self._groups = {id(p): (p, g) for g in self.param_groups for p in g["params"]}
            entry = self._groups.get(id(param))
            if entry is None or entry[0] is not param:
                raise KeyError("parameter is not in this optimizer")
        return entry[1]

    def _lr_tensor(self, param: torch.Tensor, lr: float) -> torch.Tensor:
        """The group's lr as a 0-dim tensor, kept in the state and updated in place."""
        state = self.state[param]
        lr_t = state.get("lr")
        if lr_t is None:
            lr_t = state["lr"] = torch.tensor(lr, dtype=torch.float32, device=param.device)
            state["lr_value"] = lr
        elif state["lr_value"] != lr:  # a scheduler changed it: same tensor, new value
            lr_t.fill_(lr)
            state["lr_value"] = lr
        return lr_t

    def prediction_inputs(self, param: torch.Tensor, mode: str | None = None) -> PredictionInputs:
        """The buffer and lr a prediction of ``param`` reads (group's mode unless ``mode``)."""
        group = self._group_of(param)
        mode = mode or group["prediction"]
        if mode not in PREDICTIONS[1:]:
            raise ValueError(f"no prediction for mode {mode!r}; modes: {PREDICTIONS[1:]}")
        keeps = group["prediction"] == mode or (mode == "lwp_v" and group["momentum"] != 0)
        if not keeps:  # step() would never fill the buffer: the "prediction" would be w itself
            raise ValueError(
                f"a {mode} prediction needs {'w_(t-1)' if mode == 'lwp_w' else 'the velocity'}, which this "
                f"parameter's group (prediction={group['prediction']!r}, momentum={group['momentum']}) "
                f"does not keep: give PipelineSGD prediction={mode!r}"
            )
        state = self.state[param]
        if mode == "lwp_v":
            buffer = state.get("momentum_buffer")
            if buffer is None:  # no step yet: v = 0
                buffer = state.setdefault(
                    "zero_velocity", torch.zeros_like(param, memory_format=torch.preserve_format)
                )
        else:
            buffer = state.get("prev_weight")
            if buffer is None:  # no step yet: w_t - w_{t-1} = 0
                buffer = param.detach()
        return PredictionInputs(mode, buffer, self._lr_tensor(param, group["lr"]), int(group["delay"]))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s, keeping each lr tensor in float32 (the base
        class casts state tensors to their parameter's dtype; graphs read lr as FP32)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            if "lr" in state:
                state["lr"] = state["lr"].to(torch.float32)

    @torch.no_grad()
    def predicted_weight(self, param: torch.Tensor) -> torch.Tensor:
        """The weight the forward pass of ``param``'s stage reads: a prediction, or ``param``."""
        group = self._group_of(param)
        if group["prediction"] == "none" or group["delay"] == 0:
            return param.detach()
        return self.prediction_inputs(param).predict(param.detach())

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
            delay = int(group["delay"])
            a, b = spike_coefficients(m, delay) if group["spike_compensation"] else (1.0, 0.0)
            keep_prev = group["prediction"] == "lwp_w"
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                state = self.state[p]
                if keep_prev:
                    prev = state.get("prev_weight")
                    if prev is None:
                        state["prev_weight"] = p.detach().clone()
                    else:
                        prev.copy_(p)
                if m == 0:
                    if group["prediction"] == "lwp_v":  # v = g without momentum
                        state["momentum_buffer"] = grad.detach().clone()
                    p.add_(grad, alpha=-lr)
                    continue
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = torch.clone(grad).detach()
                    state.pop("zero_velocity", None)
                else:
                    buf.mul_(m).add_(grad)
                if b == 0.0 and a == 1.0:
                    p.add_(buf, alpha=-lr)  # torch.optim.SGD's update, bit for bit
                else:
                    p.add_(buf * a + grad * b, alpha=-lr)
        return loss


def _validate(group: dict[str, Any]) -> None:
    if group["prediction"] not in PREDICTIONS:
        raise ValueError(f"prediction must be one of {PREDICTIONS}, got {group['prediction']!r}")
    check_count("delay", group["delay"])
    check_nonnegative("lr", group["lr"])
    check_nonnegative("weight_decay", group["weight_decay"])
    if not (is_real(group["momentum"]) and 0.0 <= group["momentum"] <= 1.0):
        raise ValueError(f"momentum must be in [0, 1], got {group['momentum']!r}")
    if not isinstance(group["spike_compensation"], bool):
        raise ValueError(f"spike_compensation must be a bool, got {group['spike_compensation']!r}")
