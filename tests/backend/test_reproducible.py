"""Compiled steps repeat their bits where torch's do.

Inductor adds an embedding's gradient rows (``index_put`` with ``accumulate``) with
atomic adds from parallel loops, in an order that follows thread timing, so fp32
Inductor's steps differ in the last bits from run to run on more than one thread; under
``torch.use_deterministic_algorithms(True)`` it calls ATen's ordered kernel instead.
lowprec's compiled steps follow that switch.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


class _Embedded(nn.Module):
    """Token and position embeddings under a layer norm: Inductor fuses the norm's backward
    with the token embedding's row adds."""

    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1]))
        return self.head(self.norm(x))


def _gradient_digests(runs: int) -> set[str]:
    """The digests of ``runs`` backward passes' token-embedding gradients, one compiled step."""
    torch.manual_seed(0)
    model = _Embedded(64, 64, 64)
    tokens = torch.randint(0, 64, (64, 64))
    step = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2"})
    digests = set()
    for _ in range(runs):
        model.zero_grad()
        step(tokens).square().mean().backward()
        digests.add(hashlib.sha256(model.tokens.weight.grad.numpy().tobytes()).hexdigest())
    return digests


def test_an_inductor_step_with_an_embedding_repeats_its_bits_under_deterministic_algorithms(deterministic):
    assert len(_gradient_digests(runs=4)) == 1
