"""Counter-based random bits: ``(seed, offset, element index) -> 32 bits``.

The generator is a stateless integer hash (Wellons' ``lowbias32``: xor-shift,
multiply, xor-shift, multiply, xor-shift), applied twice per element. It is
defined once, as the data in :data:`MIX_STEPS`, and executed from that data on
Python ints (for host-side keys and tests), in the ops of :class:`TorchOps` or
of Inductor's ops handler (the reference on torch tensors, and the lowering of
``lowprec::quantize``, compiled to vectorised C++ or Triton), and in generated
Triton (``lpcompile.codegen``). All give the same bits.

Only 32-bit integer operations are used: 64-bit integer multiplies vectorise
poorly on CPUs. Torch has no logical right shift for int32, so a shift by
``s`` is an arithmetic shift followed by a mask of the low ``32 - s`` bits.

* ``key(seed, offset)`` mixes a 64-bit seed and a 32-bit stream offset into a
  32-bit key (a scalar; cheap): two hash rounds digest the seed
  (:func:`seed_digest`, shared by all of a graph's streams), a third mixes in the
  offset (:func:`key_from_digest`).
* ``bits[i] = mix(mix(i ^ key) + key)`` for the element's row-major index
  ``i`` (so results do not depend on memory layout).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# (operation, constant) pairs of one round of the lowbias32 hash.
MIX_STEPS: tuple[tuple[str, int], ...] = (
    ("xorshr", 16),
    ("mul", 0x7FEB352D),
    ("xorshr", 15),
    ("mul", 0x846CA68B),
    ("xorshr", 16),
)
SEED_HI_SALT = 0x9E3779B9
# Salt of the random signs of the weight gradient's Hadamard transform (hadamard_signs),
# and the values one transform mixes.
HADAMARD_SALT = 0x2545F491
HADAMARD_BLOCK = 16


def to_int32(value: int) -> int:
    """The signed 32-bit integer with the same low 32 bits as ``value``."""
    value &= MASK32
    return value - (1 << 32) if value >= (1 << 31) else value


def mix_int(x: int) -> int:
    """One hash round on a Python int (result in ``0 .. 2**32 - 1``)."""
    x &= MASK32
    for op, c in MIX_STEPS:
        if op == "xorshr":
            x ^= x >> c
        else:
            x = (x * c) & MASK32
    return x


def hadamard_signs(seed: int) -> list[int]:
    """The random signs (+1 or -1) of a random Hadamard transform of
    :data:`HADAMARD_BLOCK` values, drawn from ``seed``: the same for every tensor and step."""
    bits = mix_int(seed ^ HADAMARD_SALT)
    return [1 - 2 * ((bits >> i) & 1) for i in range(HADAMARD_BLOCK)]


class TorchOps:
    """Inductor's ops-handler names (``torch._inductor.virtualized.ops``) over torch tensors.

    The generator here and the rounding in :mod:`lpcompile.numerics.quantize` are
    written once against these names: run with this class they are the reference
    (eager) implementation; run with Inductor's ``ops`` they are its lowering, each
    step issued once per kernel body. Constants stay Python numbers, which torch
    broadcasts in the tensor's dtype.
    """

    bitwise_and = staticmethod(torch.bitwise_and)
    bitwise_xor = staticmethod(torch.bitwise_xor)
    bitwise_right_shift = staticmethod(torch.bitwise_right_shift)
    add = staticmethod(torch.add)
    sub = staticmethod(torch.sub)
    mul = staticmethod(torch.mul)
    truediv = staticmethod(torch.true_divide)
    lt = staticmethod(torch.lt)
    gt = staticmethod(torch.gt)
    where = staticmethod(torch.where)
    floor = staticmethod(torch.floor)
    copysign = staticmethod(torch.copysign)
    # NaN propagates as through Inductor's maximum and minimum; the bound may be a number
    maximum = staticmethod(torch.clamp_min)
    minimum = staticmethod(torch.clamp_max)

    @staticmethod
    def constant(value: int | float, dtype: torch.dtype) -> int | float:
        return value

    @staticmethod
    def to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)

    @staticmethod
    def to_dtype_bitcast(x: torch.Tensor, dtype: torch.dtype, src_dtype: torch.dtype) -> torch.Tensor:
        return x.view(dtype)


def _shr(x, s: int, ops):
    """Logical right shift of int32 ``x`` by ``s``."""
    shifted = ops.bitwise_right_shift(x, ops.constant(s, torch.int32))
    return ops.bitwise_and(shifted, ops.constant((1 << (32 - s)) - 1, torch.int32))


def mix(x, ops=TorchOps):
    """One hash round on int32 values (wrapping arithmetic), in ``ops``' terms."""
    for op, c in MIX_STEPS:
        if op == "xorshr":
            x = ops.bitwise_xor(x, _shr(x, c, ops))
        else:
            x = ops.mul(x, ops.constant(to_int32(c), torch.int32))
    return x


def key_int(seed: int, offset: int) -> int:
    """The 32-bit key (as an unsigned Python int) for a seed and offset."""
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    return mix_int(mix_int(lo ^ mix_int(hi ^ SEED_HI_SALT)) ^ (offset & MASK32))


def seed_digest(seed, ops=TorchOps):
    """The part of the key that depends on the seed alone: an int32 digest of an int64
    ``seed`` value, in ``ops``' terms (computed once for all of a graph's streams)."""
    i64, i32 = torch.int64, torch.int32
    low32 = ops.constant(MASK32, i64)
    sign = ops.constant(1 << 31, i64)
    lo = ops.bitwise_and(seed, low32)
    hi = ops.bitwise_and(ops.bitwise_right_shift(seed, ops.constant(32, i64)), low32)
    # Both halves into int32 range with the same low 32 bits, so the cast is exact.
    lo = ops.to_dtype(ops.sub(ops.bitwise_xor(lo, sign), sign), i32)
    hi = ops.to_dtype(ops.sub(ops.bitwise_xor(hi, sign), sign), i32)
    salted = ops.bitwise_xor(hi, ops.constant(to_int32(SEED_HI_SALT), i32))
    return mix(ops.bitwise_xor(lo, mix(salted, ops)), ops)


def key_from_digest(digest, offset, ops=TorchOps):
    """The 32-bit key (int32) of a stream: its seed's :func:`seed_digest` and an int32
    ``offset`` value (the stream offset's low 32 bits), in ``ops``' terms."""
    return mix(ops.bitwise_xor(digest, offset), ops)


def key_value(seed, offset, ops=TorchOps):
    """The 32-bit key (int32) of an int64 ``seed`` value and an int32 ``offset`` value
    (the stream offset's low 32 bits), in ``ops``' terms."""
    return key_from_digest(seed_digest(seed, ops), offset, ops)


def key_tensor(seed: torch.Tensor, offset: int) -> torch.Tensor:
    """The key as a 0-dim int32 tensor, for a 0-dim integer ``seed`` tensor."""
    return key_value(seed.to(torch.int64), to_int32(offset))


def bits_from_index(index, key, ops=TorchOps):
    """32 random bits (int32) for each int32 element index under an int32 ``key``."""
    if isinstance(key, int):
        key = ops.constant(to_int32(key), torch.int32)
    return mix(ops.add(mix(ops.bitwise_xor(index, key), ops), key), ops)


def check_numel(numel: int) -> None:
    """Element indices are 32-bit: refuse a tensor with 2^31 elements or more."""
    if numel >= 1 << 31:
        raise ValueError("counter-based bits index elements with 32 bits: tensor too large")


def index_bits(shape: torch.Size | tuple[int, ...] | list[int], key: torch.Tensor) -> torch.Tensor:
    """Random int32 bits for a tensor of ``shape`` under a 0-dim int32 ``key``, row-major."""
    numel = 1
    for size in shape:
        numel *= size
    check_numel(numel)
    index = torch.arange(numel, dtype=torch.int32, device=key.device).view(shape)
    return bits_from_index(index, key)


def random_bits(
    shape: torch.Size | tuple[int, ...], seed: int | torch.Tensor, offset: int = 0, device=None
) -> torch.Tensor:
    """Random int32 bits for a tensor of ``shape``, indexed in row-major order."""
    device = torch.get_default_device() if device is None else device
    if isinstance(seed, torch.Tensor):
        key = key_tensor(seed.to(device), offset)
    else:
        key = torch.tensor(to_int32(key_int(int(seed), offset)), dtype=torch.int32, device=device)
    return index_bits(shape, key)
