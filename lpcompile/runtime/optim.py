"""Optimizers for low-precision training.

:class:`MasterWeightOptimizer` gives any ``torch.optim`` optimizer 16-bit
master weights (Mellempudi et al. 2019): the model's parameters are FP16 or
BF16 tensors and are the only stored copy of the weights. At each ``step`` the
wrapper makes FP32 copies of the weights and gradients, lets the wrapped
optimizer update them in FP32 (its state, e.g. momentum, stays FP32), and
rounds the results back into the 16-bit parameters with
:func:`lpcompile.quantize`, to nearest even or stochastically. Its state dict
also carries the stream call counts of the compiled models (see
:meth:`lpcompile.backend.state.Registry.streams_state`), so that model and
optimizer state dicts resume a stochastically rounded run bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from lpcompile.backend.state import REGISTRY, check_streams_state
from lpcompile.numerics.checks import check_count
from lpcompile.numerics.quantize import OVERFLOWS, ROUNDINGS, quantize

_FORMATS = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_MASK32 = 0xFFFFFFFF
# The keys of state_dict()'s output.
STATE_KEYS = ("optimizer", "steps", "dtype", "rounding", "seed", "overflow")


def _check_seed(seed: Any) -> None:
    """The seed is the high half of a 64-bit quantize seed whose low half counts steps."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")


OptimizerFactory = Callable[..., torch.optim.Optimizer]


def _listed(group: Mapping[str, Any]) -> dict[str, Any]:
    """``group`` with its params as a list: a generator (``m.parameters()``) is read once
    for the FP32 copies and must still hold them for the 16-bit group."""
    params = group["params"]
    return {**group, "params": [params] if isinstance(params, torch.Tensor) else list(params)}


def _split_params(items: Iterable[Any]) -> tuple[list[str] | None, list[torch.Tensor]]:
    """``(names, tensors)`` of a group's params, which are tensors or ``(name, tensor)`` pairs."""
    items = list(items) if not isinstance(items, torch.Tensor) else [items]
    if items and isinstance(items[0], tuple):
        return [name for name, _ in items], [p for _, p in items]
    return None, items


class MasterWeightOptimizer(torch.optim.Optimizer):
    """Run ``optimizer`` in FP32 over 16-bit parameters, rounding its results back.

    Args:
        params: the model's parameters (all of dtype ``dtype``) or param-group
            dicts, as for any ``torch.optim`` optimizer.
        optimizer: an optimizer class or factory, called once as
            ``optimizer(fp32_param_groups, **optimizer_kwargs)``; e.g.
            ``torch.optim.SGD``.
        dtype: ``torch.float16`` or ``torch.bfloat16``, the parameters' dtype.
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"``. Stochastic
            bits are keyed by ``(seed, step, parameter index)``: reproducible,
            and different at every step and for every parameter.
        seed: base seed for stochastic rounding, ``0 <= seed < 2**31``.
        overflow: ``"inf"`` (a weight beyond the format's max becomes inf, as a
            plain cast does) or ``"saturate"``.
        **optimizer_kwargs: passed to ``optimizer`` (``lr``, ``momentum``, ...).

    ``param_groups`` hold the 16-bit model parameters and the hyperparameters
    (LR schedulers and ``zero_grad`` work on them); they are copied into the
    wrapped optimizer (``.optimizer``) at each step. The FP32 copies exist only
    during ``step``. Loss scalers (:class:`lpcompile.runtime.scaler.LossScaler`,
    ``torch.amp.GradScaler``) hand this optimizer ``grad_scale`` and
    ``found_inf``: it unscales the gradients in FP32 and skips the step (returns
    ``None``, nothing changed) when any is non-finite.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        optimizer: type[torch.optim.Optimizer] | OptimizerFactory,
        *,
        dtype: torch.dtype = torch.float16,
        rounding: str = "nearest",
        seed: int = 0,
        overflow: str = "inf",
        **optimizer_kwargs: Any,
    ) -> None:
        if dtype not in _FORMATS:
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if overflow not in OVERFLOWS:
            raise ValueError(f"overflow must be one of {OVERFLOWS}, got {overflow!r}")
        _check_seed(seed)
        self.dtype = dtype
        self.rounding = rounding
        self.seed = seed
        self.overflow = overflow
        self._steps = 0  # steps taken (skipped ones excluded)

        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [_listed(group) for group in groups]
        shadow_groups = [self._shadow_group(group) for group in groups]
        self.optimizer = optimizer(shadow_groups, **optimizer_kwargs)
        self._release()
        self._building = True
        super().__init__(
            [self._model_group(g, i) for i, g in enumerate(groups)], dict(self.optimizer.defaults)
        )
        self._building = False

    # -- parameter bookkeeping -------------------------------------------------

    def _shadow_group(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``group`` over new FP32 tensors holding the 16-bit params' values."""
        names, model_params = _split_params(group["params"])
        shadows = []
        for p in model_params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params must be tensors, got {type(p).__name__}")
            if p.dtype != self.dtype:
                raise TypeError(
                    f"MasterWeightOptimizer(dtype={self.dtype}) got a {p.dtype} parameter: "
                    f"convert the model first, e.g. model.to({self.dtype})"
                )
            shadows.append(p.detach().to(torch.float32))
        items = shadows if names is None else list(zip(names, shadows, strict=True))
        return {**group, "params": items}

    def _model_group(self, group: Mapping[str, Any], index: int) -> dict[str, Any]:
        """The wrapped optimizer's group ``index`` (defaults filled in) over ``group``'s params."""
        inner = self.optimizer.param_groups[index]
        hyper = {k: v for k, v in inner.items() if k not in ("params", "param_names")}
        return {**hyper, "params": group["params"]}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of 16-bit params (to this wrapper and, as FP32 copies, to ``.optimizer``)."""
        if self._building:
            super().add_param_group(param_group)
            return
        param_group = _listed(param_group)
        self.optimizer.add_param_group(self._shadow_group(param_group))
        self._release()
        try:
            super().add_param_group(self._model_group(param_group, len(self.optimizer.param_groups) - 1))
        except Exception:
            self.optimizer.param_groups.pop()  # refused here (e.g. a parameter already held): undone
            raise

    def _pairs(self) -> Iterable[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(index, model param, FP32 copy)`` for every parameter, in order."""
        index = 0
        for group, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            for p, s in zip(group["params"], inner["params"], strict=True):
                yield index, p, s
                index += 1

    def _sync_hyperparameters(self) -> None:
        for group, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            for key, value in group.items():
                if key not in ("params", "param_names"):
                    inner[key] = value

    def _materialize(self) -> None:
        for _, p, s in self._pairs():
            s.data = p.detach().to(torch.float32)

    def _pull_grads(self, inv_scale: torch.Tensor | None) -> None:
        for _, p, s in self._pairs():
            if p.grad is None:
                s.grad = None
                continue
            grad = p.grad.detach().to(torch.float32)
            s.grad = grad.mul_(inv_scale.to(grad.device)) if inv_scale is not None else grad

    @torch.no_grad()
    def _store(self) -> None:
        """Round the FP32 results back into the 16-bit params."""
        seed = (self.seed << 32) | (self._steps & _MASK32)
        fmt = _FORMATS[self.dtype]
        for index, p, s in self._pairs():
            rounded = quantize(s, fmt, self.rounding, seed=seed, offset=index, overflow=self.overflow)
            p.copy_(rounded.to(self.dtype))

    def _release(self) -> None:
        for group in self.optimizer.param_groups:
            for s in group["params"]:
                s.grad = None
                s.data = torch.empty(0, dtype=torch.float32, device=s.device)

    # -- optimizer interface ---------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One FP32 step of the wrapped optimizer, stored back in 16 bits.

        A ``closure`` (e.g. for LBFGS) is run on the 16-bit model, with the
        current FP32 iterate rounded into it, each time the optimizer calls it.
        """
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and found_inf.item():
            return None
        grad_scale = getattr(self, "grad_scale", None)
        inv_scale = None if grad_scale is None else grad_scale.double().reciprocal().float()

        def inner_closure() -> Any:
            self._store()
            with torch.enable_grad():
                loss = closure()
            self._pull_grads(inv_scale)
            return loss

        self._sync_hyperparameters()
        self._materialize()
        try:
            self._pull_grads(inv_scale)
            loss = self.optimizer.step() if closure is None else self.optimizer.step(inner_closure)
            self._store()
        finally:
            self._release()
        self._steps += 1
        return loss

    @property
    def steps(self) -> int:
        """Steps taken so far (skipped steps excluded)."""
        return self._steps

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, the step count, the rounding settings and the
        compiled models' stream call counts."""
        self._sync_hyperparameters()
        return {
            "optimizer": self.optimizer.state_dict(),
            "steps": self._steps,
            "dtype": str(self.dtype),
            "rounding": self.rounding,
            "seed": self.seed,
            "overflow": self.overflow,
            "streams": REGISTRY.streams_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; training then continues bit-identically.

        The seed and step count come from the checkpoint; ``dtype``,
        ``rounding`` and ``overflow`` must match this optimizer's.
        """
        missing = [key for key in STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(
                f"not a MasterWeightOptimizer state dict: it lacks {missing}, it has {sorted(state_dict)}"
            )
        mine = {"dtype": str(self.dtype), "rounding": self.rounding, "overflow": self.overflow}
        for key, value in mine.items():
            if state_dict[key] != value:
                raise ValueError(f"checkpoint has {key}={state_dict[key]!r}, this optimizer {value!r}")
        _check_seed(state_dict["seed"])
        steps = state_dict["steps"]
        check_count("the checkpoint's steps", steps)
        streams = state_dict.get("streams")  # absent from checkpoints saved before it was kept
        if streams is not None:
            check_streams_state(streams)
        self._materialize()
        try:
            self.optimizer.load_state_dict(state_dict["optimizer"])
        finally:
            self._release()
        for group, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            group.update({k: v for k, v in inner.items() if k not in ("params", "param_names")})
        self.seed = state_dict["seed"]
        self._steps = int(steps)
        REGISTRY.load_streams_state(streams)
