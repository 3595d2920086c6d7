"""Compiled autograd under DDP (``optimize_ddp="python_reducer"``, the setting DDP needs
for it): on two gloo ranks, the backward traced by compiled autograd, compiled with
lowprec or with torchtitan's Inductor context, trains bit for bit as autograd's does,
stochastic rounding included; and not as the FP32 recipe does."""

from __future__ import annotations

import pytest
import torch
from grid import backward_compiler
from ranks import EAGER_SR, mlp3, run_ranks
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 2
COMPILERS = (None, "lowprec", "inductor")  # None: autograd


def _train(rank: int, compiler: str | None, options: dict = EAGER_SR) -> dict:
    torch._dynamo.reset()
    counters.clear()
    model = mlp3()
    run = torch.compile(DDP(model), backend="lowprec", options=options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
        loss = run(x).square().mean()
        losses.append(loss.item())
        with backward_compiler(compiler, options):
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "captures": counters["compiled_autograd"]["captures"],
    }


def train_with_compiled_autograd(rank: int) -> dict:
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        runs = {compiler: _train(rank, compiler) for compiler in COMPILERS}
        runs["fp32"] = _train(rank, None, {"recipe": "fp32", "executor": "eager"})
        return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    return run_ranks(train_with_compiled_autograd, tmp_path_factory.mktemp("ca"), deadline=240.0).check()


@pytest.mark.parametrize("compiler", COMPILERS[1:])
def test_compiled_autograd_under_ddp_trains_as_autograd(runs, compiler):
    for rank, by_compiler in enumerate(runs):
        run, reference = by_compiler[compiler], by_compiler[None]
        assert run["captures"] > 0, f"rank {rank}: compiled autograd did not run"
        assert run["losses"] == reference["losses"], f"rank {rank}"
        assert all(torch.equal(a, b) for a, b in zip(run["params"], reference["params"], strict=True))
    # DDP averaged the gradients: the ranks, fed different data, hold the same parameters
    first, second = (by_compiler[compiler]["params"] for by_compiler in runs)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    # it rounds: the FP32 recipe trains otherwise
    assert not all(torch.equal(a, b) for a, b in zip(first, runs[0]["fp32"]["params"], strict=True))
