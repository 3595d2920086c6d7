"""Every DDP and FSDP2 wrapping of a compiled model trains with lowprec's rewriting on
every rank: each matmul-class ATen call of two training steps, forward and backward,
has its operands on the E5M2 grid (scaled per tensor, for ``fp8-tensorwise``; per row of the
dimension each matmul sums over, for rowwise scaling), checked by
``GridCheck`` (torch's own float8 cast; a tensor's significant bits once scaled),
not by lowprec's records. Before the backend traced wrapped ``torch.nn`` forwards,
``torch.compile(DDP(nn.Sequential))`` and FSDP2 on ``nn.Linear`` layers ran in FP32."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from grid import GridCheck, on_e5m2_grid, on_scaled_fp8_grid, on_scaled_fp8_rows, watched_backend
from ranks import EAGER_ALS, EAGER_SR, Blocks, mlp3, run_ranks, wide_mlp
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from lpcompile.backend import coverage
from lpcompile.backend.watch import module_name

STEPS = 2
EAGER_TENSORWISE = {"recipe": "fp8-tensorwise", "executor": "eager"}
# fp8-rowwise with factors that are not powers of two, which the check tells from per-tensor ones
EAGER_ROWWISE = {
    "recipe": "fp8-rowwise",
    "executor": "eager",
    **{role: {"scaling": "rowwise"} for role in ("weight", "activation", "error")},
}


def _compile_ddp(model: nn.Module, backend) -> nn.Module:
    return torch.compile(DDP(model), backend=backend)


def _ddp_of_compiled(model: nn.Module, backend) -> nn.Module:
    return DDP(torch.compile(model, backend=backend))


# 1 MiB buckets and three 1 MiB layers: Dynamo's DDPOptimizer hands the backend one piece
# of the graph per bucket, with fake example inputs (in both orders of DDP and compile)
def _compile_ddp_split(model: nn.Module, backend) -> nn.Module:
    return torch.compile(DDP(model, bucket_cap_mb=1), backend=backend)


def _ddp_of_compiled_split(model: nn.Module, backend) -> nn.Module:
    return DDP(torch.compile(model, backend=backend), bucket_cap_mb=1)


def _fsdp_layers_compiled_whole(model: nn.Sequential, backend) -> nn.Module:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return torch.compile(model, backend=backend)


def _fsdp_blocks_compiled_whole(model: Blocks, backend) -> nn.Module:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return torch.compile(model, backend=backend)


def _fsdp_blocks_bf16_compiled_whole(model: Blocks, backend) -> nn.Module:
    """FSDP2's mixed precision: bf16 parameters in the forward and backward, FP32 gradients."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return torch.compile(model, backend=backend)


def _fsdp_per_block(model: Blocks, backend) -> nn.Module:
    """torchtitan's order: each block compiled (fullgraph) in place, then sharded, then the
    root. The head is compiled too: torch.compile never sees a layer outside the compiled
    modules, which runs in FP32 (docs/distributed.md)."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, backend=backend, fullgraph=True))
    model.head = torch.compile(model.head, backend=backend, fullgraph=True)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


# name -> (model, wrapping, products per step: one addmm per linear forward, one mm per
# weight gradient and per input gradient but the first layer's, options, Dynamo config)
WRAPPINGS = {
    "torch.compile(DDP(model))": (mlp3, _compile_ddp, 8, EAGER_SR, {}),
    "DDP(torch.compile(model))": (mlp3, _ddp_of_compiled, 8, EAGER_SR, {}),
    "torch.compile(DDP(model)) split at buckets": (wide_mlp, _compile_ddp_split, 11, EAGER_SR, {}),
    "DDP(torch.compile(model)) split at buckets": (wide_mlp, _ddp_of_compiled_split, 11, EAGER_SR, {}),
    "torch.compile(DDP(model)) split at buckets, adaptive loss scaling": (
        wide_mlp,
        _compile_ddp_split,
        11,
        EAGER_ALS,
        {},
    ),
    "DDP(torch.compile(model)) split at buckets, adaptive loss scaling": (
        wide_mlp,
        _ddp_of_compiled_split,
        11,
        EAGER_ALS,
        {},
    ),
    "torch.compile(DDP(model)), adaptive loss scaling, optimize_ddp=False": (
        wide_mlp,
        _compile_ddp_split,
        11,
        EAGER_ALS,
        {"optimize_ddp": False},
    ),
    # Dynamo traces DDP's forward whole (no graph break), DDP's Python reducer reduces
    "torch.compile(DDP(model)), optimize_ddp='python_reducer'": (
        mlp3,
        _compile_ddp,
        8,
        EAGER_SR,
        {"optimize_ddp": "python_reducer"},
    ),
    "FSDP2 per layer and root, compiled whole": (mlp3, _fsdp_layers_compiled_whole, 8, EAGER_SR, {}),
    "FSDP2 per block and root, compiled whole": (Blocks, _fsdp_blocks_compiled_whole, 8, EAGER_SR, {}),
    "FSDP2 per block and root, compiled per block": (Blocks, _fsdp_per_block, 8, EAGER_SR, {}),
    "FSDP2 per block and root, compiled whole, bf16 mixed precision": (
        Blocks,
        _fsdp_blocks_bf16_compiled_whole,
        8,
        EAGER_SR,
        {},
    ),
    # each operand scaled whole: a weight sharded over the ranks has one scale, not one per shard
    "FSDP2 per block and root, compiled per block, fp8-tensorwise": (
        Blocks,
        _fsdp_per_block,
        8,
        EAGER_TENSORWISE,
        {},
    ),
    "DDP(torch.compile(model)) split at buckets, fp8-tensorwise": (
        wide_mlp,
        _ddp_of_compiled_split,
        11,
        EAGER_TENSORWISE,
        {},
    ),
    # a sharded weight gathered, then rounded per row of each matmul that reads it
    "FSDP2 per block and root, compiled per block, rowwise": (Blocks, _fsdp_per_block, 8, EAGER_ROWWISE, {}),
    "DDP(torch.compile(model)) split at buckets, rowwise": (
        wide_mlp,
        _ddp_of_compiled_split,
        11,
        EAGER_ROWWISE,
        {},
    ),
}


def train_wrappings(rank: int) -> dict[str, dict]:
    """Each wrapping, fresh: two steps on rank-dependent data, every product watched."""
    results = {}
    for name, (make, wrap, _, options, dynamo_config) in WRAPPINGS.items():
        try:
            with torch._dynamo.config.patch(dynamo_config):
                results[name] = _train(make, wrap, options, rank)
        except Exception as error:  # one wrapping's failure is that wrapping's test's
            results[name] = {"error": repr(error)}
    return results


def _train(make, wrap, options: dict, rank: int) -> dict:
    torch._dynamo.reset()
    if options is EAGER_ROWWISE:
        check = GridCheck(on_operand=on_scaled_fp8_rows)
    else:
        check = GridCheck(on_scaled_fp8_grid if options is EAGER_TENSORWISE else on_e5m2_grid)
    graphs = []
    watched = watched_backend(options, check)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return watched(gm, example_inputs)

    model = make()
    wrapped = wrap(model, backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
        loss = wrapped(x).square().mean()
        with check:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()
    return {
        "products": dict(check.products),
        "unknown": dict(check.unknown),
        "graphs": len(graphs),
        "linears": sum(isinstance(m, nn.Linear) for m in model.modules()),
        "covered": len([row for row in coverage(model) if row.quantized]),
        "names": {row.layer for row in coverage(model)},
        # a layer compiled on its own by the user (the head, compiled per block) is named by
        # its weight, one Dynamo compiled apart (the root's loop broken) by the module
        "model_names": {module_name(n) for n, _ in [*model.named_modules(), *model.named_parameters()]},
    }


@pytest.fixture(scope="module")
def wrapped_runs(tmp_path_factory) -> list[dict[str, dict]]:
    """All wrappings on two ranks, in one spawn (a spawn costs seconds)."""
    return run_ranks(train_wrappings, tmp_path_factory.mktemp("wrappings"), deadline=240.0).check()


@pytest.mark.parametrize("wrapping", list(WRAPPINGS))
def test_every_product_on_every_rank_runs_on_the_fp8_grid(wrapped_runs, wrapping):
    per_step = WRAPPINGS[wrapping][2]
    for rank, runs in enumerate(wrapped_runs):
        run = runs[wrapping]
        assert "error" not in run, f"rank {rank}: {run.get('error')}"
        products = run["products"]
        assert sum(products.values()) == STEPS * per_step, f"rank {rank}: {products}"
        off_grid = {op: n for (op, on_grid), n in products.items() if not on_grid}
        assert not off_grid, f"rank {rank}: products off the grid {off_grid}"
        assert not run["unknown"], f"rank {rank}: unlisted products {run['unknown']}"
        # lpcompile.coverage(model) finds the graphs (under FSDP2, through the unsharded parameters)
        assert run["covered"] == run["linears"], f"rank {rank}: coverage lists {run['covered']} layers"
        # named from the model, whichever module a graph's frame starts at
        assert run["names"] <= run["model_names"], f"rank {rank}: {run['names'] - run['model_names']}"
        if "split" in wrapping:
            assert run["graphs"] > 1, f"rank {rank}: DDPOptimizer did not split the graph"
        if "optimize_ddp=False" in wrapping:
            assert run["graphs"] == 1, f"rank {rank}: {run['graphs']} graphs"
