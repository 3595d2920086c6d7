"""Adaptive loss scaling on a graph Dynamo's DDPOptimizer splits at DDP's gradient buckets
(``torch.compile(DDP(model, bucket_cap_mb=1))``): each piece compiles one graph that
records statistics at every call. Trained on two gloo ranks with round-to-nearest, the
split model takes the same per-layer scales and ends with the same parameter bits as the
same model compiled whole (``optimize_ddp=False``, where the statistics are recorded on
the refresh calls alone, in a second variant or under ``torch.cond``)."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks, wide_mlp
from torch.nn.parallel import DistributedDataParallel as DDP

from lpcompile import LossScaler, stats
from lpcompile.backend import lowprec
from lpcompile.backend.state import REGISTRY

STEPS = 5  # the calibrating calls and two of interval 2: refreshes from both kinds of call
OPTIONS = {"recipe": "fp8-e5m2", "loss_scale": "adaptive", "loss_scale_interval": 2}


def _train(
    rank: int, executor: str, split: bool, model: torch.nn.Module | None = None, recompiles: int | None = None
) -> dict:
    """``recompiles``: the rank that gets batches of another size after the first step (and
    recompiles), where the other ranks keep their first graphs."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lowprec(gm, example_inputs, options={**OPTIONS, "executor": executor})

    model = wide_mlp() if model is None else model
    with torch._dynamo.config.patch(optimize_ddp=split):
        compiled = torch.compile(DDP(model, bucket_cap_mb=1), backend=backend)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = LossScaler("adaptive")
        for step in range(STEPS):
            rows = 6 if rank == recompiles and step > 0 else 4
            x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(10 * rank + step))
            # rank 1's loss is tiny: the scales the ranks agree on differ from either rank's own
            loss = compiled(x).square().mean() * (1e-4 if rank else 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return {
        "graphs": len(graphs),
        "history": {t.layer: t.history for t in stats(model)},
        # each layer's scale over the one above it: across pieces too
        "relative": {t.layer: (t.scale, t.cumulative) for t in stats(model)},
        "parameters": [p.detach().clone() for p in model.parameters()],
        "states": len(REGISTRY.adaptive_states(model)),
    }


def _split_and_whole(rank: int, executor: str) -> dict:
    return {"split": _train(rank, executor, True), "whole": _train(rank, executor, False)}


@pytest.mark.parametrize("executor", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_split_graph_scales_and_trains_as_the_whole_graph(executor, tmp_path):
    ranks = run_ranks(_split_and_whole, tmp_path, executor, deadline=300.0).check()
    for rank, run in enumerate(ranks):
        split, whole = run["split"], run["whole"]
        assert split["graphs"] > 1 and whole["graphs"] == 1, f"rank {rank}: {split['graphs']} pieces"
        assert len(split["history"]) == 4 and split["history"] == whole["history"], f"rank {rank}"
        assert split["relative"] == whole["relative"], f"rank {rank}"
        refreshes = [len(h) for h in split["history"].values()]
        assert min(refreshes) >= 2, f"rank {rank}: {refreshes} refreshes per layer"
        for i, (a, b) in enumerate(zip(split["parameters"], whole["parameters"], strict=True)):
            assert torch.equal(a, b), f"rank {rank}: parameter {i} differs"
    # the scaler's all-reduce of the statistics gives both ranks the same scales
    assert ranks[0]["split"]["history"] == ranks[1]["split"]["history"]


def _small_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _one_bucket_and_whole(rank: int) -> dict:
    return {
        "one": _train(rank, "inductor", True, _small_mlp()),
        "whole": _train(rank, "inductor", False, _small_mlp()),
    }


@pytest.mark.slow
def test_a_graph_in_one_bucket_compiles_with_inductor_and_trains_as_without_ddp_optimizer(tmp_path):
    """DDPOptimizer hands a graph that fits one bucket to the backend whole: its statistics
    under ``torch.cond`` compile with Inductor (``torch.cond``'s own Dynamo trace of the
    branches, run from AOT autograd inside DDP's forward, made a fake constant there)."""
    ranks = run_ranks(_one_bucket_and_whole, tmp_path, deadline=300.0).check()
    for rank, run in enumerate(ranks):
        one, whole = run["one"], run["whole"]
        assert one["graphs"] == whole["graphs"] == 1, f"rank {rank}"
        assert one["history"] == whole["history"] and len(one["history"]) == 2, f"rank {rank}"
        for i, (a, b) in enumerate(zip(one["parameters"], whole["parameters"], strict=True)):
            assert torch.equal(a, b), f"rank {rank}: parameter {i} differs"
    assert ranks[0]["one"]["history"] == ranks[1]["one"]["history"]


def _recompiled_on_rank_1(rank: int) -> dict:
    return _train(rank, "eager", True, recompiles=1)


def test_split_graphs_that_recompile_on_one_rank_keep_agreeing(tmp_path):
    """A rank that recompiles the split graph (a new batch size) shares its pieces' states
    with the pieces of its first split, piece by piece: its scales agree with the rank that
    did not recompile at every step."""
    first, second = run_ranks(_recompiled_on_rank_1, tmp_path, deadline=300.0).check()
    assert second["graphs"] == 2 * first["graphs"] > 2  # rank 1 split twice
    assert first["states"] == second["states"] == first["graphs"]
    assert first["history"] == second["history"] and len(first["history"]) == 4
    assert min(len(h) for h in first["history"].values()) >= 2


class _Block(torch.nn.Module):
    """A layer norm and two 1 MiB layers: with 1 MiB buckets, DDPOptimizer splits the
    block's graph into three pieces, the first (the norm's) without layers to scale."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(512)
        self.up = torch.nn.Linear(512, 512)
        self.down = torch.nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _blocks_one_by_one(rank: int) -> dict:
    """Two identical blocks, each compiled on its own, under DDP: with DDPOptimizer splitting
    each block's graph into pieces, and without."""
    found = {}
    for split in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(_Block(), _Block())
        for block in model:
            block.compile(backend="lowprec", options={**OPTIONS, "executor": "eager"})
        with torch._dynamo.config.patch(optimize_ddp=split):
            ddp = DDP(model, bucket_cap_mb=1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            scaler = LossScaler("adaptive")
            for step in range(STEPS):
                x = torch.randn(4, 512, generator=torch.Generator().manual_seed(10 * rank + step))
                scaler.scale(ddp(x).square().mean() * (1e-4 if rank else 1.0)).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        found[split] = {t.layer: t.history for t in stats(model)}
        found[f"states {split}"] = len(REGISTRY.adaptive_states(model))
    return found


@pytest.mark.slow
def test_identical_blocks_compiled_one_by_one_and_split_scale_apart(tmp_path):
    """Each block's pieces chain on their own, also where the first piece scales nothing:
    the split blocks take the scales of the blocks' whole graphs."""
    for rank, found in enumerate(run_ranks(_blocks_one_by_one, tmp_path, deadline=300.0).check()):
        assert (found["states True"], found["states False"]) == (4, 2), f"rank {rank}"  # a state per piece
        assert len(found[True]) == 4 and found[True] == found[False], f"rank {rank}"
