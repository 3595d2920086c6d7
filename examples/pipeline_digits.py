"""The pipelined-backpropagation experiment on the digits set (slow test and benchmark).

Every variant trains :class:`examples.models.DigitsCNN` (GroupNorm) with
batch size 1 and the same per-sample hyperparameters, the learning rate
decaying linearly to zero over the run. ``"SGD"`` is the one-stage pipeline
(no delay: plain SGD with momentum, bit for bit); the others cut the CNN into
one stage per layer (S = 4, delays 6, 4, 2, 0).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from examples.data import Split, load_digits
from examples.models import DigitsCNN
from lpcompile.runtime.pipeline.trainer import PipelinedTrainer

# name -> PipelinedTrainer settings
VARIANTS: dict[str, dict[str, Any]] = {
    "SGD": {"stages": 1},
    "PB": {"stages": "layer"},
    "PB+SC": {"stages": "layer", "spike_compensation": True},
    "PB+LWPv": {"stages": "layer", "prediction": "lwp_v"},
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
    losses: list[float] = field(default_factory=list, repr=False)


def run_digits(
    variant: str,
    *,
    lr: float,
    momentum: float,
    epochs: int = 3,
    seed: int = 0,
    data: Split | None = None,
    threads: int | None = 1,
) -> DigitsRun:
    """Train one variant of :data:`VARIANTS`; see the module doc."""
    data = data or load_digits()
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)  # batch 1: threads only add overhead
    try:
        torch.manual_seed(seed)
        model = DigitsCNN()
        trainer = PipelinedTrainer(model, data.train_x[:1], lr=lr, momentum=momentum, **VARIANTS[variant])
        n = len(data.train_y)
        total = epochs * n
        order = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        for _ in range(epochs):
            for i in torch.randperm(n, generator=order).tolist():
                for group in trainer.optimizer.param_groups:
                    group["lr"] = lr * (1.0 - trainer.samples / total)
                trainer.step(data.train_x[i : i + 1], data.train_y[i : i + 1])
        trainer.drain()
        seconds = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            accuracy = (model(data.test_x).argmax(1) == data.test_y).float().mean().item() * 100.0
    finally:
        torch.set_num_threads(previous)
    losses = trainer.losses
    final = statistics.fmean(losses[-n:])
    return DigitsRun(variant, seed, accuracy, final, seconds, trainer.delays, lr, momentum, list(losses))
