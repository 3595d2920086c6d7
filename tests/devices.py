"""The device the kernel tests run on: ``LOWPREC_TEST_DEVICE`` (``cpu``, the default, or ``cuda``).

With ``cuda``, the tests that compile kernels (generated Triton, Inductor) run them on
the GPU and compare with the reference ops on the CPU; with ``cpu`` generated Triton
runs in Triton's interpreter.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch
import torch._functorch.config

_NAME = os.environ.get("LOWPREC_TEST_DEVICE", "cpu")
if _NAME not in ("cpu", "cuda"):
    raise ValueError(f"LOWPREC_TEST_DEVICE={_NAME!r}: expected cpu or cuda")
TEST_DEVICE = torch.device(_NAME)
T = TypeVar("T")


def on_test_device(value: T) -> T:
    """A tensor copied to :data:`TEST_DEVICE` with its shape and strides (a strided view keeps
    its gaps) and its ``requires_grad``, as a leaf; any other value as it is."""
    if not isinstance(value, torch.Tensor) or value.device == TEST_DEVICE:
        return value
    out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=TEST_DEVICE)
    return out.copy_(value.detach()).requires_grad_(value.requires_grad)


def compiled_afresh(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` compiled whole by Inductor afresh: no FX graph or AOT autograd cache
    hit, so that its lowering (not a cached kernel) is what runs."""
    with (
        torch._functorch.config.patch(enable_autograd_cache=False),
        torch._inductor.config.patch(fx_graph_cache=False),
    ):
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True)(*args)


def assert_compiled_rounding(x: torch.Tensor, scaling: str, nearest: str, stochastic: str) -> None:
    """``lowprec::quantize`` of ``x`` with ``scaling``, to nearest in format ``nearest``
    (saturating) and stochastically in ``stochastic`` (overflowing to inf), compiled afresh,
    gives the reference implementation's bits (NaN where it gives NaN)."""
    quantize = torch.ops.lowprec.quantize
    seed = torch.tensor(5, device=x.device)

    def both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            quantize(x, nearest, "nearest", "saturate", None, 0, None, scaling),
            quantize(x, stochastic, "stochastic", "inf", seed, 7, None, scaling),
        )

    for got, want in zip(compiled_afresh(both, x), both(x), strict=True):
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())
