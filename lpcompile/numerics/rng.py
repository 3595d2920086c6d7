"""Counter-based random bits: ``(seed, offset, element index) -> 32 bits``.

The generator is a stateless integer hash (Wellons' ``lowbias32``: xor-shift,
multiply, xor-shift, multiply, xor-shift), applied twice per element. It is
defined once, as the data in :data:`MIX_STEPS`, and executed four ways from
that data: on Python ints (for host-side keys and tests), on torch int32
tensors (the reference and eager kernel), in Inductor's ops handler (the
lowering of ``lowprec::counter_bits``, compiled to vectorised C++), and in
generated Triton (``lpcompile.codegen``). All give the same bits.

Only 32-bit integer operations are used: 64-bit integer multiplies vectorise
poorly on CPUs. Torch has no logical right shift for int32, so a shift by
``s`` is an arithmetic shift followed by a mask of the low ``32 - s`` bits.

* ``key(seed, offset)`` mixes a 64-bit seed and a 32-bit stream offset into a
  32-bit key (a scalar; cheap).
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


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int32 ``x`` by ``s``."""
    return torch.bitwise_and(torch.bitwise_right_shift(x, s), (1 << (32 - s)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """One hash round on an int32 tensor (wrapping arithmetic)."""
    for op, c in MIX_STEPS:
        if op == "xorshr":
            x = torch.bitwise_xor(x, _shr(x, c))
        else:
            x = x * to_int32(c)
    return x


def key_int(seed: int, offset: int) -> int:
    """The 32-bit key (as an unsigned Python int) for a seed and offset."""
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    return mix_int(mix_int(lo ^ mix_int(hi ^ SEED_HI_SALT)) ^ (offset & MASK32))


def key_tensor(seed: torch.Tensor, offset: int) -> torch.Tensor:
    """The key as a 0-dim int32 tensor, for a 0-dim int64 ``seed`` tensor."""
    seed = seed.to(torch.int64)
    lo = torch.bitwise_and(seed, MASK32)
    hi = torch.bitwise_and(torch.bitwise_right_shift(seed, 32), MASK32)
    # Bring both halves into int32 range with the same low 32 bits.
    lo = (torch.bitwise_xor(lo, 1 << 31) - (1 << 31)).to(torch.int32)
    hi = (torch.bitwise_xor(hi, 1 << 31) - (1 << 31)).to(torch.int32)
    inner = mix(torch.bitwise_xor(lo, mix(torch.bitwise_xor(hi, to_int32(SEED_HI_SALT)))))
    # The offset as a tensor, its low 32 bits: an offset Dynamo made symbolic (an argument
    # of a compiled function) entered Inductor's C++ as a float ("float ^ float", no build).
    offset_t = torch.full((), offset, dtype=torch.int64, device=seed.device).to(torch.int32)
    return mix(torch.bitwise_xor(inner, offset_t))


def bits_from_index(index: torch.Tensor, key: torch.Tensor | int) -> torch.Tensor:
    """32 random bits (int32) for each int32 element index under ``key``."""
    if isinstance(key, int):
        key = to_int32(key)
    return mix(mix(torch.bitwise_xor(index, key)) + key)


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


def mix_ops(x, ops):
    """One hash round in Inductor's ops handler (``torch._inductor.virtualized.ops``).

    ``x`` is an int32 value of that handler; the round is built once per kernel
    body, each step's value reused (see ``lpcompile.numerics.quantize._lower_counter_bits``).
    """
    for op, c in MIX_STEPS:
        if op == "xorshr":
            shifted = ops.bitwise_right_shift(x, ops.constant(c, torch.int32))
            x = ops.bitwise_xor(x, ops.bitwise_and(shifted, ops.constant((1 << (32 - c)) - 1, torch.int32)))
        else:
            x = ops.mul(x, ops.constant(to_int32(c), torch.int32))
    return x
