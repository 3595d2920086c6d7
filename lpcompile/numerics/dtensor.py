"""The rounding operators on DTensors (tensor parallelism).

A model parallelized with ``torch.distributed.tensor.parallel`` holds DTensors, and a
DTensor runs an operator through a sharding rule. lowprec's rounding operators get
handlers of their own in DTensor's dispatcher (:func:`register_dtensor_rules`, when a
graph of DTensors compiles, or ``lpcompile.quantize`` is given a DTensor), which round
each rank's shard where they can:

* A partial sum (``Partial``: a row-parallel layer's output, the error reaching a
  column-parallel layer's input) is summed over the ranks first: the sum is what is
  rounded, as on one device.
* Element by element (``scaling="none"``; rowwise and block scalings along a dimension
  that is not split), each rank rounds its own shard. The random bits of stochastic
  rounding follow each element's index in the shard, from a stream of the shard's own:
  the seed is folded with the shard's position on the mesh (:func:`shard_fold`), so
  that shards draw different bits, and replicas of one tensor the same.
* A scaling that reads the whole tensor (tensorwise, NVFP4's), or a row, block or tile
  split over the ranks, gathers the tensor, rounds it whole and keeps each rank's shard.

The pass-through operators (the forwards of ``quantize_grad``, ``scale_grad`` and
``count_grad``, and ``realize``) run on the local tensors and keep the placements.
``scale_grad``'s backward measures a split error with :func:`whole_stats`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor

from lpcompile.numerics.quantize import is_rowwise, is_tiled, reads_whole_tensor

# Multiplier of a shard's position into the high 32 bits of the seed (the user seed's
# half; the rank's multiplier is another, so that folds of ranks and of shards differ).
SHARD_MULTIPLIER = 0x85EBCA6B


def shard_fold(placements: tuple, coordinate: list[int] | tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """What a shard's seed is XOR-ed with: 0 for a tensor no mesh dimension splits (its
    replicas draw the same bits), else its position among the shards (the mesh
    coordinates along the dimensions that split it), multiplied into the seed's high
    half, as a signed 64-bit value."""
    position, split = 0, False
    for placement, index, size in zip(placements, coordinate, sizes, strict=True):
        if placement.is_shard():
            position, split = position * size + index, True
    if not split:
        return 0
    value = ((position + 1) * SHARD_MULTIPLIER & 0xFFFFFFFF) << 32
    return value - (1 << 64) if value >= 1 << 63 else value


def _spec(like: DTensorSpec, placements: tuple, shape: torch.Size | None = None) -> DTensorSpec:
    """``like``'s mesh with ``placements`` (and a contiguous ``shape``, where given)."""
    meta = like.tensor_meta
    if shape is not None:
        meta = TensorMeta(shape, make_contiguous_strides_for(shape), meta.dtype)
    return DTensorSpec(like.mesh, tuple(placements), tensor_meta=meta)


def _summed(x: DTensor) -> tuple[torch.Tensor, DTensorSpec]:
    """``x``'s local tensor and spec, its partial sums (if any) summed over their ranks."""
    spec = x._spec
    if not any(p.is_partial() for p in spec.placements):
        return x._local_tensor, spec
    target = _spec(spec, tuple(Replicate() if p.is_partial() else p for p in spec.placements))
    return redistribute_local_tensor(x._local_tensor, spec, target), target


def _wrap(local: torch.Tensor, spec: DTensorSpec, shape: torch.Size) -> DTensor:
    return DTensor(local, _spec(spec, spec.placements, shape), requires_grad=False)


def _needs_whole(spec: DTensorSpec, ndim: int, scaling: str) -> bool:
    """Whether ``scaling`` of a tensor split as ``spec`` reads values from other shards."""
    split = {p.dim % max(ndim, 1) for p in spec.placements if p.is_shard()}
    if not split:
        return False
    tiles = is_tiled(scaling) and bool(split & {ndim - 1, ndim - 2})
    return reads_whole_tensor(scaling) or tiles or (is_rowwise(scaling) and ndim - 1 in split)


def _quantize(op: Any, args: tuple, kwargs: dict) -> DTensor:
    x, fmt, rounding, overflow, seed, offset, *rest = args
    scale = rest[0] if rest else kwargs.get("scale")
    scaling = rest[1] if len(rest) > 1 else kwargs.get("scaling", "none")
    if scale is not None:
        raise NotImplementedError(
            "lowprec::quantize of a DTensor with a scale tensor: pass scaling= instead, which "
            "lowprec computes over the whole tensor"
        )
    local, spec = _summed(x)
    trailing = () if scaling == "none" else (scaling,)
    if _needs_whole(spec, x.ndim, scaling):
        whole_spec = _spec(spec, (Replicate(),) * spec.mesh.ndim)
        whole = redistribute_local_tensor(local, spec, whole_spec)
        out = op(whole, fmt, rounding, overflow, seed, offset, None, *trailing)
        rounded = _spec(whole_spec, whole_spec.placements, out.shape)
        out = redistribute_local_tensor(out, rounded, _spec(spec, spec.placements, out.shape))
        return _wrap(out, spec, x.shape)
    fold = shard_fold(spec.placements, spec.mesh.get_coordinate(), spec.mesh.shape)
    if seed is not None and fold:
        seed = torch.bitwise_xor(seed.to(torch.int64), fold)  # (an int32 seed would drop the fold)
    out = op(local, fmt, rounding, overflow, seed, offset, None, *trailing)
    return _wrap(out, spec, x.shape)


def _pass_through(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """An operator that returns its input's values in its layout, on the local tensor."""
    x, *rest = args
    return DTensor(op(x._local_tensor, *rest, **kwargs), x._spec, requires_grad=False)


def whole_stats(grad: DTensor, measure: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Additive statistics (counts, sums) of the whole tensor ``grad``, on every rank:
    ``measure`` of each rank's shard (its partial sums summed first), summed over the
    mesh dimensions that split it; a replicated tensor's are its own."""
    local, spec = _summed(grad)
    out = measure(local)
    parts = tuple(Partial() if p.is_shard() else Replicate() for p in spec.placements)
    if not any(p.is_partial() for p in parts):
        return out
    meta = TensorMeta(out.shape, out.stride(), out.dtype)
    source = DTensorSpec(spec.mesh, parts, tensor_meta=meta)
    return redistribute_local_tensor(out, source, _spec(source, (Replicate(),) * spec.mesh.ndim))


def register_dtensor_rules() -> None:
    """Give DTensor's dispatcher lowprec's handlers for its rounding, scaling and counting
    operators (idempotent)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    ops = torch.ops.lowprec
    handlers[ops.quantize.default] = _quantize
    handlers[ops.quantize_grad.default] = _pass_through
    handlers[ops.realize.default] = _pass_through
    handlers[ops.scale_grad.default] = _pass_through
    handlers[ops.count_grad.default] = _pass_through
