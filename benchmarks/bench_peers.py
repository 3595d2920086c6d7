"""Training-step time of lowprec beside its peers: QPyTorch and torchao float8.

The issue's two models (MLP and digits CNN), with the batches and SGD step of
``bench_train_step.py``. Each peer emulates FP8 training its own way, so the
numerics differ:

* QPyTorch (``qtorch``, eager only: its quantizers are C++ extension calls that
  Dynamo cannot trace) is put at lowprec's ``fp8-e5m2-sr`` sites: activations and
  weights rounded to nearest in the forward, errors and weight gradients rounded
  stochastically in the backward, all with ``FloatingPoint(exp=5, man=2)``. It
  rounds like E5M2 in the normal and subnormal ranges but neither saturates nor
  overflows above 57344.
* torchao float8 training (``emulate=True``, the CPU mode) casts with a dynamic
  per-tensor scale, E4M3 for activations and weights and E5M2 for the gradient
  the backward matmuls read, round to nearest; weight gradients stay FP32. It
  takes only ``nn.Linear`` layers whose sizes are multiples of 16, so the MLP's
  last layer (10 outputs) stays FP32 and the CNN has no torchao row.
  lowprec's ``fp8-tensorwise`` is the same recipe (on the layers torchao converts,
  the same outputs and weight gradients, bit for bit; lowprec rounds the MLP's last
  layer too); ``fp8-hybrid`` is its unscaled form. torchao's rowwise recipe (E4M3
  everywhere, a power-of-two factor per row of each GEMM operand) and lowprec's
  ``fp8-rowwise`` are another such pair. lowprec's ``mxfp8`` has no torchao row here:
  torchao's MXFP8 casts need every summed dimension a multiple of 32 (the MLP's is 784).

Run with the ``bench`` extra installed (``pip install -e ".[bench]"``); a peer
that is not installed gets a row saying so.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_train_step import CASES, sgd_step, step_fn
from benchmarks.common import interleaved_times, write_results

OURS = "lowprec fp8-e5m2-sr, Inductor"
LOWPREC = {
    "fp32 Inductor": "inductor",
    OURS: {"recipe": "fp8-e5m2-sr", "executor": "inductor"},
    "lowprec fp8-hybrid, Inductor": {"recipe": "fp8-hybrid", "executor": "inductor"},
    "lowprec fp8-tensorwise, Inductor": {"recipe": "fp8-tensorwise", "executor": "inductor"},
    "lowprec fp8-rowwise, Inductor": {"recipe": "fp8-rowwise", "executor": "inductor"},
    "lowprec mxfp8, Inductor": {"recipe": "mxfp8", "executor": "inductor"},
    "lowprec fp8-e5m2-sr, eager executor": {"recipe": "fp8-e5m2-sr", "executor": "eager"},
}


class QPyTorchSites(nn.Module):
    """A Linear or Conv2d with QPyTorch quantizers at lowprec's ``fp8-e5m2-sr`` sites."""

    def __init__(self, layer: nn.Linear | nn.Conv2d) -> None:
        from qtorch import FloatingPoint
        from qtorch.quant import quantizer

        super().__init__()
        self.layer = layer
        e5m2 = FloatingPoint(exp=5, man=2)
        # forward RNE (activation); backward identity
        self.activation = quantizer(forward_number=e5m2, forward_rounding="nearest")
        # forward RNE (weight); backward SR (weight gradient)
        self.weight = quantizer(
            forward_number=e5m2,
            backward_number=e5m2,
            forward_rounding="nearest",
            backward_rounding="stochastic",
        )
        # forward identity; backward SR (error)
        self.error = quantizer(backward_number=e5m2, backward_rounding="stochastic")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, w = self.activation(x), self.weight(self.layer.weight)
        if isinstance(self.layer, nn.Linear):
            y = F.linear(x, w, self.layer.bias)
        else:
            y = self.layer._conv_forward(x, w, self.layer.bias)
        return self.error(y)


def with_qpytorch(model: nn.Sequential) -> nn.Sequential:
    """``model`` with every Linear and Conv2d wrapped in :class:`QPyTorchSites`."""
    return nn.Sequential(
        *(QPyTorchSites(m) if isinstance(m, (nn.Linear, nn.Conv2d)) else m for m in model)
    )


def with_torchao_float8(model: nn.Module, recipe: str = "tensorwise") -> nn.Module:
    """``model`` converted by torchao's float8 training (emulated) with ``recipe``, sizes
    permitting."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(
        model,
        config=Float8LinearConfig(**{**config.__dict__, "emulate": True}),
        module_filter_fn=lambda m, _: m.in_features % 16 == 0 and m.out_features % 16 == 0,
    )


def peer_steps(model_fn: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, case: str) -> dict:
    """Step functions of the installed peers; ``None`` for a peer that is missing or not applicable."""
    steps: dict[str, Callable[[], None] | None] = {}
    if importlib.util.find_spec("qtorch") is None:
        steps["QPyTorch, eager (not installed)"] = None
    else:
        torch.manual_seed(0)
        model = with_qpytorch(model_fn())
        steps["QPyTorch fp8-e5m2-sr sites, eager"] = sgd_step(model, model, x, y)
    if importlib.util.find_spec("torchao") is None:
        steps["torchao float8 (not installed)"] = None
    elif "CNN" in case:
        steps["torchao float8 (no Linear-only variant of a CNN)"] = None
    else:
        for compiled in (False, True):
            torch.manual_seed(0)
            model = with_torchao_float8(model_fn())
            run = torch.compile(model) if compiled else model
            name = f"torchao float8 emulate, {'Inductor' if compiled else 'eager'}"
            steps[name] = sgd_step(model, run, x, y)
        torch.manual_seed(0)
        model = with_torchao_float8(model_fn(), "rowwise")
        steps["torchao float8 rowwise emulate, Inductor"] = sgd_step(model, torch.compile(model), x, y)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rows = [
        "| model | variant | step ms | × fp32 Inductor | lowprec fp8-e5m2-sr compiled is faster by |",
        "|---|---|---|---|---|",
    ]
    for case in ("MLP 784-1024-1024-10, batch 128", "digits CNN, batch 64"):
        model_fn, x, y = CASES[case]
        torch._dynamo.reset()
        steps = {name: step_fn(model_fn, x, y, backend) for name, backend in LOWPREC.items()}
        peers = peer_steps(model_fn, x, y, case)
        steps.update({name: fn for name, fn in peers.items() if fn is not None})
        times = {name: statistics.median(ts) for name, ts in interleaved_times(steps, args.rounds).items()}
        for name, t in times.items():
            print(f"{case:<34} {name:<40} {t * 1e3:8.2f} ms", flush=True)
            rows.append(
                f"| {case} | {name} | {t * 1e3:.2f} | {t / times['fp32 Inductor']:.2f} "
                f"| {t / times[OURS]:.1f}× |"
            )
        rows += [f"| {case} | {name} | — | — | — |" for name, fn in peers.items() if fn is None]
    body = "\n".join(rows)
    body += (
        f"\n\nMedian step of each variant over {args.rounds} rounds; a round runs 10 steps of every"
        " variant in turn (after 3 warm-up steps, compile excluded). A step is forward, backward"
        " and SGD with momentum, as in train_step.md. The peers' numerics differ from lowprec's:"
        " see the docstring of benchmarks/bench_peers.py."
    )
    print(body)
    write_results("peers", "Training-step time beside the peers (bench_peers.py)", body)


if __name__ == "__main__":
    main()
