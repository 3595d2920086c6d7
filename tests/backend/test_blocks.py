"""Blocks compiled one by one (torchtitan's way, and FSDP2's graph per block): Dynamo runs
one graph for identical blocks, their parameters its inputs. Each block draws bits of its
own, and its layers are named from the model, as ``model.named_modules()`` names them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from grid import GridCheck, watched_backend
from models import Records, ResidualBlock
from torch import nn

import lpcompile


class Twins(nn.Module):
    """Three blocks with equal weights, each fed the same input: equal bits would give equal
    gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        block = ResidualBlock()
        self.layers = nn.ModuleList(copy.deepcopy(block) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(block(x).square().sum() for block in self.layers)


def compiled_per_block(options: dict, check: GridCheck | None = None) -> Twins:
    """A Twins with each block compiled in place (watched by ``check``, if given)."""
    torch._dynamo.reset()
    model = Twins()
    backend = "lowprec" if check is None else watched_backend(options, check)
    for name, block in model.layers.named_children():
        compiled = torch.compile(block, backend=backend, options=None if check else options)
        model.layers.register_module(name, compiled)
    return model


def train(options: dict, steps: int = 2, grid: bool = True) -> tuple[Twins, list[list[torch.Tensor]]]:
    """A model compiled per block, and each step's weight gradients per block; every
    product checked on the E5M2 grid (with ``grid``)."""
    check = GridCheck()
    model = compiled_per_block(options, check)
    grads = []
    for step in range(steps):
        model.zero_grad()
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))
        with check:
            loss.backward()
        grads.append([block.a.weight.grad.clone() for block in model.layers])
    assert check.count == steps * 15 and not check.unknown, dict(check.products)
    assert not (grid and check.off_grid), dict(check.products)
    return model, grads


SR = {"recipe": "fp8-e5m2-sr", "executor": "eager"}


def test_identical_blocks_compiled_one_by_one_draw_their_own_bits():
    records = Records()
    _, grads = train(SR)
    assert len(records.new) == 1  # one graph runs every block
    for step, per_block in enumerate(grads):
        for i in range(3):
            for j in range(i):
                assert not torch.equal(per_block[i], per_block[j]), f"step {step}: blocks {j} and {i}"
    # reproducible: a fresh model and compile draws the same bits
    for got, expected in zip(train(SR)[1], grads, strict=True):
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)


def test_blocks_compiled_one_by_one_are_named_from_the_model():
    options = {**SR, "recipe": "fp8-e5m2-als", "saturation": "count", "loss_scale_interval": 1}
    model, _ = train(options, steps=1)
    modules = model.named_modules()
    linears = [name.replace("._orig_mod", "") for name, m in modules if isinstance(m, nn.Linear)]
    assert [row.layer for row in lpcompile.coverage(model)] == linears
    assert sorted({t.layer for t in lpcompile.stats(model)}) == sorted(linears)
    assert sorted({row.layer for row in lpcompile.saturation(model)}) == sorted(linears)
    # a block asked for itself is named from itself
    assert [row.layer for row in lpcompile.coverage(model.layers[1])] == ["a", "b"]


def test_blocks_whose_first_parameter_is_no_weight_are_named_from_the_model_in_stats():
    """A block whose first parameter is a norm's (torchtitan's Llama blocks): its adaptive
    state is keyed by a layer's weight, and named from the model too."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(2))
    )
    for name, block in model.named_children():
        model.register_module(
            name, torch.compile(block, backend="lowprec", options={**SR, "recipe": "fp8-e5m2-als"})
        )
    model(torch.randn(4, 8)).square().mean().backward()
    linears = [f"{block}.{layer}" for block in ("0", "1") for layer in ("1", "3")]
    assert [row.layer for row in lpcompile.coverage(model)] == linears
    assert [t.layer for t in lpcompile.stats(model)] == linears


def test_keep_first_last_in_a_blocks_graph_warns_that_it_keeps_the_blocks_layers():
    options = {**SR, "keep_first_last": True}
    expected = r"keep_first_last .* submodule 'layers.0'.* \(a, b\).* compile it with options of its own"
    with pytest.warns(UserWarning, match=expected):
        model, _ = train(options, steps=1, grid=False)
    kept = {row.layer: row.kept for row in lpcompile.coverage(model) if row.kept}
    assert kept == {f"layers.{i}.{layer}": "keep_first_last" for i in range(3) for layer in ("a", "b")}
    # compiled whole, the model's graph is the model's: its first and last layers kept, no warning
    torch._dynamo.reset()
    model = Twins()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.compile(model, backend="lowprec", options=options)(torch.randn(4, 8)).backward()
    kept = [row.layer for row in lpcompile.coverage(model) if row.kept]
    assert kept == ["layers.0.a", "layers.2.b"]


def test_an_exclude_pattern_of_the_models_names_that_a_blocks_graph_cannot_see_warns_why():
    expected = r"\['layers.1.a'\] match no layer .* graph is submodule 'layers.0'.* options of its own"
    with pytest.warns(UserWarning, match=expected):
        train({**SR, "exclude": ["layers.1.a"]}, steps=2)  # warned at the end of the watched forward


def test_one_of_identical_blocks_compiled_with_options_of_its_own_is_kept_apart():
    """What the warnings above advise: the first block compiled with an ``exclude`` of its
    own runs a graph of its own, in FP32, and the other blocks stay on the grid."""
    torch._dynamo.reset()
    model, check = Twins(), GridCheck()
    for name, block in model.layers.named_children():
        options = {**SR, "exclude": ["a", "b"]} if name == "0" else SR
        model.layers.register_module(name, torch.compile(block, backend=watched_backend(options, check)))
    loss = model.layers[0](torch.randn(4, 8)).sum()  # block 0 alone: its products
    with check:
        loss.backward()
    kept = dict(check.products)
    assert kept and all(not on_grid for _, on_grid in kept), kept
    check.products.clear()
    loss = model(torch.randn(4, 8))
    with check:
        loss.backward()
    assert check.count == 15 and sum(check.off_grid.values()) == sum(kept.values()), dict(check.products)
    rows = {row.layer: row.kept for row in lpcompile.coverage(model)}
    assert rows == {f"layers.{i}.{layer}": "exclude" if i == 0 else None for i in range(3) for layer in "ab"}


class Student(nn.Module):
    """A student whose ``forward`` runs a teacher held outside its modules (in a list, so
    not registered), the teacher's blocks compiled one by one."""

    def __init__(self, teacher: nn.Module) -> None:
        super().__init__()
        self.teacher = [teacher]
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher[0](x)
        return (self.layer(x) - target).square().sum()


def test_blocks_of_a_model_run_inside_another_are_named_from_their_own():
    """The outermost module running (the student) does not hold the teacher's blocks: they
    are found in the teacher (each was placed at the student, named ``""``, and all but
    one dropped from its coverage)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    teacher = nn.Sequential(ResidualBlock(), ResidualBlock())
    for block in teacher:
        block.compile(backend="lowprec", options=SR)
    Student(teacher)(torch.randn(4, 8)).backward()
    assert [row.layer for row in lpcompile.coverage(teacher)] == ["0.a", "0.b", "1.a", "1.b"]
