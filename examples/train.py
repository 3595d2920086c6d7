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
    model: nn.Module | None = None,
    data: Split | None = None,
    progress: bool = False,
    telemetry: str | os.PathLike | None = None,
) -> TrainResult:
    """Train a model (default :class:`DigitsCNN`) on the digits set with SGD or Adam.

    ``options`` go to ``torch.compile(backend="lowprec")`` when ``compiled``;
    ``loss_scale`` is ``"none"`` or a :class:`LossScaler` mode, ``scaler_options`` its
    settings (``init_scale``, ``growth_interval``, ...). Per-step
    telemetry (loss, step time, loss scale) goes to the JSON file
    ``telemetry``, or to ``$LOWPREC_DUMP/telemetry/<name>.json`` when that is
    set (see :mod:`lpcompile.tools.report`).
    """
    record_path = telemetry_path(name, telemetry)
    record = RunTelemetry(name, meta={"options": options, "compiled": compiled, "loss_scale": loss_scale})
    torch.manual_seed(seed)
    data = data or load_digits()
    model = model or DigitsCNN()
    run = torch.compile(model, backend="lowprec", options=options) if compiled else model
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    elif optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
    enabled = loss_scale != "none"
    scaler = LossScaler(loss_scale if enabled else "dynamic", enabled=enabled, **(scaler_options or {}))
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
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(run(data.train_x[idx]), data.train_y[idx])
            scaler.scale(loss).backward()
            scale = scaler.get_scale() if record_path and scaler.is_enabled() else None
            skipped = scaler.skipped_steps
            scaler.step(opt)
            scaler.update()
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
    )
    if record_path:
        for layer in stats(model):  # adaptive loss scaling: each refresh's scale and underflow
            for call, scale, underflow in layer.history:
                record.layer(layer.layer, call, scale=scale, underflow=underflow)
        record.result = {k: v for k, v in result.__dict__.items() if k != "losses"}
        record.write(record_path)
    dump.flush()  # the backward graphs compiled since the dump was written
    return result
