"""Complex tensors: lowprec rounds their real and imaginary parts (torch's own casts as
the reference), stochastic rounding drawing the bits of the parts interleaved."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from lpcompile import quantize
from lpcompile.numerics import lowering


def parts_cast(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.complex(z.real.to(dtype).float(), z.imag.to(dtype).float())


@pytest.mark.parametrize("fmt, dtype", [("e5m2", torch.float8_e5m2), ("e4m3", torch.float8_e4m3fn)])
def test_nearest_rounds_each_part_as_torch_casts_it(fmt, dtype):
    torch.manual_seed(0)
    z = torch.randn(6, 7, dtype=torch.cfloat) * 8
    assert torch.equal(quantize(z, fmt), parts_cast(z, dtype))
    # views: a transpose, a conjugate (its sign bit unresolved), a 0-dim element
    assert torch.equal(quantize(z.t(), fmt), parts_cast(z.t(), dtype))
    assert torch.equal(quantize(z.conj(), fmt), parts_cast(z.conj().resolve_conj(), dtype))
    assert torch.equal(quantize(z[2, 3], fmt), parts_cast(z[2, 3], dtype))


def test_half_precision_parts():
    z = (torch.randn(4, 5, dtype=torch.cfloat) * 8).to(torch.complex32)
    got = quantize(z, "e5m2")
    assert got.dtype == torch.complex32
    assert torch.equal(torch.view_as_real(got), torch.view_as_real(z).to(torch.float8_e5m2).half())


def test_stochastic_rounding_draws_the_parts_interleaved():
    torch.manual_seed(0)
    z = torch.randn(5, 6, dtype=torch.cfloat)
    parts = torch.view_as_real(z).reshape(5, 12)  # real, imaginary, real, ... along each row
    got = quantize(z, "e5m2", "stochastic", seed=3, offset=11)
    expected = quantize(parts, "e5m2", "stochastic", seed=3, offset=11)
    assert torch.equal(torch.view_as_real(got).reshape(5, 12), expected)
    assert not torch.equal(got, quantize(z, "e5m2"))  # it did not round to nearest


def test_inductor_lowers_the_parts_to_the_same_bits():
    lowering.refresh_inductor_decompositions()
    torch.manual_seed(0)
    z = torch.randn(16, 8, dtype=torch.cfloat)
    seed = torch.tensor(5)

    def rounded(z):
        return torch.ops.lowprec.quantize(z, "e5m2", "stochastic", "saturate", seed, 7, None)

    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False):
        got, (code,) = run_and_get_code(torch.compile(rounded, backend="inductor"), z)
    assert torch.equal(got, rounded(z))
    assert "torch.ops.lowprec" not in code  # lowered, not called


def test_complex128_is_refused():
    with pytest.raises(TypeError, match="complex ones of those parts.*complex128"):
        quantize(torch.zeros(3, dtype=torch.complex128), "e5m2")
