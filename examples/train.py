"""Training loop for the demo, the accuracy tests and the benchmarks."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from examples.data import Split, load_digits
from examples.models import DigitsCNN
from lpcompile.backend import stats
from lpcompile.runtime.optim import MasterWeightOptimizer
from lpcompile.runtime.scaler import LossScaler
from lpcompile.tools import dump
from lpcompile.tools.report import RunTelemetry, telemetry_path


@dataclass
class TrainResult:
    """What one training run reached, and how long its steps took."""

    name: str
    test_accuracy: float  # percent
    final_loss: float  # mean training loss of the last epoch
    step_time: float  # median seconds per step, compile excluded
    compile_time: float  # extra seconds of the first step over the median
    skipped_steps: int = 0
    losses: list[float] = field(default_factory=list)
    floor_steps: int = 0  # updates at which the "enhanced" floor held the scale up


class Updater:
    """The update half of a training step: loss scaling, the optimizer step and, with
    ``master_weights``, FP16 master weights (Mellempudi et al. 2019).

    ``master_weights`` is ``None`` (the optimizer steps the model's FP32 parameters) or a
    rounding, ``"nearest"`` or ``"stochastic"``: the stored weights are then FP16 tensors
    stepped by :class:`MasterWeightOptimizer` with that rounding, and the model's FP32
    parameters are only their exact copies to compute with (FP16 arithmetic on CPUs is
    slow). The gradients reach the optimizer in FP16, as a FP16 model's would.
    ``loss_scale`` is ``"none"`` or a :class:`LossScaler` mode, ``scaler_options`` its
    other arguments (``min_scale``, ``min_scale_schedule``, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: str = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        loss_scale: str = "none",
        scaler_options: Mapping[str, Any] | None = None,
        master_weights: str | None = None,
        seed: int = 0,
    ) -> None:
        if optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
        sgd = optimizer == "sgd"
        cls, kwargs = (torch.optim.SGD, {"momentum": momentum}) if sgd else (torch.optim.Adam, {})
        self.params = list(model.parameters())
        if master_weights is None:
            self.stored = self.params
            self.optimizer = cls(self.params, lr=lr, **kwargs)
        else:
            self.stored = [nn.Parameter(p.detach().to(torch.float16)) for p in self.params]
            self.optimizer = MasterWeightOptimizer(
                self.stored, cls, dtype=torch.float16, rounding=master_weights, seed=seed, lr=lr, **kwargs
            )
            self._load()
        scaler_options = dict(scaler_options or {})
        enabled = loss_scale != "none"
        self.scaler = LossScaler(mode=loss_scale, **scaler_options) if enabled else LossScaler(enabled=False)
        self._backoff = scaler_options.get("backoff_factor", 0.5)
        self.floor_steps = 0

    @torch.no_grad()
    def _load(self) -> None:
        for p, w in zip(self.params, self.stored, strict=True):
            p.copy_(w)

    def step(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled), then one optimizer step unless a gradient overflowed."""
        for p in self.params:
            p.grad = None
        self.scaler.scale(loss).backward()
        if self.stored is not self.params:
            for p, w in zip(self.params, self.stored, strict=True):
                w.grad = None if p.grad is None else p.grad.to(torch.float16)
        before, skipped = self.scaler.get_scale(), self.scaler.skipped_steps
        self.scaler.step(self.optimizer)
        self.scaler.update()
        floor = self.scaler.get_min_scale()
        overflow = self.scaler.skipped_steps > skipped
        if overflow and floor is not None and before * self._backoff < floor == self.scaler.get_scale():
            self.floor_steps += 1
        if self.stored is not self.params:
            self._load()


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy of ``model`` on ``(x, y)`` in percent."""
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item() * 100.0


def train_digits(
    name: str,
    options: dict[str, Any] | None = None,
    *,
    compiled: bool = True,
    epochs: int = 8,
    batch_size: int = 64,
    lr: float = 0.05,
    momentum: float = 0.9,
    optimizer: str = "sgd",
    seed: int = 0,
    loss_scale: str = "none",
    scaler_options: Mapping[str, Any] | None = None,
    master_weights: str | None = None,
    model: nn.Module | None = None,
    data: Split | None = None,
    progress: bool = False,
    telemetry: str | os.PathLike | None = None,
) -> TrainResult:
    """Train a model (default :class:`DigitsCNN`) on the digits set with SGD or Adam.

    ``options`` go to ``torch.compile(backend="lowprec")`` when ``compiled``;
    ``loss_scale``, ``scaler_options`` and ``master_weights`` are :class:`Updater`'s. Per-step
    telemetry (loss, step time, loss scale) goes to the JSON file
    ``telemetry``, or to ``$LOWPREC_DUMP/telemetry/<name>.json`` when that is
    set (``<name>-2.json``, ... where a run of that name wrote one already; see
    :mod:`lpcompile.tools.report`).
    """
    record_path = telemetry_path(name, telemetry)
    record = RunTelemetry(name, meta={"options": options, "compiled": compiled, "loss_scale": loss_scale})
    torch.manual_seed(seed)
    data = data or load_digits()
    model = model or DigitsCNN()
    run = torch.compile(model, backend="lowprec", options=options) if compiled else model
    updater = Updater(
        model,
        optimizer=optimizer,
        lr=lr,
        momentum=momentum,
        loss_scale=loss_scale,
        scaler_options=scaler_options,
        master_weights=master_weights,
        seed=seed,
    )
    scaler = updater.scaler
    order = torch.Generator().manual_seed(seed)
    n = len(data.train_y)
    if epochs < 1 or not 1 <= batch_size <= n:
        raise ValueError(
            f"need epochs ≥ 1 and 1 ≤ batch_size ≤ {n} (the training set), got {epochs}, {batch_size}"
        )
    steps_per_epoch = n // batch_size
    times: list[float] = []
    losses: list[float] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=epochs * steps_per_epoch, desc=f"{name:>14}", leave=False, unit="step")
    for _ in range(epochs):
        perm = torch.randperm(n, generator=order)
        for step in range(steps_per_epoch):
            idx = perm[step * batch_size : (step + 1) * batch_size]
            start = time.perf_counter()
            loss = F.cross_entropy(run(data.train_x[idx]), data.train_y[idx])
            scale = scaler.get_scale() if record_path and scaler.is_enabled() else None
            skipped = scaler.skipped_steps
            updater.step(loss)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
            if record_path:
                skip = scaler.skipped_steps > skipped
                record.step(loss=losses[-1], step_time=times[-1], loss_scale=scale, skipped=skip)
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    median = statistics.median(times[1:]) if len(times) > 1 else times[0]
    model.eval()
    accuracy = evaluate(run, data.test_x, data.test_y)
    model.train()
    result = TrainResult(
        name=name,
        test_accuracy=accuracy,
        final_loss=statistics.fmean(losses[-steps_per_epoch:]),
        step_time=median,
        compile_time=max(times[0] - median, 0.0),
        skipped_steps=scaler.skipped_steps,
        losses=losses,
        floor_steps=updater.floor_steps,
    )
    if record_path:
        for layer in stats(model):  # adaptive loss scaling: each refresh's scale and underflow
            for call, scale, underflow in layer.history:
                record.layer(layer.layer, call, scale=scale, underflow=underflow)
        record.result = {k: v for k, v in result.__dict__.items() if k != "losses"}
        record.write(record_path, keep_existing=telemetry is None)
    dump.flush()  # the backward graphs compiled since the dump was written
    return result
