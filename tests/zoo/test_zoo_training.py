"""Slow tier: 20 training steps of zoo models under ``fp8-e5m2-sr`` (Inductor, the
default executor), against the same model in FP32 eager. The loss stays finite and
tracks FP32's: the mean absolute gap over the 20 steps is at most TOLERANCE of FP32's
mean loss (E5M2 keeps 2 mantissa bits, a relative spacing of 25%, on every operand,
error and weight gradient; the models learn a fixed synthetic task, so losses fall)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from examples.zoo import DIFFUSERS_MODELS, output_tensor, zoo_model

pytestmark = pytest.mark.slow
STEPS = 20
TOLERANCE = 0.15


def _loss(model: nn.Module, inputs: dict) -> torch.Tensor:
    out = model(**inputs)
    out = output_tensor(out)
    target = torch.linspace(-1, 1, out.numel()).view_as(out)  # a fixed regression target
    return (out.float() - target).square().mean()


def _train(model: nn.Module, inputs: dict, compiled: bool) -> list[float]:
    run = model
    if compiled:
        torch._dynamo.reset()
        run = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr", "attention": "full"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(STEPS):
        loss = _loss(run, inputs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


MODELS = (
    "gpt2",
    "bert",
    "llama",
    "mixtral",
    "unet2d",
    "flux",
    "checkpointed_mlp",
    "einsum_attention",
    "gru_lm",
    "lstm_lm",
    "transformer_encoder",
)


@pytest.mark.parametrize("name", MODELS)
def test_fp8_training_tracks_fp32(name):
    pytest.importorskip("diffusers" if name in DIFFUSERS_MODELS else "transformers")
    torch.manual_seed(0)
    model, inputs = zoo_model(name)
    for module in model.modules():  # dropout would make the two runs differ by more than rounding
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    reference = _train(copy.deepcopy(model), inputs, compiled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _train(model, inputs, compiled=True)
    assert all(map(torch.isfinite, torch.tensor(got))), got
    assert reference[-1] < reference[0], "the task does not train in FP32: the comparison says nothing"
    gap = sum(abs(a - b) for a, b in zip(got, reference, strict=True)) / STEPS
    assert gap <= TOLERANCE * sum(reference) / STEPS, (got, reference)
