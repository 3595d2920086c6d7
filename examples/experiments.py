"""The loss-scaling experiment shared by the slow tests and the paper script
(``benchmarks/papers/zhao.py``): one model, one error format, a list of loss-scaling
schemes, several seeds."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from examples.data import Split, load_digits
from examples.train import TrainResult, train_digits
from lpcompile.backend import stats

# The error formats compared (the weights and activations are those of the recipe).
FORMATS: dict[str, dict[str, Any]] = {
    "fp16": {"recipe": "fp16-als"},
    "e5m2": {"recipe": "fp8-e5m2-als"},  # E5M2 errors, stochastic rounding
    # E4M3 errors (18 binades between its smallest subnormal and its max), round to nearest
    "e4m3": {"recipe": "fp8-e5m2-als", "error": {"fmt": "e4m3", "rounding": "nearest"}},
}

# The setup of the error-decay ablation: each hidden layer of a DeepTanhMLP shrinks the
# error by 2^-1.25 (2^-13.75 over the 11 of them), a construct that puts the lowest layers'
# errors binades below the top ones'. They then need cumulative scales up to 2^26-2^27,
# above the default cap for E4M3 errors (2^25): the cap is raised.
DECAYING_ERRORS: dict[str, Any] = {
    "error_decay": 2.0**-1.25,
    "options": {"loss_scale_max_cumulative": 2.0**30},
}
SEEDS = (0, 1, 2, 3, 4)
# The natural-spread experiment: UnnormalizedResNet on digits, 88 steps of Adam.
RESNET_TRAINING: dict[str, Any] = {"epochs": 4, "batch_size": 64, "lr": 1e-3, "interval": 10}
# GradScaler's growth interval (2000 steps) assumes runs of 10^5 steps; these take about a
# hundred, so the dynamic scale may grow every 20 clean steps.
GROWTH_INTERVAL = 20


@dataclass(frozen=True)
class Scheme:
    """A loss-scaling scheme: the graph's per-layer scaling options and the
    :class:`~lpcompile.runtime.scaler.LossScaler` mode and settings that go with them."""

    name: str
    scaler: str
    scaler_options: Mapping[str, Any] = field(default_factory=dict)
    graph: Mapping[str, Any] = field(default_factory=dict)


# The global schemes keep every layer's in-graph scale at 1 ("fixed" rule): the graph only
# measures each layer's underflow, and the loss scale does the scaling.
GLOBAL = {"loss_scale_rule": "fixed"}


def fixed(exponent: int) -> Scheme:
    """A fixed loss scale 2^exponent (a step with inf/NaN gradients is skipped)."""
    return Scheme(f"fixed 2^{exponent}", "static", {"init_scale": 2.0**exponent}, GLOBAL)


def dynamic(growth_interval: int = 2000) -> Scheme:
    """GradScaler's rule: start at 2^16, halve and skip on overflow, double after
    ``growth_interval`` clean steps."""
    return Scheme("dynamic", "dynamic", {"growth_interval": growth_interval}, GLOBAL)


ADAPTIVE = Scheme("adaptive", "adaptive")


@dataclass
class ScalingRun:
    """One training run with its per-layer underflow at the last refresh (input side first)."""

    name: str
    seed: int
    result: TrainResult
    underflow: list[float]
    scales: list[float]
    seconds: float = 0.0  # the run's wall time, training and evaluation


def compare_loss_scaling(
    schemes: Sequence[Scheme],
    model: Callable[[], nn.Module],
    errors: Mapping[str, Any],
    seeds: Sequence[int] = (0,),
    epochs: int = 8,
    lr: float = 1e-3,
    interval: int = 5,
    batch_size: int = 128,
    data: Split | None = None,
    executor: str = "eager",
    options: Mapping[str, Any] | None = None,
    fp32: bool = True,
) -> list[ScalingRun]:
    """FP32 (unless ``fp32=False``) and each scheme, trained with Adam on digits.

    ``model()`` builds a fresh model after the seed is set; ``errors`` are the lowprec
    options of the format (a :data:`FORMATS` entry); ``options`` add to every lowprec
    run's. Every lowprec run compiles with ``loss_scale="adaptive"`` and records the
    statistics every ``interval`` calls, so each layer's underflow is measured the same
    way whatever the scheme. Each seed sets the initialisation and the batch order of one
    run of every scheme. The first run of each graph setting includes its compilation
    in its ``seconds``.
    """
    data = data or load_digits()
    common = {"data": data, "epochs": epochs, "batch_size": batch_size, "lr": lr, "optimizer": "adam"}

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return model()

    runs = []
    for seed in seeds if fp32 else ():
        start = time.perf_counter()
        result = train_digits("fp32", None, compiled=False, model=build(seed), seed=seed, **common)
        runs.append(ScalingRun("fp32", seed, result, [], [], time.perf_counter() - start))
    compiled_for = None
    for scheme in schemes:
        run_options = {
            **errors,
            "executor": executor,
            "loss_scale_interval": interval,
            **(options or {}),
            **scheme.graph,
        }
        if run_options != compiled_for:
            # A fresh Dynamo cache per graph setting keeps the training and evaluation graphs
            # inside Dynamo's recompile limit; runs with the same setting (the global schemes,
            # the seeds) reuse the compiled graphs, each model with its own scaling state.
            torch._dynamo.reset()
            compiled_for = run_options
        for seed in seeds:
            net = build(seed)
            start = time.perf_counter()
            result = train_digits(
                scheme.name,
                run_options,
                model=net,
                seed=seed,
                loss_scale=scheme.scaler,
                scaler_options=scheme.scaler_options,
                **common,
            )
            layers = stats(net)
            runs.append(
                ScalingRun(
                    scheme.name,
                    seed,
                    result,
                    [t.underflow for t in layers],
                    [t.cumulative for t in layers],
                    time.perf_counter() - start,
                )
            )
    return runs


def worst_underflow(runs: Sequence[ScalingRun]) -> list[float]:
    """Per layer, the largest underflow over the runs; a layer that got no non-zero error
    at all (NaN: everything above it flushed) counts as 1."""
    layers = zip(*(r.underflow for r in runs), strict=True)
    return [max(1.0 if math.isnan(u) else u for u in layer) for layer in layers]


def by_variant(runs: Sequence[ScalingRun]) -> dict[str, list[ScalingRun]]:
    """The runs grouped by variant name, in the order they ran."""
    groups: dict[str, list[ScalingRun]] = {}
    for run in runs:
        groups.setdefault(run.name, []).append(run)
    return groups
