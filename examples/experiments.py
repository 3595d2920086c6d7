"""The loss-scaling experiment shared by the slow tests and the paper script
(``benchmarks/papers/zhao.py``): one model, one error format, a list of loss-scaling
schemes, several seeds; and :func:`map_runs`, which the paper scripts use to run
independent runs in worker processes."""

from __future__ import annotations

import functools
import math
import multiprocessing
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from examples.data import Split, load_digits
from examples.train import TrainResult, train_digits
from lpcompile.backend import stats

T = TypeVar("T")
R = TypeVar("R")

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


@dataclass(frozen=True)
class Job:
    """One run of :func:`compare_loss_scaling`: a scheme (``None``: FP32, uncompiled) and a
    seed, with the experiment's model, format and training. It pickles (``model`` a class
    or a :func:`functools.partial` of one), so a worker process can run it."""

    scheme: Scheme | None
    seed: int
    model: Callable[[], nn.Module]
    errors: Mapping[str, Any]
    epochs: int = 8
    lr: float = 1e-3
    interval: int = 5
    batch_size: int = 128
    executor: str = "eager"
    options: Mapping[str, Any] | None = None

    @property
    def name(self) -> str:
        return "fp32" if self.scheme is None else self.scheme.name

    def graph_options(self) -> dict[str, Any]:
        """The ``torch.compile`` options of a lowprec run (empty for FP32)."""
        if self.scheme is None:
            return {}
        return {
            **self.errors,
            "executor": self.executor,
            "loss_scale_interval": self.interval,
            **(self.options or {}),
            **self.scheme.graph,
        }


def loss_scaling_jobs(
    schemes: Sequence[Scheme],
    model: Callable[[], nn.Module],
    errors: Mapping[str, Any],
    seeds: Sequence[int] = (0,),
    epochs: int = 8,
    lr: float = 1e-3,
    interval: int = 5,
    batch_size: int = 128,
    executor: str = "eager",
    options: Mapping[str, Any] | None = None,
    fp32: bool = True,
) -> list[Job]:
    """The runs of :func:`compare_loss_scaling`, in its order: FP32's seeds (unless
    ``fp32=False``), then each scheme's seeds."""
    setting = {
        "model": model,
        "errors": errors,
        "epochs": epochs,
        "lr": lr,
        "interval": interval,
        "batch_size": batch_size,
        "executor": executor,
        "options": options,
    }
    firsts: list[Scheme | None] = [None] if fp32 else []
    return [Job(scheme, seed, **setting) for scheme in [*firsts, *schemes] for seed in seeds]


# The graph setting this process compiled last (the model's repr and the options), and the
# data its worker was given.
_compiled_for: tuple[str, dict[str, Any]] | None = None
_worker_data: Split | None = None


def run_job(job: Job, data: Split | None = None) -> ScalingRun:
    """Train one :class:`Job` on digits with Adam.

    The model is built after ``torch.manual_seed(job.seed)``, which also sets the batch
    order. Dynamo's cache is reset when the graph setting (model and options) differs from
    the one this process compiled last, so the runs of one setting (the global schemes,
    the seeds) reuse its compiled graphs, each model with its own scaling state, and the
    training and evaluation graphs stay inside Dynamo's recompile limit. The result does
    not depend on which runs came before in the process; the first run of a setting
    includes its compilation in its ``seconds``.
    """
    global _compiled_for
    if data is None:
        data = _worker_data if _worker_data is not None else load_digits()
    common = {
        "data": data,
        "epochs": job.epochs,
        "batch_size": job.batch_size,
        "lr": job.lr,
        "optimizer": "adam",
    }
    torch.manual_seed(job.seed)
    net = job.model()
    if job.scheme is None:
        start = time.perf_counter()
        result = train_digits("fp32", None, compiled=False, model=net, seed=job.seed, **common)
        return ScalingRun("fp32", job.seed, result, [], [], time.perf_counter() - start)
    run_options = job.graph_options()
    setting = (repr(job.model), run_options)
    if setting != _compiled_for:
        torch._dynamo.reset()
        _compiled_for = setting
    start = time.perf_counter()
    result = train_digits(
        job.name,
        run_options,
        model=net,
        seed=job.seed,
        loss_scale=job.scheme.scaler,
        scaler_options=job.scheme.scaler_options,
        **common,
    )
    layers = stats(net)
    return ScalingRun(
        job.name,
        job.seed,
        result,
        [t.underflow for t in layers],
        [t.cumulative for t in layers],
        time.perf_counter() - start,
    )


def _start_worker(setup: Callable[..., None] | None, args: tuple) -> None:
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    if setup is not None:
        setup(*args)


def map_runs(
    run: Callable[[T], R],
    jobs: Iterable[T],
    workers: int = 1,
    setup: Callable[..., None] | None = None,
    setup_args: tuple = (),
) -> Iterator[R]:
    """``run(job)`` for every job, yielded in the jobs' order, ``workers`` at a time.

    ``workers`` > 1 runs the jobs in that many spawned processes of one torch thread each,
    each first calling ``setup(*setup_args)``; ``run``, ``setup`` and the jobs must pickle
    (module-level functions). A run that seeds itself and uses one thread gives the same
    result in a worker as in this process: the pool changes the wall time only. With
    ``workers`` = 1 the jobs run here, one after another, with this process's threads.
    """
    if workers <= 1:
        yield from map(run, jobs)
        return
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(setup, setup_args)
    )
    try:
        yield from pool.map(run, jobs)
    finally:  # closed early (an error, a caller that stops): drop the runs not started
        pool.shutdown(cancel_futures=True)


def _keep_data(data: Split | None) -> None:
    global _worker_data
    _worker_data = data


def run_jobs(jobs: Sequence[Job], data: Split | None = None, workers: int = 1) -> Iterator[ScalingRun]:
    """:func:`run_job` for each job, yielded in the jobs' order (:func:`map_runs`; ``data``
    sent once to each worker)."""
    if workers <= 1:
        return map(functools.partial(run_job, data=data), jobs)
    return map_runs(run_job, jobs, workers, _keep_data, (data,))


def compare_loss_scaling(
    schemes: Sequence[Scheme],
    model: Callable[[], nn.Module],
    errors: Mapping[str, Any],
    data: Split | None = None,
    workers: int = 1,
    **setting: Any,
) -> list[ScalingRun]:
    """FP32 (unless ``fp32=False``) and each scheme, trained with Adam on digits.

    ``model()`` builds a fresh model after the seed is set; ``errors`` are the lowprec
    options of the format (a :data:`FORMATS` entry); ``setting`` (seeds, epochs, lr,
    interval, batch size, executor, ``options`` added to every lowprec run's, ``fp32``) as
    :func:`loss_scaling_jobs` takes it. Every lowprec run compiles with
    ``loss_scale="adaptive"`` and records the statistics every ``interval`` calls, so each
    layer's underflow is measured the same way whatever the scheme. Each seed sets the
    initialisation and the batch order of one run of every scheme. ``workers``: see
    :func:`run_jobs` (``model`` must then pickle).
    """
    jobs = loss_scaling_jobs(schemes, model, errors, **setting)
    return list(run_jobs(jobs, load_digits() if data is None else data, workers))


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
