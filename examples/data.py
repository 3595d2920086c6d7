"""Real data that ships with the dependencies: scikit-learn's digits set, and the sources of
Python's standard library."""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class TextSplit:
    """Train and validation text as byte tensors (``uint8``), and the files each came from."""

    train: torch.Tensor
    validation: torch.Tensor
    train_files: tuple[str, ...]
    validation_files: tuple[str, ...]


def load_stdlib_source(validation_every: int = 10, folder: str | Path | None = None) -> TextSplit:
    """The running interpreter's standard-library modules (the ``*.py`` files at the top of
    its ``Lib/``, about 4.7 MB for CPython 3.11) as UTF-8 bytes, split by file: every
    ``validation_every``-th file in name order is validation text, the others training text.

    Bytes are the characters for all but about a hundred of them (the sources are ASCII
    but for a few names and examples in comments), so bits per byte are bits per character.
    """
    if validation_every < 2:
        raise ValueError(f"validation_every must be ≥ 2, got {validation_every}")
    root = Path(folder if folder is not None else sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if len(files) < validation_every:
        raise FileNotFoundError(f"{root}: {len(files)} *.py files, need at least {validation_every}")
    parts: dict[bool, list[Path]] = {True: [], False: []}
    for i, path in enumerate(files):
        parts[i % validation_every == validation_every - 1].append(path)

    def read(paths: list[Path]) -> torch.Tensor:
        text = b"".join(path.read_bytes() for path in paths)
        return torch.frombuffer(bytearray(text), dtype=torch.uint8)

    return TextSplit(
        read(parts[False]),
        read(parts[True]),
        tuple(p.name for p in parts[False]),
        tuple(p.name for p in parts[True]),
    )
