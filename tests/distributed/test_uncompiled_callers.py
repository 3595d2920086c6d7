"""A root ``forward`` that Dynamo gives up on under FSDP2 (a graph break inside its loop
over sharded blocks) runs uncompiled: products it computes with its own parameters stay
FP32, which the backend says by name; a root whose products are all in submodules is quiet."""

from __future__ import annotations

import warnings

import torch
from ranks import EAGER_SR, Block, run_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard


class Root(nn.Module):
    def __init__(self, own_product: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(8, 16), Block(16, 16)])
        self.own_product = own_product
        if own_product:
            self.w = nn.Parameter(torch.randn(16, 4))
        else:
            self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x @ self.w if self.own_product else self.head(x)


def _warnings(rank: int, own_product: bool) -> list[str]:
    model = Root(own_product)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    run = torch.compile(model, backend="lowprec", options=EAGER_SR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(torch.randn(4, 8)).sum().backward()
    return [str(w.message) for w in caught if "runs uncompiled" in str(w.message)]


def test_a_root_forward_run_uncompiled_is_named_with_its_own_parameters(tmp_path):
    (tmp_path / "own").mkdir()
    (tmp_path / "modules").mkdir()
    own = run_ranks(_warnings, tmp_path / "own", True).check()
    quiet = run_ranks(_warnings, tmp_path / "modules", False).check()
    for found in own:
        assert found and all(
            "FSDPRoot.forward runs uncompiled" in m and "['w'] run in FP32" in m for m in found
        )
    assert quiet == [[], []]
