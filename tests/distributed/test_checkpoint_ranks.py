"""FSDP2 + ``torch.distributed.checkpoint``: saved at step N with lowprec's state (the
scaler's state dict carries the SR call counts and adaptive scales, saved as one blob:
DCP flattens nested containers, whose shape a fresh process cannot know) and resumed by
fresh processes, a run equals the uninterrupted one at step M, bit for bit."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import EAGER_ALS, EAGER_SR, Blocks, run_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from lpcompile import LossScaler

STEPS, SAVE_AT = 5, 2


def _fsdp_run(rank: int, options: dict, mode: str, folder: str, phase: str) -> list[torch.Tensor] | None:
    model = Blocks()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    run = torch.compile(model, backend="lowprec", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = LossScaler(mode, **({} if mode == "adaptive" else {"init_scale": 2.0**8}))
    start = 0
    if phase == "rest":
        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": optim_state, "scaler": io.BytesIO()}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        state["scaler"].seek(0)
        scaler.load_state_dict(torch.load(state["scaler"]))
        start = SAVE_AT
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(run(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        if phase == "full" and step + 1 == SAVE_AT:
            model_state, optim_state = get_state_dict(model, opt)
            blob = io.BytesIO()
            torch.save(scaler.state_dict(), blob)
            dcp.save({"model": model_state, "optim": optim_state, "scaler": blob}, checkpoint_id=folder)
    dist.barrier()
    return [p.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize(("options", "mode"), [(EAGER_SR, "dynamic"), (EAGER_ALS, "adaptive")])
def test_fsdp2_resumes_from_a_dcp_checkpoint_bit_for_bit(tmp_path, options, mode):
    folder = str(tmp_path / "ckpt")
    for phase in ("full", "rest"):
        (tmp_path / phase).mkdir()
    full = run_ranks(_fsdp_run, tmp_path / "full", options, mode, folder, "full").check()
    rest = run_ranks(_fsdp_run, tmp_path / "rest", options, mode, folder, "rest").check()
    for rank in range(len(full)):
        for a, b in zip(full[rank], rest[rank], strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"rank {rank}"
