"""Small random architectures with random recipes (hypothesis): the Inductor-compiled
step equals the eager executor's (the AOT graphs run op by op). The forward output is
bit-identical (the quantize decompositions are the same integer code, products are the
same extern kernels); gradients are equal up to FP32 sums Inductor reorders, seen
through the rounding (``assert_close_through_rounding``). A few examples in the fast
tier, more in the slow tier."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from models import assert_close_through_rounding
from torch import nn

from lpcompile.config import LowPrecConfig

FAST, SLOW = 2, 12
RECIPES = ["fp8-e5m2", "fp8-e5m2-sr", "fp8-hybrid", "fp8-e5m2-als", "fp8-tensorwise"]
# Operands scaled per tensor are not FP8 values: products of two sum inexactly in FP32,
# so the im2col matmul Inductor runs small convolutions as (conv="auto") sums them in
# another order than the eager executor's convolution; ATen's convolution keeps the bits.
OPTIONS = {"fp8-tensorwise": {"conv": "aten"}}


class Random(nn.Module):
    """An MLP, a CNN or an attention block, sized by ``width`` and ``depth``."""

    def __init__(self, kind: str, width: int, depth: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == "cnn":
            self.layers = nn.ModuleList(
                nn.Conv2d(1 if i == 0 else width, width, 3, padding=1) for i in range(depth)
            )
        else:
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
            if self.kind == "attention":
                q = x.view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2)
                x = x + F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(x.shape)
        if self.kind == "cnn":
            x = x.mean((2, 3))
        return self.head(x)


def _input(kind: str, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "cnn":
        return torch.randn(2, 1, 6, 6, generator=g)
    if kind == "attention":
        return torch.randn(2, 5, width, generator=g)
    return torch.randn(4, width, generator=g)


def check_executors_agree(kind: str, width: int, depth: int, recipe: str, seed: int) -> None:
    torch.manual_seed(seed)
    model = Random(kind, width, depth)
    x = _input(kind, width, seed)
    results = []
    for executor in ("eager", "inductor"):
        torch._dynamo.reset()
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            options = {"recipe": recipe, "executor": executor, **OPTIONS.get(recipe, {})}
            compiled = torch.compile(model, backend="lowprec", options=options)
            out = compiled(x)
        out.square().mean().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (out_eager, grads_eager), (out_inductor, grads_inductor) = results
    assert torch.equal(out_inductor, out_eager), f"{kind} {width}x{depth} {recipe}: outputs differ"
    # unrounded weight gradients show Inductor's reordered FP32 sums (convolutions', biases')
    unrounded = 0.0 if LowPrecConfig.from_recipe(recipe).weight_grad.enabled else 1e-4
    for i, (a, b) in enumerate(zip(grads_inductor, grads_eager, strict=True)):
        assert_close_through_rounding(a, b, f"{kind} {width}x{depth} {recipe}: gradient {i}", unrounded)


ARGS = dict(
    kind=st.sampled_from(["mlp", "cnn", "attention"]),
    width=st.sampled_from([4, 8]),
    depth=st.integers(1, 3),
    recipe=st.sampled_from(RECIPES),
    seed=st.integers(0, 1000),
)


@settings(max_examples=FAST, deadline=None, database=None)
@given(**ARGS)
def test_inductor_equals_the_eager_executor(kind, width, depth, recipe, seed):
    check_executors_agree(kind, width, depth, recipe, seed)


@pytest.mark.slow
@settings(max_examples=SLOW, deadline=None, database=None)
@given(**ARGS)
def test_inductor_equals_the_eager_executor_many(kind, width, depth, recipe, seed):
    check_executors_agree(kind, width, depth, recipe, seed)
