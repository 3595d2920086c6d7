"""Shared helpers for the numerics tests: bitwise comparison with readable failures."""

from __future__ import annotations

import sys

import pytest
import torch
from devices import TEST_DEVICE


def pytest_configure(config: pytest.Config) -> None:
    if TEST_DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("LOWPREC_TEST_DEVICE=cuda, but torch sees no CUDA device")


@pytest.fixture(autouse=True)
def _forget_loaded_streams():
    """Loaded random-stream state (or the warning a checkpoint without it leaves for the next
    stochastically rounded call) belongs to the test that loaded it."""
    yield
    state = sys.modules.get("lpcompile.backend.state")
    if state is not None:
        state.REGISTRY.load_streams_state([])


_INT_OF = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float8_e5m2: torch.uint8,
    torch.float8_e4m3fn: torch.uint8,
}


def float_bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor, as an integer tensor of the same width."""
    return t.contiguous().view(_INT_OF[t.dtype])


def _show(t: torch.Tensor, i: int) -> str:
    width = {1: 2, 2: 4, 4: 8}[t.element_size()]
    raw = int(float_bits(t).reshape(-1)[i]) & ((1 << (8 * t.element_size())) - 1)
    return f"{float(t.reshape(-1)[i])!r} (0x{raw:0{width}x})"


def assert_same_bits(
    actual: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor, label: str = "", show: int = 8
) -> None:
    """Assert equal bit patterns (any NaN equals any NaN); list a few offending inputs."""
    assert actual.dtype == expected.dtype, f"{label}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{label}: shape {actual.shape} != {expected.shape}"
    a, e = actual.reshape(-1), expected.reshape(-1)
    same = (float_bits(a) == float_bits(e)) | (torch.isnan(a) & torch.isnan(e))
    bad = torch.nonzero(~same).reshape(-1)
    if bad.numel():
        flat = inputs.reshape(-1)
        lines = [
            f"  x={_show(flat, i)} -> got {_show(a, i)}, expected {_show(e, i)}" for i in bad[:show].tolist()
        ]
        raise AssertionError(f"{label}: {bad.numel()} of {a.numel()} mismatches, e.g.\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def single_thread():
    """Run a module's tests on one intra-op thread, then restore the count.

    The numerics tests run many ops on 10K-4M elements. On a shared 2-core machine
    a parallel op waits at OpenMP barriers for a descheduled thread: measured 55 s
    with 2 threads against 10 s with one for the same tests under load (equal when
    idle). Use with ``pytestmark = pytest.mark.usefixtures("single_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def same_bits():
    """``same_bits(actual, expected, inputs, label)``: bitwise equality, NaN == NaN."""
    return assert_same_bits
