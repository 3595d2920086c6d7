"""Compiled autograd (``torch._dynamo.config.compiled_autograd``, or torchtitan's
``maybe_enable_compiled_autograd``) traces the autograd graph, lowprec's compiled
backward included, into one graph of its own and compiles that. The backward's products
stay rounded: checked by ``GridCheck`` on every graph's call (torch's own float8 cast),
and against the same training run without compiled autograd, bit for bit."""

from __future__ import annotations

import pytest
import torch
from grid import SR_EVERYWHERE, GridCheck, backward_compiler, watched_backend
from torch import nn
from torch._dynamo.utils import counters

from lpcompile import LossScaler
from lpcompile.backend.state import REGISTRY

STEPS = 3
ADAPTIVE = {"recipe": "fp8-e5m2-als", "executor": "eager", "loss_scale_interval": 1}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) * 3


def test_a_compiled_step_with_compiled_autograd_runs_every_product_on_the_grid():
    """The step compiled whole, its backward inside: compiled autograd hands the backward's
    graph to the same backend, whose calls the check watches (each step: two addmm in the
    forward; the error's and two weight gradients' mm in the backward)."""
    torch._dynamo.reset()
    counters.clear()
    check = GridCheck()
    backend = watched_backend(SR_EVERYWHERE, check)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss

    with torch._dynamo.config.patch(compiled_autograd=True):  # read when torch.compile is called
        step = torch.compile(step, backend=backend)
        for i in range(STEPS):
            step(_inputs(i))
            optimizer.step()
            optimizer.zero_grad()
    assert counters["compiled_autograd"]["captures"] > 0  # the backward ran in compiled autograd's graph
    assert dict(check.products) == {("addmm.default", True): 2 * STEPS, ("mm.default", True): 3 * STEPS}
    assert not check.unknown


def _train(options: dict, compiler: str | None) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """``STEPS`` steps of the model compiled with lowprec, its backward run by compiled
    autograd compiled with ``compiler`` ("lowprec", or torchtitan's Inductor context) or,
    for None, by autograd: the final parameters, the losses and the per-layer scales."""
    torch._dynamo.reset()
    model = _model()
    run = torch.compile(model, backend="lowprec", options=options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler("adaptive") if options is ADAPTIVE else None
    losses = []
    for i in range(STEPS):
        loss = run(_inputs(i)).square().mean()
        if scaler:
            loss = loss * 2.0**-14  # errors small enough that the per-layer scales rise
        losses.append(loss.item())
        scaled = scaler.scale(loss) if scaler else loss
        with backward_compiler(compiler, options):
            scaled.backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    scales = [scale for state in REGISTRY.adaptive_states(model) for scale in state.scales.tolist()]
    return [p.detach().clone() for p in model.parameters()], losses, scales


@pytest.mark.parametrize(
    "options, compiler",
    [(SR_EVERYWHERE, "lowprec"), (ADAPTIVE, "lowprec"), (SR_EVERYWHERE, "inductor")],
    ids=["stochastic rounding", "adaptive loss scaling", "torchtitan's Inductor context"],
)
def test_compiled_autograd_trains_bit_for_bit_as_autograd(options, compiler):
    """The backward's rounding, its random bits and the per-layer scales' statistics are
    the compiled backward's own, wherever it runs. An independent check that it rounds at
    all: without lowprec the parameters differ."""
    counters.clear()
    params, losses, scales = _train(options, compiler)
    assert counters["compiled_autograd"]["captures"] > 0
    reference, reference_losses, reference_scales = _train(options, None)
    assert losses == reference_losses and scales == reference_scales
    assert all(torch.equal(a, b) for a, b in zip(params, reference, strict=True))
    if options is ADAPTIVE:
        assert min(scales) > 1  # the statistics compiled autograd's backward recorded moved them
    fp32, _, _ = _train({"recipe": "fp32", "executor": "eager"}, None)
    assert not all(torch.equal(a, b) for a, b in zip(params, fp32, strict=True))
