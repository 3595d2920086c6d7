"""Under DDP and FSDP2, a module with products that no lowprec graph reads runs in FP32:
one left out when compiling per block (torchtitan compiles only the blocks), or a root
``forward`` Dynamo gives up on (a graph break inside its loop over sharded blocks) that
computes a product with its own parameter. After the first forward, one warning names each
such module; a model whose products all compiled is quiet, identical blocks that share one
compiled graph included."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from ranks import EAGER_SR, Block, Blocks, run_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP


class OwnProduct(nn.Module):
    """A root whose output product uses a parameter of its own, not a module's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(8, 16), Block(16, 16)])
        self.w = nn.Parameter(torch.randn(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x @ self.w


class Deep(Blocks):
    """Blocks with more blocks like the second: Dynamo runs the second's graph for them."""

    def __init__(self, more: int = 1) -> None:
        super().__init__()
        self.layers.extend(Block(16, 16) for _ in range(more))


class Tied(Blocks):
    """Blocks whose head shares its weight with an input projection."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(8, 8, bias=False)
        self.layers[1] = Block(16, 8)
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.project.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.project(x))


def _compile(module: nn.Module) -> nn.Module:
    return torch.compile(module, backend="lowprec", options=EAGER_SR)


def _blocks_compiled(model: Blocks, head: bool) -> Blocks:
    for name, block in model.layers.named_children():
        model.layers.register_module(name, _compile(block))
    if head:
        model.head = _compile(model.head)
    return model


def _first_block_compiled(model: Blocks) -> Blocks:
    model.layers[0] = _compile(model.layers[0])
    return model


def _tied_compiled() -> Tied:
    model = _blocks_compiled(Tied(), head=True)
    model.project = _compile(model.project)
    return model


def _sharded(model: nn.Module, reshard_root: bool = False) -> nn.Module:
    for block in model.layers:
        fully_shard(block)
    return fully_shard(model, reshard_after_forward=reshard_root)


WRAPPINGS: dict[str, Callable[[], nn.Module]] = {
    "FSDP2 per block, head left out": lambda: _sharded(_blocks_compiled(Blocks(), head=False)),
    "FSDP2 per block, head compiled": lambda: _sharded(_blocks_compiled(Deep(), head=True)),
    "FSDP2 compiled whole": lambda: _compile(_sharded(Deep())),
    # the root reshards after its forward: the head's parameter is then a shard, and its
    # unsharded version is registered with FSDP2 under the projection's name
    "FSDP2 per block, tied head, root resharded": lambda: _sharded(_tied_compiled(), reshard_root=True),
    "FSDP2 compiled whole, the root's own product": lambda: _compile(_sharded(OwnProduct())),
    "DDP per block, head left out": lambda: DDP(_blocks_compiled(Blocks(), head=False)),
    "compiled DDP": lambda: _compile(DDP(Deep())),
    # lowprec's compile traces through the blocks compiled with lowprec (DDPOptimizer's
    # compile is lowprec's): one graph, the root's own product in it
    "compiled DDP, blocks compiled too": lambda: _compile(DDP(_blocks_compiled(OwnProduct(), head=False))),
    "DDP, 1 of 14 blocks compiled": lambda: DDP(_first_block_compiled(Deep(more=12))),
}


def _warnings(rank: int) -> dict[str, list[str]]:
    found = {}
    for wrapping, make in WRAPPINGS.items():
        torch._dynamo.reset()
        model = make()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):  # under DDP the check runs at the end of the second forward
                model(torch.randn(4, 8)).sum().backward()
        found[wrapping] = [str(w.message) for w in caught if "no lowprec graph read" in str(w.message)]
    return found


def test_modules_no_lowprec_graph_reads_are_named_once(tmp_path):
    for found in run_ranks(_warnings, tmp_path).check():
        assert found.pop("FSDP2 per block, head compiled") == []
        assert found.pop("FSDP2 compiled whole") == []
        assert found.pop("FSDP2 per block, tied head, root resharded") == []
        assert found.pop("compiled DDP") == []
        assert found.pop("compiled DDP, blocks compiled too") == []
        head = "no lowprec graph read the parameters of head (Linear: weight) while"
        expected = {
            "FSDP2 per block, head left out": f"{head} FSDPBlocks ran under FSDP2:",
            "FSDP2 compiled whole, the root's own product": "of (the root) (FSDPOwnProduct: w) while",
            "DDP per block, head left out": f"{head} Blocks ran under DDP:",
            # 13 blocks and the head: the first 12 named, the others counted
            "DDP, 1 of 14 blocks compiled": "of layers.1.linear (Linear: weight), layers.2.linear",
        }
        assert found.keys() == expected.keys()
        for wrapping, message in expected.items():
            assert len(found[wrapping]) == 1 and message in found[wrapping][0], (wrapping, found[wrapping])
        assert "layers.12.linear (Linear: weight) and 2 more " in found["DDP, 1 of 14 blocks compiled"][0]
