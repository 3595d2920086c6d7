"""``lowprec::scale_grad`` and ``lowprec::count_grad``: the nodes that scale a gradient
and measure it.

``scale_grad(x, scale, probe, stats, record)`` is the identity in the forward. In
the backward it multiplies the incoming gradient by ``scale`` and, when ``probe``
requires a gradient, returns statistics of the incoming gradient as the
probe's gradient. Statistics thus leave the compiled backward graph the way
any gradient does, with no mutation inside the graph. With ``record`` (a 0-dim
bool tensor, read when the backward runs) they are computed under ``torch.cond``
only where it is true, zeros otherwise: one compiled backward serves the calls
that record and those that do not.

* ``stats="histogram"``: :data:`STATS_SIZE` values: a count per FP32 exponent
  field (bin ``e`` holds ``|g|`` in ``[2**(e-127), 2**(e-126))``; bin 0 holds
  zeros and FP32 subnormals, bin 255 inf and NaN), then the sum and the sum of
  squares of the finite values;
* ``stats="nonfinite"``: the number of inf/NaN values (a scalar probe).

The histogram traces into ``index_add`` (what the Triton codegen fuses);
:func:`count_bins` is the same count as one opaque call, which
``passes.histogram.count_histograms_serially`` puts in its place for Inductor.

``count_grad(x, probe, fmt, scaling)`` is the identity in the forward too;
its backward passes the incoming gradient on unchanged and returns, as the probe's
gradient, that gradient's :func:`range_counts` (scaled as ``scaling`` says) and a 1 (the
backward passes counted), so that the probe's accumulated gradient holds the totals over
every backward (option ``saturation``).
"""

from __future__ import annotations

from functools import partial

import torch

from lpcompile.numerics.formats import parse_format
from lpcompile.numerics.quantize import dynamic_scale, is_dtensor, real_parts, scale_within, whole_tensor

EXP_BINS = 256
STATS_SIZE = EXP_BINS + 2
STATS = ("none", "histogram", "nonfinite")


def gradient_stats(grad: torch.Tensor, stats: str) -> torch.Tensor:
    """The statistics ``scale_grad`` reports for ``grad`` (FP32; of a complex one, of its real
    and imaginary parts)."""
    g = (real_parts(grad) if grad.is_complex() else grad).to(torch.float32)
    if stats == "nonfinite":
        return (~torch.isfinite(g)).sum().to(torch.float32)
    # a copy in the layout the trace assumes: an eager backward may hand over another (CPU
    # layer norm's gradient of a permuted input), which the flattening view below refuses
    g = g.clone(memory_format=torch.contiguous_format)
    exponent = torch.bitwise_and(torch.bitwise_right_shift(g.view(torch.int32), 23), 0xFF)
    counts = torch.zeros(EXP_BINS, dtype=torch.float32, device=g.device).index_add(
        0, exponent.reshape(-1).to(torch.int64), torch.ones_like(g).reshape(-1)
    )
    finite = torch.where(torch.isfinite(g), g, 0.0)
    moments = torch.stack([finite.sum(), (finite * finite).sum()])
    return torch.cat([counts, moments])


@torch.library.custom_op("lowprec::count_bins", mutates_args=())
def count_bins(bins: torch.Tensor, size: int) -> torch.Tensor:
    """How many elements of the integer tensor ``bins`` hold each of ``0 .. size-1``
    (FP32 counts, as ``index_add(zeros(size), 0, bins.view(-1), ones)`` makes them).

    On a GPU the count is :func:`bin_counts_in_range`, which checks no range:
    ``bincount`` and the check would read back to the host and stall the backward
    (``bincount`` stays where deterministic algorithms are asked for, which refuse
    CUDA's ``histc``). ``count_histograms_serially`` passes bins masked into range.
    """
    if bins.is_cuda and not torch.are_deterministic_algorithms_enabled():
        return bin_counts_in_range(bins, size)
    counts = torch.bincount(bins.reshape(-1), minlength=size)
    if counts.numel() != size:
        raise ValueError(f"count_bins: a bin index is {counts.numel() - 1}, outside 0..{size - 1}")
    return counts.to(torch.float32)


def bin_counts_in_range(bins: torch.Tensor, size: int) -> torch.Tensor:
    """FP32 counts of the values ``0 .. size-1`` in ``bins``, which must hold no other
    (``histc`` over ``[0, size]``, exact: each integer is one bucket of width 1)."""
    return torch.histc(bins.reshape(-1).to(torch.float32), size, 0, size)


@count_bins.register_fake
def _(bins, size):
    return bins.new_empty((size,), dtype=torch.float32)


def recorded_stats(grad: torch.Tensor, stats: str, record: torch.Tensor) -> torch.Tensor:
    """:func:`gradient_stats` of ``grad`` where the 0-dim bool ``record`` is true, else zeros."""
    size = STATS_SIZE if stats == "histogram" else ()
    # torch.cond traces its branches with Dynamo, which inside DDP's forward splits them
    # with its DDPOptimizer: traced so from AOT autograd, a branch's operand became a fake
    # constant of the backward graph
    with torch._dynamo.config.patch(optimize_ddp=False):
        return torch.cond(
            record,
            lambda g: gradient_stats(g, stats),
            lambda g: torch.zeros(size, dtype=torch.float32, device=g.device),
            (grad,),
        )


@torch.library.custom_op("lowprec::scale_grad", mutates_args=())
def scale_grad_op(
    x: torch.Tensor,
    scale: torch.Tensor,
    probe: torch.Tensor | None,
    stats: str,
    record: torch.Tensor | None = None,
) -> torch.Tensor:
    if stats not in STATS:
        raise ValueError(f"stats must be one of {STATS}, got {stats!r}")
    if record is not None and (record.dtype != torch.bool or record.dim() != 0):
        raise ValueError(f"record must be a 0-dim bool tensor, got {record.dtype} of shape {record.shape}")
    return x.clone()


@scale_grad_op.register_fake
def _(x, scale, probe, stats, record=None):
    return torch.empty_like(x)


def _save(ctx, inputs, output):
    _, scale, _, ctx.stats, record = inputs
    ctx.recorded = record is not None
    ctx.save_for_backward(scale, *([record] if ctx.recorded else []))


def _scale_incoming(ctx, grad):
    scale, *record = ctx.saved_tensors
    probe_grad = None
    if ctx.needs_input_grad[2] and ctx.stats != "none":
        if record:
            measure = partial(recorded_stats, stats=ctx.stats, record=record[0])
        else:
            measure = partial(gradient_stats, stats=ctx.stats)
        if is_dtensor(grad):  # tensor parallelism: the whole gradient's statistics
            from lpcompile.numerics.dtensor import whole_stats

            probe_grad = whole_stats(grad, measure)
        else:
            probe_grad = measure(grad)
    return (grad * scale).to(grad.dtype), None, probe_grad, None, None


scale_grad_op.register_autograd(_scale_incoming, setup_context=_save)


def range_counts(x: torch.Tensor, fmt: str, scaling: str = "none") -> torch.Tensor:
    """Where the values of ``x`` lie against the format ``fmt``, whose largest finite value
    is ``largest`` and smallest positive one ``smallest``: an int64 tensor of the counts of
    values beyond ``largest`` in magnitude (infinities included), of inf or NaN values, of
    non-zero values, and of non-zero values below ``smallest`` in magnitude (those rounding
    can only flush to zero or raise to ``smallest``). With a ``scaling`` other than
    ``"none"``, of ``x`` scaled as the quantize with that scaling scales it. A complex ``x``'s
    values are its real and imaginary parts."""
    target = parse_format(fmt)
    if x.is_complex():
        x = real_parts(x)
    largest, smallest = target.max, target.min_subnormal
    if scaling != "none":
        x = scale_within(x, dynamic_scale(x, target, scaling), largest)
    magnitude = x.abs()
    nonzero = magnitude != 0
    return torch.stack(
        [
            (magnitude > largest).sum(),
            torch.isfinite(x).logical_not().sum(),
            nonzero.sum(),
            (nonzero & (magnitude < smallest)).sum(),
        ]
    )


# counts per site, in a count_grad probe (a gradient site's) as in the forward sites' rows:
# range_counts' four, then the backward passes (calls) that ran the site
PROBE_SIZE = 5


def count_probe(sites: int, device: torch.device | str) -> torch.Tensor:
    """A float64 leaf of zeros that requires grad: the probe of ``sites`` gradient sites
    that ``count_grad`` nodes count into (one row of ``PROBE_SIZE`` each)."""
    return torch.zeros(sites, PROBE_SIZE, dtype=torch.float64, device=device, requires_grad=True)


@torch.library.custom_op("lowprec::count_grad", mutates_args=())
def count_grad_op(x: torch.Tensor, probe: torch.Tensor, fmt: str, scaling: str = "none") -> torch.Tensor:
    if probe.shape != (PROBE_SIZE,) or not probe.is_floating_point():
        raise ValueError(
            f"count_grad's probe must be a float tensor of {PROBE_SIZE} elements, "
            f"got {probe.dtype} {tuple(probe.shape)}"
        )
    return x.clone()


@count_grad_op.register_fake
def _(x, probe, fmt, scaling="none"):
    return torch.empty_like(x)


def _save_range(ctx, inputs, output):
    _, probe, ctx.fmt, *scaling = inputs
    ctx.scaling = scaling[0] if scaling else "none"
    ctx.probe_dtype, ctx.probe_device = probe.dtype, probe.device


def _count_incoming(ctx, grad):
    probe_grad = None
    if ctx.needs_input_grad[1]:
        # (a DTensor's: the whole tensor's, on every rank)
        counts = whole_tensor(range_counts(grad, ctx.fmt, ctx.scaling))
        # (on the probe's device: a model spread over devices counts into one probe)
        probe_grad = torch.cat([counts, counts.new_ones(1)]).to(ctx.probe_device, ctx.probe_dtype)
    return grad, probe_grad, None, None


count_grad_op.register_autograd(_count_incoming, setup_context=_save_range)
