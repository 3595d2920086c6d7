"""``lowprec::predict_weight``: linear weight prediction (Kosson et al. 2020).

* ``lowprec::predict_weight(w, buf, lr, delay, mode)`` returns the weight
  ``delay`` optimizer steps ahead, extrapolated linearly:

  - ``mode="lwp_v"`` (LWP^v_D): ``w - (lr * delay) * buf`` with ``buf`` the
    momentum velocity ``v`` (SGD with momentum moves ``w`` by ``-lr * v`` per step);
  - ``mode="lwp_w"`` (LWP^w_D): ``w + delay * (w - buf)`` with ``buf`` the
    weight before the last step, ``w_{t-1}``.

  ``lr`` is a 0-dim tensor (a graph input, so a learning-rate schedule does
  not recompile), ``delay`` an int: the delay D of the stage that reads ``w``.
  The gradient flows to ``w`` unchanged (the predicted weight stands in for
  ``w``); ``buf`` and ``lr`` get none.

As for ``lpcompile.numerics.quantize``: the reference implementation below is the eager
kernel and the decomposition Inductor compiles.
"""

from __future__ import annotations

import torch

PREDICTIONS = ("none", "lwp_v", "lwp_w")


def _check(w: torch.Tensor, buf: torch.Tensor, lr: torch.Tensor, delay: int, mode: str) -> None:
    if mode not in PREDICTIONS[1:]:
        raise ValueError(f"predict_weight mode must be one of {PREDICTIONS[1:]}, got {mode!r}")
    if buf.shape != w.shape:
        raise ValueError(f"predict_weight: buffer shape {tuple(buf.shape)} != weight shape {tuple(w.shape)}")
    if buf.dtype != w.dtype or buf.device != w.device:
        raise ValueError(
            f"predict_weight: buffer {buf.dtype} on {buf.device} != weight {w.dtype} on {w.device}"
        )
    if lr.dim() != 0:
        raise ValueError(f"predict_weight: lr must be a 0-dim tensor, got shape {tuple(lr.shape)}")
    if delay < 0:
        raise ValueError(f"predict_weight: delay must be >= 0, got {delay}")


def predict_weight_reference(
    w: torch.Tensor, buf: torch.Tensor, lr: torch.Tensor, delay: int, mode: str
) -> torch.Tensor:
    """Reference implementation of ``lowprec::predict_weight`` in plain torch ops."""
    _check(w, buf, lr, delay, mode)
    if mode == "lwp_v":
        step = lr * delay if lr.dtype == w.dtype else lr.to(w.dtype) * delay
        return w - step * buf
    return w + delay * (w - buf)


@torch.library.custom_op("lowprec::predict_weight", mutates_args=())
def predict_weight_op(
    w: torch.Tensor, buf: torch.Tensor, lr: torch.Tensor, delay: int, mode: str
) -> torch.Tensor:
    return predict_weight_reference(w, buf, lr, delay, mode)


@predict_weight_op.register_fake
def _(w, buf, lr, delay, mode):
    _check(w, buf, lr, delay, mode)
    return torch.empty_like(w)


def _to_weight(ctx, grad):
    return grad, None, None, None, None


predict_weight_op.register_autograd(_to_weight)


def predict_weight(
    w: torch.Tensor, buf: torch.Tensor, lr: float | torch.Tensor, delay: int, mode: str = "lwp_v"
) -> torch.Tensor:
    """The weight ``delay`` steps ahead: LWP^v (``mode="lwp_v"``) or LWP^w (``"lwp_w"``)."""
    if not isinstance(lr, torch.Tensor):
        lr = torch.tensor(lr, dtype=torch.float32, device=w.device)
    return torch.ops.lowprec.predict_weight(w, buf, lr, int(delay), mode)
