"""Training under DDP: two ranks against one process, and a rank that dies mid-step.

With round-to-nearest (``fp8-e5m2``) no random bits are drawn, so a two-rank run must
equal one process on the concatenated batch: the same outputs row for row, and, after
DDP's FP32 average, the same gradients and weights. The weight gradient is quantized on
each rank before the reduction, so the one-process run quantizes it per shard too (it
accumulates the two shards' gradients): one quantize of the whole batch's gradient is a
different number, which the last test checks.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from ranks import mlp3, run_ranks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from lpcompile import LossScaler

NEAREST = {"recipe": "fp8-e5m2", "executor": "eager"}
STEPS = 2
LR = 0.1


def batch(step: int) -> torch.Tensor:
    """The concatenated batch of ``step``: rank r trains on rows 4r..4r+3."""
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(100 + step))


def shard(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x[4 * rank : 4 * rank + 4]


def train_ddp(rank: int) -> dict:
    torch._dynamo.reset()
    model = mlp3()
    ddp = torch.compile(DDP(model), backend="lowprec", options=NEAREST)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    outputs, grads = [], []
    for s in range(STEPS):
        y = ddp(shard(batch(s), rank))
        y.square().mean().backward()
        outputs.append(y.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return {"outputs": outputs, "grads": grads, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> list[dict]:
    return run_ranks(train_ddp, tmp_path_factory.mktemp("ddp")).check()


def assert_fp32_close(got: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    """Equal up to FP32 sums in another order: relative to the tensor's largest value."""
    scale = float(expected.abs().max()) or 1.0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * scale, msg=label)


def test_two_ranks_train_as_one_process_on_the_concatenated_batch(ddp_run):
    torch._dynamo.reset()
    model = mlp3()
    compiled = torch.compile(model, backend="lowprec", options=NEAREST)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(STEPS):
        x = batch(s)
        with torch.no_grad():
            y = compiled(x)
        for rank, run in enumerate(ddp_run):
            assert_fp32_close(run["outputs"][s], shard(y, rank), f"step {s}: rank {rank}'s outputs")
        for rank in range(2):  # each shard's weight gradient quantized on its own, as on its rank
            compiled(shard(x, rank)).square().mean().backward()
        for i, p in enumerate(model.parameters()):
            p.grad /= 2
            for rank, run in enumerate(ddp_run):
                assert_fp32_close(run["grads"][s][i], p.grad, f"step {s}: rank {rank}'s gradient {i}")
        optimizer.step()
        optimizer.zero_grad()
    for i, p in enumerate(model.parameters()):
        for rank, run in enumerate(ddp_run):
            assert_fp32_close(run["params"][i], p.detach(), f"rank {rank}'s parameter {i}")


def test_the_weight_gradient_is_quantized_before_the_reduction(ddp_run):
    """One quantize of the concatenated batch's weight gradient is not what DDP computes."""
    torch._dynamo.reset()
    model = mlp3()
    torch.compile(model, backend="lowprec", options=NEAREST)(batch(0)).square().mean().backward()
    weight = model[0].weight.grad
    assert (weight != ddp_run[0]["grads"][0][0]).any()


def die_in_the_second_step(rank: int) -> None:
    torch._dynamo.reset()
    model = mlp3()
    ddp = torch.compile(DDP(model), backend="lowprec", options=NEAREST)
    for s in range(2):
        loss = ddp(shard(batch(s), rank)).square().mean()
        if s == 1 and rank == 1:
            os._exit(17)  # dies between its forward and its backward's all-reduce
        loss.backward()
    dist.barrier()


@pytest.mark.slow  # a spawn of its own: about 10 s
def test_a_rank_that_dies_mid_step_stops_the_other_within_the_timeout(tmp_path):
    """The survivor's all-reduce fails (gloo sees the connection close) and it exits with
    the error, well within the process group's timeout; the helper's deadline would
    catch a hang."""
    timeout = 10.0
    ranks = run_ranks(die_in_the_second_step, tmp_path, timeout=timeout, deadline=90.0)
    assert ranks.exitcodes[1] == 17, ranks.errors
    assert ranks.exitcodes[0] not in (0, None), "the surviving rank hung or finished"
    assert ranks.errors[0], "the surviving rank exited without an error"
    waited = ranks.finished[0] - ranks.finished[1]
    assert waited < timeout + 15.0, f"the surviving rank took {waited:.1f} s to fail"


def train_uneven(rank: int, microbatches: int, unfinished: bool = False) -> dict:
    """Rank 0 trains five steps, rank 1 two, under ``Join([ddp, scaler])``, each step over
    ``microbatches`` (gradients accumulated, DDP's ``no_sync`` but for the last); rank 0's
    fifth loss overflows, while rank 1 has joined. ``unfinished``: rank 1's batches end one
    microbatch into its third step."""
    torch._dynamo.reset()
    model = mlp3()
    ddp = DDP(torch.compile(model, backend="lowprec", options=NEAREST))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = LossScaler("dynamic", init_scale=2.0**8, growth_interval=1)  # grows every clean step
    with Join([ddp, scaler]):
        for step in range(5 if rank == 0 else 2):
            for micro in range(microbatches):
                with ddp.no_sync() if micro < microbatches - 1 else contextlib.nullcontext():
                    loss = ddp(shard(batch(10 * step + micro), rank)).square().mean()
                    scaler.scale(loss * (float("inf") if step == 4 else 1.0)).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        if rank == 1 and unfinished:
            with ddp.no_sync():
                scaler.scale(ddp(shard(batch(20), rank)).square().mean()).backward()
    return {
        "scale": scaler.get_scale(),
        "skipped": scaler.skipped_steps,
        "iteration": scaler.state_dict()["iteration"],
        "parameters": [p.detach().clone() for p in model.parameters()],
    }


@pytest.mark.parametrize(("microbatches", "unfinished"), [(1, False), (2, False), (2, True)])
def test_ranks_with_uneven_inputs_join_the_scaler(tmp_path, microbatches, unfinished):
    """A rank out of inputs does the scaler's inf/NaN all-reduce of each step the other still
    runs (without it, they paired with DDP's and crashed), once per step over microbatches,
    and ends with the scale of the last to join: four clean steps grew it, the overflow
    halved it (rank 1's own two steps grew it to 2**10). A step left unfinished counts."""
    first, second = run_ranks(train_uneven, tmp_path, microbatches, unfinished, timeout=30.0).check()
    assert first["scale"] == second["scale"] == 2.0**11
    assert first["iteration"] == second["iteration"] == 5
    assert (first["skipped"], second["skipped"]) == (1, 0)
    for a, b in zip(first["parameters"], second["parameters"], strict=True):
        assert torch.equal(a, b)


def join_adaptive(rank: int) -> str:
    model = mlp3()
    with pytest.raises(RuntimeError, match=r"LossScaler\('adaptive'\) cannot join") as raised:
        Join([DDP(model), LossScaler("adaptive")])
    return str(raised.value)


def test_adaptive_scaling_refuses_to_join(tmp_path):
    assert all("drop_last=True" in said for said in run_ranks(join_adaptive, tmp_path).check())
