"""Tensor parallelism (``torch.distributed.tensor.parallel``) on two gloo ranks: lowprec's
rounding operators on DTensors, checked against ``lpcompile.quantize`` of the whole
tensor on one process, and a compiled column/row-parallel MLP trained in FP8, every
product on the E5M2 grid, its replicated parameters equal on both ranks, its losses those
of the same model on one process."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.distributed as dist
from grid import SR_EVERYWHERE, GridCheck, on_e5m2_grid, watched_backend
from ranks import mlp3, run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import lpcompile
from examples.zoo import hf_model
from lpcompile.backend.distributed import mesh_positions
from lpcompile.numerics.dtensor import whole_stats
from lpcompile.numerics.scale_grad import gradient_stats

STEPS = 3
SEED = 7


def _halfway(shape: tuple[int, ...]) -> torch.Tensor:
    """Values halfway between two E5M2 neighbours (1.125 lies between 1 and 1.25): stochastic
    rounding sends each up or down by its random bit alone."""
    return torch.full(shape, 1.125)


def round_dtensors(rank: int) -> dict[str, bool]:
    """Each placement's rounding on a DTensor against the whole tensor's, rounded on one
    process (``lpcompile.quantize`` registers the DTensor rules itself)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    whole = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    seed = torch.tensor(SEED)

    def gathered(fmt, rounding, placements, x=whole, scaling="none"):
        out = lpcompile.quantize(
            distribute_tensor(x, mesh, placements), fmt, rounding, seed=seed, scaling=scaling
        )
        assert isinstance(out, DTensor) and out.placements == tuple(placements), out
        return out.full_tensor()

    def alone(x, fmt, rounding, scaling="none"):
        return lpcompile.quantize(x, fmt, rounding, seed=seed, scaling=scaling)

    # a partial sum: each rank holds its part (two that add up to ``whole`` exactly), the
    # rounding sees their sum
    coarse = whole.bfloat16().float()
    part = coarse if rank == 0 else whole - coarse
    partial_sum = DTensor.from_local(part, mesh, [Partial()])
    summed = lpcompile.quantize(partial_sum, "e5m2", "stochastic", seed=seed)
    halves = gathered("e5m2", "stochastic", [Shard(0)], _halfway((4, 64))).chunk(2)
    narrow = distribute_tensor(_halfway((4, 64)), mesh, [Shard(0)])  # an int32 seed keeps the fold
    narrow = lpcompile.quantize(narrow, "e5m2", "stochastic", seed=seed.int()).full_tensor().chunk(2)
    positions = mesh_positions([distribute_tensor(whole, mesh, [Shard(0)])])

    def measured(placements):
        return whole_stats(
            distribute_tensor(whole, mesh, placements), partial(gradient_stats, stats="histogram")
        )

    histogram = gradient_stats(whole, "histogram")
    return {
        "positions": positions,
        "replicate": torch.equal(
            gathered("e5m2", "stochastic", [Replicate()]), alone(whole, "e5m2", "stochastic")
        ),
        "partial": summed.placements == (Replicate(),)
        and torch.equal(summed.to_local(), alone(whole, "e5m2", "stochastic")),
        # each shard draws a stream of its own: equal shards of equal values round apart
        "shards apart": not torch.equal(*halves) and all(on_e5m2_grid(h) for h in halves),
        "shards apart, int32 seed": not torch.equal(*narrow),
        "shard nearest": torch.equal(
            gathered("e5m2", "nearest", [Shard(1)]), alone(whole, "e5m2", "nearest")
        ),
        # scalings that read other shards: the whole tensor's factors
        "tensorwise": torch.equal(
            gathered("e4m3", "nearest", [Shard(1)], scaling="tensorwise"),
            alone(whole, "e4m3", "nearest", "tensorwise"),
        ),
        "rowwise, columns split": torch.equal(
            gathered("e4m3", "nearest", [Shard(1)], scaling="rowwise"),
            alone(whole, "e4m3", "nearest", "rowwise"),
        ),
        # the statistics of a gradient are the whole tensor's, whatever its placement
        "stats, replicated": torch.equal(measured([Replicate()]), histogram),
        "stats, rows split": torch.allclose(measured([Shard(0)]), histogram),
        "stats, columns split": torch.allclose(measured([Shard(1)]), histogram),
        "stats, partial": torch.allclose(
            whole_stats(partial_sum, partial(gradient_stats, stats="histogram")), histogram
        ),
        "mx, rows split": torch.equal(
            gathered("e4m3", "nearest", [Shard(0)], scaling="mx"), alone(whole, "e4m3", "nearest", "mx")
        ),
        # a tile of 128 x 128 holds both ranks' rows
        "tiles, rows split": torch.equal(
            gathered("e4m3", "nearest", [Shard(0)], scaling="blockwise_2d"),
            alone(whole, "e4m3", "nearest", "blockwise_2d"),
        ),
    }


def test_dtensor_rounding_matches_the_whole_tensor_rounded_on_one_process(tmp_path):
    results = run_ranks(round_dtensors, tmp_path).check()
    # the ranks' compiled streams differ, and so must their graphs' cache keys
    assert results[0].pop("positions") != results[1].pop("positions")
    for rank, checks in enumerate(results):
        assert all(checks.values()), f"rank {rank}: {checks}"


def _parallel_mlp(mesh) -> torch.nn.Module:
    model = mlp3()
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _mlp_loss(compiled: Callable, step: int) -> torch.Tensor:
    """The loss of the MLP on the batch of ``step``."""
    return compiled(torch.randn(16, 8, generator=torch.Generator().manual_seed(step))).square().mean()


def _steps(
    model: torch.nn.Module,
    options: dict,
    check: GridCheck,
    scaler: lpcompile.LossScaler | None = None,
    factors: tuple[float, ...] = (1.0,) * STEPS,
    loss_of: Callable[[Callable, int], torch.Tensor] = _mlp_loss,
    lr: float = 0.5,
) -> list[float]:
    """SGD steps of ``model`` compiled with ``options``, every product watched by ``check``,
    the loss (``loss_of(compiled, step)``) times ``factors[step]`` scaled by ``scaler``
    (``LossScaler("dynamic")``); the same batches on every rank."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=watched_backend(options, check))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = scaler or lpcompile.LossScaler("dynamic", init_scale=2.0**10)
    losses = []
    for step, factor in enumerate(factors):
        loss = loss_of(compiled, step)
        with check:
            scaler.scale(loss * factor).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_parallel(rank: int, options: dict, parallel: bool) -> dict:
    """The MLP trained (:func:`_steps`), its first two layers column- and row-parallel (or
    not parallel)."""
    check = GridCheck()
    model = _parallel_mlp(init_device_mesh("cpu", (dist.get_world_size(),))) if parallel else mlp3()
    losses = _steps(model, options, check)
    full = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for name, p in model.named_parameters()
    }
    local = {
        name: (p.to_local() if isinstance(p, DTensor) else p).detach() for name, p in model.named_parameters()
    }
    return {
        "losses": losses,
        "full": full,
        "local": local,
        "products": dict(check.products),
        "saturation": [dataclasses.astuple(row) for row in lpcompile.saturation(model)],
    }


def _single(rank: int, options: dict) -> dict:
    return train_parallel(rank, options, False)


@pytest.mark.parametrize(
    "recipe",
    [
        "fp8-e5m2-sr",
        pytest.param("fp8-e5m2", marks=pytest.mark.slow),
        pytest.param("fp8-tensorwise", marks=pytest.mark.slow),
    ],
)
def test_tensor_parallel_mlp_trains_in_fp8_like_one_process(tmp_path, recipe):
    """Column- then row-parallel layers and a replicated head: every product on the E5M2
    grid (``fp8-tensorwise``: the shards' factors are the whole tensors', which a check of
    one shard cannot see), replicas equal (they draw the same bits), and the losses those
    of the same model on one process (sums in another order; stochastic rounding draws
    other bits in shards)."""
    options = {"recipe": recipe, "executor": "eager"}
    (tmp_path / "tp").mkdir()
    (tmp_path / "one").mkdir()
    ranks = run_ranks(train_parallel, tmp_path / "tp", options, True).check()
    one = run_ranks(_single, tmp_path / "one", options, world=1).check()[0]
    for run in ranks:
        assert sum(run["products"].values()) == STEPS * 8, run["products"]
        assert recipe == "fp8-tensorwise" or all(on_grid for _, on_grid in run["products"]), run["products"]
    # the row-parallel layer's bias and the head are replicated: bit for bit on both ranks
    for name in ("2.bias", "4.weight", "4.bias"):
        assert torch.equal(ranks[0]["local"][name], ranks[1]["local"][name]), name
    # the column-parallel weight is split by rows: the ranks hold different halves
    assert ranks[0]["local"]["0.weight"].shape == (8, 8)
    assert not torch.equal(ranks[0]["local"]["0.weight"], ranks[1]["local"]["0.weight"])
    tolerance = 0.05 if recipe == "fp8-e5m2-sr" else 0.01
    assert ranks[0]["losses"] == pytest.approx(one["losses"], rel=tolerance)
    for name, weight in one["full"].items():
        assert torch.allclose(ranks[0]["full"][name], weight, atol=0.05), name


@pytest.mark.slow
def test_tensor_parallel_inductor_executor_gives_the_eager_executors_bits(tmp_path):
    """Inductor compiles the DTensor graphs (with its Python wrapper: the C++ one cannot take
    a device mesh) and computes what the eager executor does, bit for bit."""
    runs = {}
    for executor in ("eager", "inductor"):
        (tmp_path / executor).mkdir()
        options = {"recipe": "fp8-e5m2-sr", "executor": executor}
        runs[executor] = run_ranks(train_parallel, tmp_path / executor, options, True, deadline=300).check()
    for eager, inductor in zip(runs["eager"], runs["inductor"], strict=True):
        assert eager["losses"] == inductor["losses"]
        for name, weight in eager["local"].items():
            assert torch.equal(inductor["local"][name], weight), name


# small gradients (the per-layer scales grow), then an overflow at the fourth step
ADAPTIVE_FACTORS = (1e-4, 1e-4, 1e-4, 1e38, 1e-4, 1e-4)


def train_adaptive(rank: int, parallel: bool, executor: str = "eager") -> dict:
    """The MLP (its first two layers column- and row-parallel, or not) trained with per-layer
    adaptive loss scaling by the weights' Gaussian rule, refreshed every second call, and a
    scaler that decides on each rank alone: the ranks agree only if each one's statistics
    and weight moments are the whole tensors'. The first layer's weight and error differ in
    size by shard, so a shard's moments are not the whole's."""
    model = mlp3()
    with torch.no_grad():
        model[0].weight[:8] *= 8
        model[2].weight[:, :8] /= 8  # the error reaching the first half of layer 0: 8× smaller
    if parallel:
        parallelize_module(
            model,
            init_device_mesh("cpu", (dist.get_world_size(),)),
            {"0": ColwiseParallel(), "2": RowwiseParallel()},
        )
    options = {
        "recipe": "fp8-e5m2-als",
        "executor": executor,
        "loss_scale_rule": "approx_range",
        "loss_scale_interval": 2,
    }
    check = GridCheck()
    scaler = lpcompile.LossScaler("adaptive", process_group=None)
    losses = _steps(model, options, check, scaler, ADAPTIVE_FACTORS)
    return {
        "losses": losses,
        "products": dict(check.products),
        "skipped": scaler.skipped_steps,
        "history": {t.layer: t.history for t in lpcompile.stats(model)},
    }


def test_adaptive_loss_scaling_scales_tensor_parallel_layers_as_one_process(tmp_path):
    """Per-layer adaptive loss scaling on column- and row-parallel layers: both ranks, deciding
    alone, refresh every layer's scale as the same model on one process does (the same
    powers of two, nearly the same underflow fractions: sums in another order), skip the
    same steps, and keep every product on the grid."""
    (tmp_path / "tp").mkdir()
    (tmp_path / "one").mkdir()
    ranks = run_ranks(train_adaptive, tmp_path / "tp", True).check()
    one = run_ranks(train_adaptive, tmp_path / "one", False, world=1).check()[0]
    assert len(one["history"]["0"]) > 2 and one["skipped"] > 0, one
    for run in ranks:
        assert sum(run["products"].values()) == len(ADAPTIVE_FACTORS) * 8, run["products"]
        assert all(on_grid for _, on_grid in run["products"]), run["products"]
        assert run["skipped"] == one["skipped"]
        for layer, history in one["history"].items():
            assert [scale for _, scale, _ in run["history"][layer]] == [scale for _, scale, _ in history], (
                layer
            )
            assert [u for *_, u in run["history"][layer]] == pytest.approx([u for *_, u in history], abs=0.01)
        assert run["losses"] == pytest.approx(one["losses"], rel=0.01)


@pytest.mark.slow
def test_tensor_parallel_adaptive_scaling_under_inductor_gives_the_eager_executors_bits(tmp_path):
    """Inductor's graphs measure the errors of the recording calls under ``torch.cond`` and
    gather the shards' statistics: the same scales and losses as the eager executor's."""
    runs = {}
    for executor in ("eager", "inductor"):
        (tmp_path / executor).mkdir()
        runs[executor] = run_ranks(train_adaptive, tmp_path / executor, True, executor, deadline=300).check()
    for eager, inductor in zip(runs["eager"], runs["inductor"], strict=True):
        assert eager["losses"] == inductor["losses"]
        assert eager["history"] == inductor["history"]


# torchtitan's plan for a Llama block: attention heads and MLP columns split over the ranks
LLAMA_PLAN = {
    **dict.fromkeys(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ColwiseParallel()),
    **dict.fromkeys(["mlp.gate_proj", "mlp.up_proj"], ColwiseParallel()),
    **dict.fromkeys(["self_attn.o_proj", "mlp.down_proj"], RowwiseParallel()),
}


# FP8 rounded to nearest (shards draw other random bits than one process), scaled per layer
NEAREST_ADAPTIVE = {
    "recipe": "fp8-e5m2",
    "loss_scale": "adaptive",
    "executor": "eager",
    "loss_scale_interval": 2,
}


def _llama_loss(compiled: Callable, step: int) -> torch.Tensor:
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(step))
    return compiled(input_ids=ids, labels=ids).loss


def train_llama(rank: int, parallel: bool) -> dict:
    """HF Llama (tiny config) trained in FP8 with per-layer adaptive loss scaling, rounding to
    nearest (stochastic rounding in shards draws other bits than on one process), its
    blocks split by :data:`LLAMA_PLAN` (or not); the same batches on every rank."""
    torch.manual_seed(0)
    model, _ = hf_model("llama")
    if parallel:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.model.layers:
            parallelize_module(block, mesh, LLAMA_PLAN)
    check = GridCheck()
    scaler = lpcompile.LossScaler("adaptive")
    losses = _steps(model, NEAREST_ADAPTIVE, check, scaler, (1.0,) * 4, _llama_loss, lr=0.1)
    history = {t.layer: t.history for t in lpcompile.stats(model)}
    return {"losses": losses, "products": dict(check.products), "history": history}


@pytest.mark.slow
def test_hf_llama_with_torchtitans_plan_trains_in_fp8_like_one_process(tmp_path):
    """HF Llama's attention and MLP split over two ranks: every product (the projections,
    SDPA on each rank's heads) on the E5M2 grid, the ranks in step, per-layer scales and
    losses those of the model on one process (sums in another order)."""
    (tmp_path / "tp").mkdir()
    (tmp_path / "one").mkdir()
    ranks = run_ranks(train_llama, tmp_path / "tp", True, deadline=400).check()
    one = run_ranks(train_llama, tmp_path / "one", False, world=1, deadline=400).check()[0]
    for run in ranks:
        assert run["products"] and all(on_grid for _, on_grid in run["products"]), run["products"]
        assert run["losses"] == ranks[0]["losses"]
        assert run["history"] == ranks[0]["history"]
    assert ranks[0]["losses"] == pytest.approx(one["losses"], rel=0.01)
    scales = {layer: [scale for _, scale, _ in h] for layer, h in one["history"].items()}
    assert {layer: [scale for _, scale, _ in h] for layer, h in ranks[0]["history"].items()} == scales
    assert any(len(h) > 1 for h in scales.values()), scales


class NormedBlock(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class SequenceModel(nn.Module):
    """An input projection, two :class:`NormedBlock` and a normed head, over (batch,
    sequence, features)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([NormedBlock(), NormedBlock()])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _sequence_loss(compiled: Callable, step: int) -> torch.Tensor:
    return compiled(torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(step))).square().mean()


def train_sequence_parallel(rank: int, parallel: bool) -> dict:
    """:class:`SequenceModel` trained with ``fp8-e5m2`` and per-layer adaptive loss scaling, a
    scaler deciding on each rank alone; where ``parallel``, torchtitan's way: norms and
    residuals split along the sequence (``SequenceParallel``), gathered before each
    column-parallel layer and reduce-scattered after each row-parallel one."""
    torch.manual_seed(0)
    model = SequenceModel()
    if parallel:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        plan = {
            "inp": ColwiseParallel(output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        parallelize_module(model, mesh, plan)
        for block in model.blocks:
            plan = {
                "norm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.0": ColwiseParallel(),
                "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
            }
            parallelize_module(block, mesh, plan)
    check = GridCheck()
    scaler = lpcompile.LossScaler("adaptive", process_group=None)  # each rank decides alone
    losses = _steps(model, NEAREST_ADAPTIVE, check, scaler, (1.0,) * 4, _sequence_loss, lr=0.1)
    full = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for name, p in model.named_parameters()
    }
    history = {t.layer: t.history for t in lpcompile.stats(model)}
    return {"losses": losses, "products": dict(check.products), "history": history, "full": full}


@pytest.mark.slow
def test_sequence_parallel_blocks_train_in_fp8_like_one_process(tmp_path):
    """Sequence parallelism (norms on sequence shards, a gather before and a reduce-scatter
    after each block's MLP): every product on the E5M2 grid, the same per-layer scales,
    losses and weights as on one process (sums in another order)."""
    (tmp_path / "tp").mkdir()
    (tmp_path / "one").mkdir()
    ranks = run_ranks(train_sequence_parallel, tmp_path / "tp", True).check()
    one = run_ranks(train_sequence_parallel, tmp_path / "one", False, world=1).check()[0]
    assert any(len(h) > 1 for h in one["history"].values()), one["history"]
    for run in ranks:
        assert sum(run["products"].values()) == sum(one["products"].values()), run["products"]
        assert all(on_grid for _, on_grid in run["products"]), run["products"]
        for layer, history in one["history"].items():
            assert [scale for _, scale, _ in run["history"][layer]] == [scale for _, scale, _ in history], (
                layer
            )
            assert [u for *_, u in run["history"][layer]] == pytest.approx([u for *_, u in history], abs=0.01)
        assert run["losses"] == pytest.approx(one["losses"], rel=1e-4)
        for name, weight in one["full"].items():
            assert torch.allclose(run["full"][name], weight, atol=1e-6), name


@pytest.mark.slow
def test_saturation_counts_of_a_tensor_parallel_model_are_the_whole_tensors(tmp_path):
    """``saturation="count"`` on column- and row-parallel layers counts each site's whole
    tensor on every rank, forward and backward: the counts of the same model on one process
    (rounded to nearest, the same values up to the order of sums)."""
    options = {"recipe": "fp8-e5m2", "executor": "eager", "saturation": "count"}
    (tmp_path / "tp").mkdir()
    (tmp_path / "one").mkdir()
    ranks = run_ranks(train_parallel, tmp_path / "tp", options, True).check()
    one = run_ranks(_single, tmp_path / "one", options, world=1).check()[0]
    roles = {row[1] for row in one["saturation"]}
    assert roles == {"weight", "activation", "error", "weight_grad"}, one["saturation"]
    for run in ranks:
        assert run["saturation"] == one["saturation"]


# options a graph of DTensors refuses -> what the error says
REFUSED = [
    ({"recipe": "fp8-rowwise"}, "scaling='rowwise_pow2' on a tensor-parallel model"),
    ({"recipe": "fp8-tensorwise", "error_for_weight_grad": None}, "error_for_weight_grad on a tensor-"),
    ({"recipe": "fp8-e5m2-sr", "wrapper": "cpp", "executor": "inductor"}, "cannot take the device mesh"),
]


def _refused(rank: int) -> list[str]:
    """The error each of :data:`REFUSED`'s options gave ("" for none)."""
    said = []
    for option, _ in REFUSED:
        try:
            train_parallel(rank, {"executor": "eager", **option}, True)
            said.append("")
        except Exception as error:  # Dynamo wraps the backend's error
            said.append(str(error))
    return said


def test_options_without_a_dtensor_rule_are_refused_naming_them(tmp_path):
    for errors in run_ranks(_refused, tmp_path).check():
        for (option, expected), error in zip(REFUSED, errors, strict=True):
            assert expected in error, (option, error)


def train_2d(rank: int, adaptive: bool) -> dict:
    """The MLP trained (:func:`_steps`) on a 2×2 mesh, torchtitan's way: column/row-parallel
    over ``tp``, FSDP2 over ``dp``; stochastic rounding in the forward too (FSDP2 gives
    both groups the mean gradient: only the forward's bits can tell their streams apart);
    with per-layer adaptive loss scaling where ``adaptive``."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = mlp3()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    check = GridCheck()
    if adaptive:
        options = {**SR_EVERYWHERE, "loss_scale": "adaptive", "loss_scale_interval": 2}
        losses = _steps(model, options, check, lpcompile.LossScaler("adaptive"), ADAPTIVE_FACTORS)
    else:
        losses = _steps(model, SR_EVERYWHERE, check)
    local = {name: p.to_local().detach() for name, p in model.named_parameters()}
    history = {t.layer: t.history for t in lpcompile.stats(model)}
    return {"losses": losses, "local": local, "products": dict(check.products), "history": history}


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [False, True], ids=["dynamic", "adaptive"])
def test_fsdp2_over_tensor_parallel_groups_trains_on_the_grid(tmp_path, adaptive):
    """FSDP2 + tensor parallelism on four ranks: every product on the E5M2 grid; the two
    ranks of a tensor-parallel group draw the same bits (their losses and their shards of
    the replicated head are equal), the two groups different ones (their losses differ on
    the same batches). Per-layer adaptive scales refresh alike on all four ranks."""
    ranks = run_ranks(train_2d, tmp_path, adaptive, world=4, deadline=400).check()
    steps = len(ADAPTIVE_FACTORS) if adaptive else STEPS
    for run in ranks:
        assert sum(run["products"].values()) == steps * 8, run["products"]
        assert run["history"] == ranks[0]["history"]
        assert not adaptive or len(run["history"]["0"]) > 2, run["history"]
        assert all(on_grid for _, on_grid in run["products"]), run["products"]
    for first, second in ((0, 1), (2, 3)):  # the tensor-parallel groups
        assert ranks[first]["losses"] == ranks[second]["losses"]
        for name in ("4.weight", "4.bias"):
            assert torch.equal(ranks[first]["local"][name], ranks[second]["local"][name]), name
    assert ranks[0]["losses"] != ranks[2]["losses"]


def _bfloat16_parallel(rank: int, options: dict) -> dict:
    """A column- then row-parallel bfloat16 MLP, one compiled step: its products run in FP32
    (factors that are no powers of two), the DTensors cast up and back."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(torch.bfloat16)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    check = GridCheck(on_grid=lambda t: t.dtype == torch.float32)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    out = torch.compile(model, backend=watched_backend(options, check))(x)
    with check:
        out.float().square().sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    return {
        "dtype": str(out.dtype),
        "grads": all(g.dtype == torch.bfloat16 and g.isfinite().all() for g in grads),
        "products": dict(check.products),
    }


def test_a_bfloat16_tensor_parallel_step_runs_its_scaled_products_in_fp32(tmp_path):
    options = {"recipe": "fp8-tensorwise", "executor": "eager", "saturation": "count"}
    for run in run_ranks(_bfloat16_parallel, tmp_path, options).check():
        assert run["dtype"] == "torch.bfloat16" and run["grads"]
        assert run["products"] and all(in_fp32 for _, in_fp32 in run["products"]), run["products"]
