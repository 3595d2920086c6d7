"""``torch.compiler.nested_compile_region``: each call of a region is written out, and
rounds and is named as the same block undecorated."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import float_bits
from grid import SR_EVERYWHERE, grid_step
from models import ResidualBlock
from torch import nn
from torch.utils.checkpoint import checkpoint

import lpcompile


class RegionBlock(ResidualBlock):
    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class CheckpointedBlock(ResidualBlock):
    """A region may hold a checkpoint body: each call gets a body of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=False))


class RegionCheckpointedBlock(CheckpointedBlock):
    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([block() for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def step(model: nn.Module, options: dict) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(4, 8, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(model, backend="lowprec", options=options)(x)
    y.square().sum().backward()
    return [y, x.grad, *(p.grad for p in model.parameters())]


def test_regions_are_written_out_on_the_grid():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = grid_step(Stack(RegionBlock), {"x": torch.randn(4, 8, requires_grad=True)}, SR_EVERYWHERE)
    assert check.count == 21 and not check.off_grid, dict(check.products)  # 7 layers, 3 products each
    assert not [w for w in caught if "lowprec" in str(w.message)]


@pytest.mark.parametrize(
    "executor, blocks",
    [
        ("eager", (RegionBlock, ResidualBlock)),
        ("inductor", (RegionBlock, ResidualBlock)),
        ("eager", (RegionCheckpointedBlock, CheckpointedBlock)),
    ],
)
def test_a_region_rounds_and_names_as_the_block_undecorated(executor, blocks):
    """Stochastic rounding everywhere: the same bits as the undecorated model, so each
    block has a random stream of its own; coverage names each block's layers."""
    options = {**SR_EVERYWHERE, "executor": executor}
    region, plain = Stack(blocks[0]), Stack(blocks[1])
    for got, expected in zip(step(region, options), step(plain, options), strict=True):
        assert torch.equal(float_bits(got), float_bits(expected))
    layers = sorted({row.layer for row in lpcompile.coverage(region)})
    assert layers == sorted({row.layer for row in lpcompile.coverage(plain)})
    assert layers == [f"blocks.{i}.{n}" for i in range(3) for n in "ab"] + ["head"]
