"""The pipelined-backpropagation experiment on the digits set (slow test and paper script).

A run trains a GroupNorm model (:class:`examples.models.DigitsCNN` by default)
with the learning rate decaying linearly to zero over the run. At batch size 1
``"SGD"`` is the one-stage pipeline (no delay: plain SGD with momentum, bit for
bit) and the other variants cut the model into one stage per layer (DigitsCNN:
S = 4, delays 6, 4, 2, 0). ``"SGD"`` also runs at a batch size B > 1: plain
minibatch SGD with momentum, the paper's baseline.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from examples.data import Split, load_digits
from examples.models import DigitsCNN
from lpcompile.runtime.pipeline.trainer import PipelinedTrainer

# name -> PipelinedTrainer settings
VARIANTS: dict[str, dict[str, Any]] = {
    "SGD": {"stages": 1},
    "PB": {"stages": "layer"},
    "PB+SC": {"stages": "layer", "spike_compensation": True},
    "PB+LWPv": {"stages": "layer", "prediction": "lwp_v"},
    "PB+LWPw": {"stages": "layer", "prediction": "lwp_w"},
    "PB+SC+LWPv": {"stages": "layer", "spike_compensation": True, "prediction": "lwp_v"},
    "PB+stash": {"stages": "layer", "weight_stash": True},
}


@dataclass
class DigitsRun:
    variant: str
    seed: int
    test_accuracy: float  # percent; 10% (chance) or NaN loss means the run diverged
    final_loss: float  # mean training loss over the last epoch
    seconds: float
    delays: list[int]
    lr: float
    momentum: float
    batch_size: int = 1
    losses: list[float] = field(default_factory=list, repr=False)  # per sample (a batch's mean at B > 1)
    loss_scales: dict[int, float] = field(default_factory=dict)  # per stage, at the end
    skipped: dict[int, int] = field(default_factory=dict)  # per stage: updates skipped for inf/NaN


def run_digits(
    variant: str,
    *,
    lr: float,
    momentum: float,
    epochs: int = 3,
    seed: int = 0,
    data: Split | None = None,
    threads: int | None = 1,
    model: Callable[[], nn.Module] = DigitsCNN,
    batch_size: int = 1,
    options: dict[str, Any] | None = None,
) -> DigitsRun:
    """Train one variant of :data:`VARIANTS` on a new ``model()``; see the module doc.

    ``batch_size`` > 1 is for ``"SGD"`` only: minibatch SGD with momentum, the samples in
    a new random order each epoch, the last batch of an epoch smaller. ``options``: more
    :class:`PipelinedTrainer` arguments (``compile``, ``loss_scale``, ...).
    """
    if batch_size != 1 and variant != "SGD":
        raise ValueError(f"only SGD runs at batch size {batch_size}; {variant!r} pipelines one sample a step")
    data = data or load_digits()
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)  # small batches: threads only add overhead
    try:
        torch.manual_seed(seed)
        net = model()
        order = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        scales: dict[int, float] = {}
        skipped: dict[int, int] = {}
        if batch_size == 1:
            settings = {**VARIANTS[variant], **(options or {})}
            trainer = _pipelined(net, settings, lr, momentum, epochs, order, data)
            losses, delays = list(trainer.losses), trainer.delays
            scales, skipped = trainer.loss_scales, trainer.skipped_samples
        else:
            losses, delays = _minibatch(net, lr, momentum, epochs, batch_size, order, data), [0]
        seconds = time.perf_counter() - start
        net.eval()
        with torch.no_grad():
            accuracy = (net(data.test_x).argmax(1) == data.test_y).float().mean().item() * 100.0
    finally:
        torch.set_num_threads(previous)
    final = statistics.fmean(losses[-len(data.train_y) :])
    return DigitsRun(
        variant, seed, accuracy, final, seconds, delays, lr, momentum, batch_size, losses, scales, skipped
    )


def _pipelined(
    net: nn.Module,
    settings: dict[str, Any],
    lr: float,
    momentum: float,
    epochs: int,
    order: torch.Generator,
    data: Split,
) -> PipelinedTrainer:
    trainer = PipelinedTrainer(net, data.train_x[:1], lr=lr, momentum=momentum, **settings)
    n = len(data.train_y)
    total = epochs * n
    for _ in range(epochs):
        for i in torch.randperm(n, generator=order).tolist():
            for group in trainer.optimizer.param_groups:
                group["lr"] = lr * (1.0 - trainer.samples / total)
            trainer.step(data.train_x[i : i + 1], data.train_y[i : i + 1])
    trainer.drain()
    return trainer


def _minibatch(
    net: nn.Module,
    lr: float,
    momentum: float,
    epochs: int,
    batch_size: int,
    order: torch.Generator,
    data: Split,
) -> list[float]:
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    n = len(data.train_y)
    total = epochs * n
    losses: list[float] = []
    for _ in range(epochs):
        for batch in torch.randperm(n, generator=order).split(batch_size):
            optimizer.param_groups[0]["lr"] = lr * (1.0 - len(losses) / total)
            loss = F.cross_entropy(net(data.train_x[batch]), data.train_y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses += [loss.item()] * len(batch)
    return losses
