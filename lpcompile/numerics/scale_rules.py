"""Per-layer loss-scale rules (Zhao, Vogel et al. 2019), on gradient statistics.

All functions work on the statistics vector of ``lowprec::scale_grad``
(:func:`lpcompile.numerics.scale_grad.gradient_stats`): a count per FP32 exponent,
then the sum and sum of squares. Every scale is a power of two, so scaling
and unscaling in FP32 are exact.

The scale ``s_i`` of layer ``i`` is the paper's cumulative scale ``A_i``: the
factor the error entering layer ``i`` carries into its quantize. Layers are
indexed in graph order (input side first), so ``α_i = s_i / s_(i+1)``, with
``s = 1`` above the top layer, is the layer's own factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lpcompile.numerics.formats import FloatFormat
from lpcompile.numerics.quantize import whole_tensor
from lpcompile.numerics.scale_grad import EXP_BINS

RULES = ("quantile", "approx_range", "fixed")


@dataclass(frozen=True)
class ScaleBounds:
    """Bounds on the scales: ``1 ≤ α_i ≤ max_scale``, ``A_i ≤ max_cumulative``."""

    max_scale: float
    max_cumulative: float

    @classmethod
    def for_format(cls, fmt: FloatFormat) -> ScaleBounds:
        """Defaults that fit the format's range.

        The authors' α ≤ 16, A ≤ 1024 were chosen for FP16, whose smallest
        subnormal is 2**-24. An 8-bit format's is 2**-16 (E5M2) or 2**-9 (E4M3):
        errors need that much more scale to reach the same grid, so both caps
        grow by the shortfall of the format's smallest subnormal against FP16's.
        The overflow bound (``overflow_cap``) still applies on top.
        """
        shortfall = max(0, _exponent(fmt.min_subnormal) - _exponent(2.0**-24))
        max_scale = 2.0 ** (4 + shortfall)
        max_cumulative = 2.0 ** (10 + shortfall)
        return cls(max_scale, max_cumulative)


def _exponent(value: float) -> int:
    """``log2`` of a power of two (or of the power of two below ``value``)."""
    return math.frexp(value)[1] - 1


def _nonzero_counts(stats: torch.Tensor) -> torch.Tensor:
    """Counts of finite, normal FP32 magnitudes per exponent bin (bins 1..254)."""
    counts = stats[:EXP_BINS].to(torch.float64).clone()
    counts[0] = 0.0  # zeros and FP32 subnormals: nothing a scale can save
    counts[EXP_BINS - 1] = 0.0  # inf / NaN
    return counts


def underflow_fraction(stats: torch.Tensor, scale: float, fmt: FloatFormat) -> float:
    """Fraction of the non-zero ``|g|`` with ``scale·|g|`` below ``fmt``'s smallest value.

    Exact at bin resolution: bins and both thresholds are powers of two. NaN when
    no ``|g|`` is non-zero: a layer starved of errors (e.g. every error above it
    flushed to zero) has nothing to measure, and 0.0 would read as "in range".
    """
    counts = _nonzero_counts(stats)
    total = counts.sum().item()
    if total == 0:
        return math.nan
    # bin e holds [2**(e-127), 2**(e-126)); below iff 2**(e-126)·scale ≤ min_subnormal
    last_below = _exponent(fmt.min_subnormal) - _exponent(scale) + 126
    return counts[: max(0, min(last_below + 1, EXP_BINS))].sum().item() / total


def largest_magnitude_exponent(stats: torch.Tensor) -> int | None:
    """``e`` such that every finite ``|g| < 2**e``, or None if all are zero."""
    nonzero = torch.nonzero(_nonzero_counts(stats)).flatten()
    return None if len(nonzero) == 0 else int(nonzero[-1]) - 126


def quantile_scale(stats: torch.Tensor, fmt: FloatFormat, underflow: float) -> float | None:
    """The smallest power of two that leaves at most ``underflow`` of ``|g|`` below fmt's min.

    The paper's description: α = u_min / q, q the (n_uf·N)-th smallest non-zero
    ``|g|``, taken at the lower edge of its exponent bin. None when all are zero.
    """
    counts = _nonzero_counts(stats)
    total = counts.sum().item()
    if total == 0:
        return None
    below = torch.cumsum(counts, 0)
    bin_q = int(torch.nonzero(below > underflow * total).flatten()[0])
    return 2.0 ** (_exponent(fmt.min_subnormal) - (bin_q - 127))


def approx_range_scale(
    stats: torch.Tensor,
    weight: torch.Tensor | None,
    fmt: FloatFormat,
    underflow: float,
    out_dim: int = 0,
    groups: int = 1,
) -> float | None:
    """The authors' Gaussian rule, on the products ``g·W`` of the input-gradient matmul.

    σ = sqrt((σ_g² + μ_g²)(σ_W² + μ_W²)·fan_in/2); α = u_min / (√2·erfinv(n_uf)·σ).
    ``fan_in`` is the number of products each input-gradient element sums: the
    weight's output features (times the kernel size for a convolution), as in the
    authors' ``get_fan_in`` on Chainer's (out, in, ...) weights; ``out_dim`` is the
    dimension holding them (1 for a transposed convolution's (in, out/groups, ...)), and a
    grouped convolution's element sums one of its ``groups`` of them.
    Layers without a weight fall back to :func:`quantile_scale`.
    """
    if weight is None:
        return quantile_scale(stats, fmt, underflow)
    numel = stats[:EXP_BINS].sum().item()  # every element has a bin, zeros and inf/NaN too
    second_g = stats[EXP_BINS + 1].item() / max(numel, 1)  # σ_g² + μ_g² is the second moment
    w = weight.detach().to(torch.float64)
    second_w = whole_tensor((w * w).mean()).item()  # a tensor-parallel weight's shards together
    fan_in = w.shape[out_dim] // groups * math.prod(w.shape[2:])
    sigma = math.sqrt(second_g * second_w * fan_in / 2)
    if sigma == 0 or not math.isfinite(sigma):
        return None
    threshold = math.sqrt(2) * torch.special.erfinv(torch.tensor(underflow, dtype=torch.float64)).item()
    return 2.0 ** _exponent(fmt.min_subnormal / (threshold * sigma))


def bound_scales(
    needed: list[float | None],
    current: list[float],
    overflow_caps: list[float | None],
    bounds: ScaleBounds,
) -> list[float]:
    """Apply the bounds top-down (backward order: last layer first); powers of two.

    ``needed[i]`` is the rule's scale for layer ``i`` in graph order (None: keep
    ``current[i]``). Lower bound first (α ≥ 1), then the upper bounds, which win
    where they conflict: α ≤ max_scale, A ≤ max_cumulative, no overflow of the
    largest error.
    """
    out = [0.0] * len(needed)
    above = 1.0
    for i in reversed(range(len(needed))):
        s = needed[i] if needed[i] is not None else current[i]
        s = max(s, above)
        s = min(s, above * bounds.max_scale, bounds.max_cumulative)
        if overflow_caps[i] is not None:
            s = min(s, overflow_caps[i])
        s = 2.0 ** _exponent(s)
        out[i] = above = s
    return out


def overflow_cap(stats: torch.Tensor, fmt: FloatFormat) -> float | None:
    """The largest power-of-two scale that keeps ``scale·max|g|`` within fmt's max."""
    top = largest_magnitude_exponent(stats)
    if top is None:
        return None
    return 2.0 ** (_exponent(fmt.max) - top)  # |g| < 2**top, so scale·|g| < 2**exp(max) ≤ max
