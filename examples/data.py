"""Real data that ships with the dependencies: scikit-learn's digits set."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    """Train and test tensors: images ``(N, 1, 8, 8)`` in [0, 1], labels ``(N,)``."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Split:
    """The 1,797 8x8 handwritten digits, split by a fixed, stratified shuffle."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    train_idx, test_idx = torch.tensor(train_idx), torch.tensor(test_idx)
    return Split(images[train_idx], labels[train_idx], images[test_idx], labels[test_idx])
