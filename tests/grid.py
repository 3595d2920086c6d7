"""An independent check of what ran in FP8: every matmul-class ATen call's float operands,
read by a ``TorchDispatchMode`` inside the compiled graphs and around ``backward()``,
compared with torch's own E5M2 cast (not with lowprec's records)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.utils._python_dispatch import TorchDispatchMode

from examples.zoo import output_tensor
from lpcompile.backend import lowprec
from lpcompile.backend.distributed import LOWPREC_BACKEND

aten = torch.ops.aten
# Stochastic rounding on every role: bits that show which random stream a rounding used
SR_EVERYWHERE = {
    "recipe": "fp8-e5m2-sr",
    "executor": "eager",
    "weight": {"rounding": "stochastic"},
    "activation": {"rounding": "stochastic"},
}
# ATen product -> the positions of its multiplied operands (SDPA: q, k, v; its backward
# also the error entering it)
PRODUCTS = {
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.addmm.default: (1, 2),
    aten.baddbmm.default: (1, 2),
    aten.addbmm.default: (1, 2),
    aten._sparse_addmm.default: (1, 2),  # torch.sparse.mm and addmm, also on dense tensors
    aten.dot.default: (0, 1),
    aten.mv.default: (0, 1),
    aten.addmv.default: (1, 2),
    aten.addr.default: (1, 2),
    aten._trilinear.default: (0, 1, 2),  # F.bilinear's: input, weight, input
    aten.convolution.default: (0, 1),
    aten.convolution_backward.default: (0, 1, 2),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 1, 2),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (0, 1, 2, 3),
    aten._grouped_mm.default: (0, 1),
}
# Products inside higher-order operators: FlexAttention's (q, k, v; its backward also the error)
HOP_PRODUCTS = {
    torch.ops.higher_order.flex_attention: (0, 1, 2),
    torch.ops.higher_order.flex_attention_backward: (0, 1, 2, 5),
}
# Words in the names of other ops that may be products (a gap in the tables above)
PRODUCT_WORDS = ("mm", "attention", "conv", "einsum", "bilinear")
# Products of other libraries' operators, by name: transformers' grouped matmul of
# mixture-of-experts layers (input, weight, offsets) and its backward (..., the error).
LIBRARY_PRODUCTS = {
    "transformers::grouped_mm_fallback": (0, 1),
    "transformers::grouped_mm_fallback_backward": (0, 1, 3),
}


def on_e5m2_grid(t: torch.Tensor) -> bool:
    """Every value (of a complex ``t``: every real and imaginary part) survives torch's round
    trip through float8_e5m2 (NaN aside)."""
    t = torch.view_as_real(t.detach().resolve_conj()) if t.is_complex() else t.detach()
    back = t.to(torch.float8_e5m2).to(t.dtype)
    return bool(((back == t) | torch.isnan(t)).all())


# The largest finite values of E4M3 and E5M2
FP8_LARGEST = (448.0, 57344.0)
# The smallest largest magnitude a factor is computed from (torchao's, and lowprec's)
AMAX_FLOOR = 1e-12


def _on_scaled_lines(lines: torch.Tensor) -> torch.Tensor:
    """Whether each line (of the last dimension of FP32 ``lines``), times the factor that takes
    its largest magnitude (at least :data:`AMAX_FLOOR`) to E4M3's or to E5M2's largest value,
    has at most E4M3's 4 significant bits (to within that factor's FP32 rounding)."""
    amax = lines.abs().amax(-1, keepdim=True)
    on_grid = torch.zeros(lines.shape[:-1], dtype=torch.bool)
    for largest in FP8_LARGEST:
        mantissa = torch.frexp(lines * (largest / amax.clamp(min=AMAX_FLOOR))).mantissa.abs() * 16  # [8, 16)
        on_grid |= ((mantissa - mantissa.round()).abs() <= 2.0**-16).all(-1)
    return on_grid


def tensorwise_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` scaled to ``dtype``'s range, cast with torch, scaled back in FP32 (torchao's formula)."""
    largest = torch.finfo(dtype).max
    scale = (largest / t.abs().max().double().clamp(min=AMAX_FLOOR)).float()
    return (t.float() * scale).clamp(-largest, largest).to(dtype).float() / scale


def on_scaled_fp8_grid(t: torch.Tensor) -> bool:
    """Every value is on the scaled grid of :func:`_on_scaled_lines`, with the factor of the
    tensor's largest magnitude: what a tensor rounded with tensorwise scaling and divided back
    holds."""
    return bool(_on_scaled_lines(t.detach().float().reshape(-1)))


# Matmuls: op -> {position of an operand: the dimension the matmul sums it over}
SUMMED = {
    **{op: {0: -1, 1: -2} for op in (aten.mm.default, aten.bmm.default, aten._grouped_mm.default)},
    **{op: {1: -1, 2: -2} for op in (aten.addmm.default, aten.baddbmm.default)},
    aten.mv.default: {0: -1, 1: -1},
    aten.dot.default: {0: -1, 1: -1},
}


def on_scaled_fp8_rows(func: Any, position: int, t: torch.Tensor) -> bool:
    """A matmul's operand: every line along the dimension the matmul sums over is on the
    scaled grid of :func:`on_scaled_fp8_grid` (each with its own factor), what rowwise
    scaling gives; any other product's operand as a whole."""
    dim = SUMMED.get(func, {}).get(position)
    if dim is None or t.dim() == 0:
        return on_scaled_fp8_grid(t)
    return bool(_on_scaled_lines(t.detach().float().movedim(dim, -1).reshape(-1, t.shape[dim])).all())


def on_blockwise(model: torch.nn.Module) -> Callable[[Any, int, torch.Tensor], bool]:
    """A check of a matmul's operand, for ``model`` under DeepSeek-V3's blockwise FP8: each
    block of 128 values along the dimension the matmul sums over (the last one padded with
    zeros) is on the scaled grid of :func:`_on_scaled_lines` with its own factor, or, for an
    operand shaped as one of the model's matrices (or its transpose), each tile of 128 x 128
    values of its last two dimensions; any other product's operand as a whole."""
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    weights |= {shape[::-1] for shape in weights}

    def check(func: Any, position: int, t: torch.Tensor) -> bool:
        dim = SUMMED.get(func, {}).get(position)
        t = t.detach().float()
        if dim is None or t.dim() == 0:
            return on_scaled_fp8_grid(t)
        rows = t.movedim(dim, -1)
        blocks = torch.nn.functional.pad(rows, (0, -rows.shape[-1] % 128)).unflatten(-1, (-1, 128))
        if _on_scaled_lines(blocks).all():
            return True
        if tuple(t.shape) not in weights:
            return False
        tiles = torch.nn.functional.pad(t, (0, -t.shape[-1] % 128, 0, -t.shape[-2] % 128))
        tiles = tiles.unflatten(-1, (-1, 128)).unflatten(-3, (-1, 128)).movedim(-3, -2).flatten(-2)
        return bool(_on_scaled_lines(tiles).all())

    return check


def on_mx_blocks(func: Any, position: int, t: torch.Tensor) -> bool:
    """A matmul's operand: each block of 32 values along the dimension the matmul sums over
    (the last one padded with zeros), divided by its MX scale (2^(floor(log2 of the block's
    largest magnitude) - 8), at least 2^-126), is on the E4M3 grid; any other product's
    operand, E4M3 values times one power of two (an MX recipe rounds those per tensor)."""
    dim = SUMMED.get(func, {}).get(position)
    t = t.detach().float()
    if dim is None or t.dim() == 0:
        mantissa = torch.frexp(t).mantissa.abs() * 16
        return bool((mantissa == mantissa.round()).all())
    rows = t.movedim(dim, -1)
    rows = torch.nn.functional.pad(rows, (0, -rows.shape[-1] % 32)).unflatten(-1, (-1, 32))
    amax = rows.abs().amax(-1, keepdim=True)
    scale = torch.exp2((torch.frexp(amax).exponent - 9).float()).clamp(min=2.0**-126)
    scaled = rows / scale
    return bool((scaled.to(torch.float8_e4m3fn).float() == scaled).all())


E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def on_e2m1_values(scaled: torch.Tensor) -> torch.Tensor:
    """Whether each value's magnitude is an E2M1 value, to within FP32 rounding."""
    gap = (scaled.abs().unsqueeze(-1) - E2M1_VALUES).abs().amin(-1)
    return gap <= 2.0**-20 * scaled.abs().clamp(min=1.0)


def torchao_nvfp4(t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` rounded by torchao's ``nvfp4_quantize`` in blocks of 16 along ``dim`` (a last
    block shorter than 16 padded with zeros), its E4M3 block scales times its per-tensor
    scale multiplied back; and each value's factor (one over that product)."""

    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    rows = t.float().movedim(dim, -1)
    length = rows.shape[-1]
    flat = torch.nn.functional.pad(rows, (0, -length % 16)).reshape(-1, length + -length % 16)
    per_tensor = nvfp4.per_tensor_amax_to_scale(flat.abs().amax())
    scales, packed = nvfp4.nvfp4_quantize(flat.contiguous(), 16, per_tensor)
    codes = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(packed)).reshape(flat.shape)
    block = (scales.float() * per_tensor).repeat_interleave(16, -1)

    def back(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(*rows.shape[:-1], -1)[..., :length].movedim(-1, dim)

    return back(codes * block), back(1 / block)


def torchao_nvfp4_tiles(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-dim, each dimension a multiple of 16) rounded as NVIDIA's NVFP4 weights: an
    E4M3 scale per tile of 16 x 16 values (the tile's largest magnitude over 6, over
    torchao's per-tensor scale), the tile divided by it times the per-tensor scale, cast by
    torchao's FP32 -> FP4 conversion, multiplied back."""
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    per_tensor = nvfp4.per_tensor_amax_to_scale(t.abs().amax())
    tiles = t.float().unflatten(-1, (-1, 16)).unflatten(0, (-1, 16))  # [rows / 16, 16, cols / 16, 16]
    amax = tiles.abs().amax((1, 3), keepdim=True)
    tiny, largest = torch.finfo(torch.float8_e4m3fn).tiny, torch.finfo(torch.float8_e4m3fn).max
    scale = (amax / 6.0 / per_tensor).clamp(tiny, largest).to(torch.float8_e4m3fn).float() * per_tensor
    codes = kernels.f4_unpacked_to_f32(kernels.f32_to_f4_unpacked((tiles / scale).clamp(-6.0, 6.0)))
    return (codes * scale).flatten(2).flatten(0, 1)


def torchao_blockwise(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``t`` rounded by torchao's ``blockwise_fp8_training`` cast of activations (DeepSeek-V3's)
    in blocks of 128 along ``dim`` (a last block shorter than 128 padded with zeros): E4M3
    codes times the reciprocal scale it returns."""
    kernels = pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")
    rows = t.float().movedim(dim, -1)
    length = rows.shape[-1]
    flat = torch.nn.functional.pad(rows, (0, -length % 128)).reshape(-1, length + -length % 128)
    codes, inverse = kernels.torch_blockwise_scale_act_quant_lhs(flat.contiguous(), 128)
    values = codes.float() * inverse.repeat_interleave(128, -1)
    return values.reshape(*rows.shape[:-1], -1)[..., :length].movedim(-1, dim)


def torchao_blockwise_tiles(w: torch.Tensor) -> torch.Tensor:
    """``w`` (2-dim) rounded by torchao's ``blockwise_fp8_training`` cast of weights (the last
    tiles padded with zeros): an FP32 scale per tile of 128 x 128 values, E4M3 codes times its
    reciprocal."""
    kernels = pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -cols % 128, 0, -rows % 128))
    codes, inverse = kernels.torch_blockwise_scale_weight_quant(padded.contiguous(), 128)
    values = codes.float() * inverse.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return values[:rows, :cols]


def on_nvfp4_blocks(func: Any, position: int, t: torch.Tensor) -> bool:
    """A matmul's operand: in each block of 16 values along the dimension the matmul sums
    over (the last one padded with zeros), every value times 6 (or 4, where stochastic
    rounding took the block's largest down) over the block's largest magnitude is an E2M1
    value: E2M1 codes times one factor per block, what NVFP4 holds; any other product's
    operand, E2M1 values times one factor (NVFP4 recipes round those per tensor)."""
    dim = SUMMED.get(func, {}).get(position)
    t = t.detach().float()
    if dim is None or t.dim() == 0:
        blocks = t.reshape(1, -1)
    else:
        rows = t.movedim(dim, -1)
        blocks = torch.nn.functional.pad(rows, (0, -rows.shape[-1] % 16)).reshape(-1, 16)
    amax = blocks.abs().amax(-1, keepdim=True)
    blocks, amax = blocks[amax[:, 0] > 0], amax[amax[:, 0] > 0]
    return bool((on_e2m1_values(blocks * (6 / amax)) | on_e2m1_values(blocks * (4 / amax))).all(-1).all())


class GridCheck(TorchDispatchMode):
    """Counts the products that ran, by (op, all operands on the grid): the E5M2 grid, or
    another check of a tensor (``on_grid``), or of each operand of an op
    (``on_operand(op, position, tensor)``)."""

    # the RNG-state operators of checkpointed dropout come through too: they run as they are
    supports_higher_order_operators = True

    def __init__(
        self,
        on_grid: Callable[[torch.Tensor], bool] = on_e5m2_grid,
        on_operand: Callable[[Any, int, torch.Tensor], bool] | None = None,
    ) -> None:
        super().__init__()
        self.on_operand = on_operand or (lambda func, position, t: on_grid(t))
        self.products: Counter = Counter()
        self.unknown: Counter = Counter()  # other ops whose name says product: a gap in PRODUCTS

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # an op an activation checkpoint replays with the forward's random state (the CPU's
        # fused attention): AOT autograd wraps it, with its arguments, in one of these
        if func is run_and_save_rng_state:
            self.record(args[0], args[1:])
        elif func is run_with_rng_state:
            self.record(args[1], args[2:])
        else:
            self.record(func, args)
        return func(*args, **(kwargs or {}))

    def record(self, func: Any, args: tuple) -> None:
        """Count a call of ``func`` with ``args`` if it is a product (or looks like one)."""
        hop = isinstance(func, torch._ops.HigherOrderOperator)
        positions = HOP_PRODUCTS.get(func) if hop else PRODUCTS.get(func, LIBRARY_PRODUCTS.get(func.name()))
        if positions is not None:
            operands = [(i, args[i]) for i in positions if i < len(args)]
            floats = [
                (i, a)
                for i, a in operands
                if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())
            ]
            on_grid = all(self.on_operand(func, i, a) for i, a in floats)
            self.products[(func.__name__, on_grid)] += 1
        elif not hop and any(word in func.__name__.replace("convert", "") for word in PRODUCT_WORDS):
            self.unknown[func.__name__] += 1

    @property
    def off_grid(self) -> dict[str, int]:
        return {name: n for (name, ok), n in self.products.items() if not ok}

    @property
    def count(self) -> int:
        return sum(self.products.values())


class Calls(TorchDispatchMode):
    """Every call of one of ``ops`` that ran, in order: (op, its arguments, its output), the
    tensors among them cloned."""

    def __init__(self, *ops: Any) -> None:
        super().__init__()
        self.ops = ops
        self.calls: list[tuple[Any, tuple, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:

            def clone(value: Any) -> Any:
                return value.detach().clone() if isinstance(value, torch.Tensor) else value

            self.calls.append((func, tuple(map(clone, args)), torch.utils._pytree.tree_map(clone, out)))
        return out


def backward_compiler(compiler: str | None, options: dict[str, Any]) -> Any:
    """A context around ``backward()``: compiled autograd compiling the backward with
    lowprec (``options``), with torchtitan's Inductor context (``"inductor"``), or, for
    None, none (autograd)."""
    if compiler == "lowprec":
        return torch._dynamo.compiled_autograd._enable(torch.compile(backend="lowprec", options=options))
    return torch._dynamo.utils.maybe_enable_compiled_autograd(compiler == "inductor")


def watched_backend(options: dict[str, Any], check: TorchDispatchMode) -> Callable:
    """The lowprec backend (``options``) with the mode ``check`` watching every call of its
    graphs (Dynamo runs no compiled code under a mode entered outside)."""

    def backend(gm, example_inputs):
        compiled = lowprec(gm, example_inputs, options)

        def run(*args):
            with check:
                return compiled(*args)

        return run

    setattr(backend, LOWPREC_BACKEND, True)  # lowprec's rule for frames Dynamo would skip applies
    return backend


def grid_step(
    model: torch.nn.Module, inputs: dict[str, Any], options: dict[str, Any], check: GridCheck | None = None
) -> GridCheck:
    """One compiled forward and backward of ``model`` under ``options``, watched (by a new
    E5M2 check unless given one)."""
    check = check or GridCheck()
    torch._dynamo.reset()
    out = torch.compile(model, backend=watched_backend(options, check))(**inputs)
    out = output_tensor(out)
    loss = out.float().square().mean()
    with check:
        loss.backward()
    return check
