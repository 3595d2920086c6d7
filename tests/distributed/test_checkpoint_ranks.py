"""DDP with ordinary state dicts, and FSDP2 + ``torch.distributed.checkpoint``: saved at
step N with lowprec's state (the scaler's state dict carries the SR call counts and
adaptive scales; under DCP saved as one blob, as DCP flattens nested containers, whose
shape a fresh process cannot know) and resumed by fresh processes, a run equals the
uninterrupted one at step M, bit for bit."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import EAGER_ALS, EAGER_SR, Blocks, mlp3, run_ranks, wide_mlp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from lpcompile import LossScaler

STEPS, SAVE_AT = 5, 2


def _train(run, opt, scaler: LossScaler, rank: int, start: int, save=None) -> None:
    """Steps ``start .. STEPS - 1`` on this rank's batches; ``save()`` after step ``SAVE_AT``."""
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(run(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        if save is not None and step + 1 == SAVE_AT:
            save()


def _check_resume(tmp_path, fn, *args) -> None:
    """Run ``fn`` uninterrupted (saving at ``SAVE_AT``), then resumed by fresh ranks; compare bits."""
    for phase in ("full", "rest"):
        (tmp_path / phase).mkdir()
    full = run_ranks(fn, tmp_path / "full", *args, str(tmp_path), "full").check()
    rest = run_ranks(fn, tmp_path / "rest", *args, str(tmp_path), "rest").check()
    for rank in range(len(full)):
        for a, b in zip(full[rank], rest[rank], strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"rank {rank}"


def _fsdp_run(rank: int, options: dict, mode: str, folder: str, phase: str) -> list[torch.Tensor]:
    model = Blocks()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    run = torch.compile(model, backend="lowprec", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = LossScaler(mode, **({} if mode == "adaptive" else {"init_scale": 2.0**8}))

    def save() -> None:
        model_state, optim_state = get_state_dict(model, opt)
        blob = io.BytesIO()
        torch.save(scaler.state_dict(), blob)
        dcp.save({"model": model_state, "optim": optim_state, "scaler": blob}, checkpoint_id=f"{folder}/dcp")

    if phase == "rest":
        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": optim_state, "scaler": io.BytesIO()}
        dcp.load(state, checkpoint_id=f"{folder}/dcp")
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        state["scaler"].seek(0)
        scaler.load_state_dict(torch.load(state["scaler"]))
    _train(run, opt, scaler, rank, SAVE_AT if phase == "rest" else 0, save if phase == "full" else None)
    dist.barrier()
    return [p.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize(
    ("options", "mode"),
    [(EAGER_SR, "dynamic"), pytest.param(EAGER_ALS, "adaptive", marks=pytest.mark.slow)],
)
def test_fsdp2_resumes_from_a_dcp_checkpoint_bit_for_bit(tmp_path, options, mode):
    _check_resume(tmp_path, _fsdp_run, options, mode)


# DDP's default buckets (one piece), and adaptive scaling on a graph split at 1 MiB buckets
DDP_CASES = {"one bucket": (mlp3, 25, EAGER_SR, "dynamic"), "split": (wide_mlp, 1, EAGER_ALS, "adaptive")}


def _ddp_run(rank: int, case: str, folder: str, phase: str) -> list[torch.Tensor]:
    make, bucket_mb, options, mode = DDP_CASES[case]
    model = make()
    run = DDP(torch.compile(model, backend="lowprec", options=options), bucket_cap_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = LossScaler(mode, **({} if mode == "adaptive" else {"init_scale": 2.0**8}))

    def save() -> None:
        if rank == 0:
            ckpt = {"model": model.state_dict(), "optim": opt.state_dict(), "scaler": scaler.state_dict()}
            torch.save(ckpt, f"{folder}/ckpt.pt")

    if phase == "rest":
        ckpt = torch.load(f"{folder}/ckpt.pt")  # every rank loads rank 0's ordinary checkpoint
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        scaler.load_state_dict(ckpt["scaler"])
    _train(run, opt, scaler, rank, SAVE_AT if phase == "rest" else 0, save if phase == "full" else None)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("case", ["one bucket", pytest.param("split", marks=pytest.mark.slow)])
def test_ddp_resumes_from_ordinary_state_dicts_bit_for_bit(tmp_path, case):
    """Rank 0's model, optimizer and scaler state dicts resume every rank: the SR call counts
    are the same on every rank (the rank enters the seed, not the count); split at DDP's
    buckets, each piece's adaptive state resumes."""
    _check_resume(tmp_path, _ddp_run, case)
