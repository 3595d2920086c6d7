"""Complex products (a Fourier neural operator's spectral weights, complex matmuls): their
operands' real and imaginary parts are rounded as a real product's would be, errors and
weight gradients too (torch's own casts as the reference)."""

from __future__ import annotations

import warnings

import pytest
import torch
from grid import SR_EVERYWHERE, GridCheck, grid_step, on_e5m2_grid, on_scaled_fp8_grid, watched_backend
from torch import nn

import lpcompile


class ComplexLinear(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.cfloat) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(8, 8, dtype=dtype) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.complex(x, x.flip(-1)) @ self.w)


class Spectral(nn.Module):
    """A Fourier neural operator's layer: the lowest modes of the input's spectrum times a
    complex weight per mode, back to space, then a pointwise linear layer."""

    def __init__(self, channels: int = 4, modes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(channels, channels, modes, modes, dtype=torch.cfloat) / 3)
        self.modes = modes
        self.lin = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft2(x)
        m = self.modes
        out = torch.zeros_like(spectrum)
        out[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", spectrum[:, :, :m, :m], self.w)
        return self.lin(torch.fft.irfft2(out, s=x.shape[-2:]).permute(0, 2, 3, 1))


def e5(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return torch.complex(t.real.to(torch.float8_e5m2).float(), t.imag.to(torch.float8_e5m2).float())


class Rounded(torch.autograd.Function):
    """Forward: the parts rounded by torch's cast; backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, t):
        return e5(t)

    @staticmethod
    def backward(ctx, grad):
        return grad


class RoundedGrad(torch.autograd.Function):
    """Forward: the identity; backward: the gradient's parts rounded by torch's cast."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return e5(grad)


def on_grid(t: torch.Tensor) -> bool:
    return on_e5m2_grid(t)


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_a_complex_matmul_matches_a_hand_written_reference(executor):
    model = ComplexLinear()
    x = torch.randn(4, 8, requires_grad=True)
    c = torch.randn(4, 8, 2)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = {"recipe": "fp8-e5m2", "executor": executor}
        y = torch.compile(model, backend="lowprec", options=options)(x)
        (y * c).sum().backward()
    assert not [w for w in caught if "lowprec" in str(w.message)]
    x_ref = x.detach().clone().requires_grad_()
    w_ref = model.w.detach().clone().requires_grad_()
    z = Rounded.apply(torch.complex(x_ref, x_ref.flip(-1)))
    y_ref = torch.view_as_real(RoundedGrad.apply(z @ Rounded.apply(RoundedGrad.apply(w_ref))))
    (y_ref * c).sum().backward()
    for label, got, expected in (
        ("output", y, y_ref),
        ("input grad", x.grad, x_ref.grad),
        ("weight grad", model.w.grad, w_ref.grad),
    ):
        assert torch.equal(got.detach(), expected.detach()), label
    rows = {row.layer: row for row in lpcompile.coverage(model)}
    assert set(rows["w"].quantized) == {"activation", "weight", "error", "weight_grad"}


def test_a_spectral_layer_computes_on_the_grid():
    model = Spectral()
    check = grid_step(model, {"x": torch.randn(2, 4, 8, 8)}, SR_EVERYWHERE)
    assert check.count >= 5 and not check.off_grid and not check.unknown
    for executor in ("eager", "inductor"):
        model.zero_grad()
        torch._dynamo.reset()
        options = {"recipe": "fp8-e5m2-sr", "executor": executor}
        torch.compile(model, backend="lowprec", options=options)(
            torch.randn(2, 4, 8, 8)
        ).square().sum().backward()
        assert on_grid(model.w.grad) and on_grid(model.lin.weight.grad), executor


def test_rowwise_scaling_rounds_a_complex_product_per_tensor():
    """A row of a complex operand's parts interleaves real and imaginary ones: it takes the
    per-tensor counterpart, each operand scaled by the factor of its largest part."""
    model = ComplexLinear()
    rowwise = {role: {"scaling": "rowwise"} for role in ("weight", "activation", "error")}
    options = {"recipe": "fp8-rowwise", "executor": "eager", **rowwise}
    check = GridCheck(on_operand=lambda func, i, t: on_scaled_fp8_grid(torch.view_as_real(t.resolve_conj())))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend=watched_backend(options, check))(torch.randn(4, 8)).square().sum()
        with check:
            loss.backward()
    assert check.count == 2 and not check.off_grid  # the forward, the weight gradient
    assert not [w for w in caught if "lowprec" in str(w.message)]
    assert lpcompile.coverage(model)[0].quantized["weight"] == "e4m3 nearest saturate tensorwise"


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_per_matmul_options_name_the_complex_products_they_do_not_reach(executor):
    model = ComplexLinear()
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = {"recipe": "fp8-rowwise-gw-hp", "executor": executor}
        y = torch.compile(model, backend="lowprec", options=options)(x)
        y.square().sum().backward()
    assert any("complex products of ['w']" in str(w.message) for w in caught)
    # the weight gradient's matmul did not read the high-precision operands the option names
    z = torch.complex(x, x.flip(-1))
    in_high_precision = z.conj().T @ (2 * torch.view_as_complex(y.detach().contiguous()))
    assert not torch.allclose(model.w.grad, in_high_precision)


def test_saturation_counts_the_parts():
    model = ComplexLinear()
    with torch.no_grad():
        model.w[0, 0] = complex(1e5, 0.5)  # a real part past E5M2's largest value
    torch._dynamo.reset()
    options = {"recipe": "fp8-e5m2", "executor": "eager", "saturation": "count"}
    torch.compile(model, backend="lowprec", options=options)(torch.randn(4, 8)).sum().backward()
    (weight,) = [row for row in lpcompile.saturation(model) if row.role == "weight"]
    assert (weight.calls, weight.saturated, weight.nonzero) == (1, 1, 128)


def test_adaptive_scaling_reads_both_parts():
    model = Spectral()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(
            model, backend="lowprec", options={"recipe": "fp8-e5m2-als", "executor": "eager"}
        )
        compiled(torch.randn(2, 4, 8, 8)).square().sum().backward()
    # torch warns where a complex gradient is cast to a real dtype, dropping its imaginary part
    assert not [w for w in caught if "imaginary" in str(w.message) or "lowprec" in str(w.message)]
    assert torch.isfinite(model.w.grad).all() and on_grid(model.w.grad)


def test_a_complex128_layer_is_refused_by_name():
    model = ComplexLinear(torch.complex128)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"computes in torch.complex128"):
        torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2"})(
            torch.randn(4, 8, dtype=torch.float64)
        )
