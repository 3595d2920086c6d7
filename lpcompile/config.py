"""Configuration: frozen dataclasses, named recipes and ``options`` parsing.

The leaf every other part reads its vocabulary from: option names, recipes and the
enumerations (``ROUNDINGS``, ``OVERFLOWS``, ``SCALINGS``, ``PREDICTIONS``, ``STATS``, ``RULES`` are
defined beside the numerics that implement them and re-exported here).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from lpcompile.numerics.checks import is_real
from lpcompile.numerics.formats import FloatFormat, parse_format
from lpcompile.numerics.predict import PREDICTIONS
from lpcompile.numerics.quantize import OVERFLOWS, ROUNDINGS, SCALINGS, is_rowwise, is_tiled
from lpcompile.numerics.scale_grad import STATS  # noqa: F401  (re-exported)
from lpcompile.numerics.scale_rules import RULES, ScaleBounds


class Role(str, Enum):
    """What a quantized tensor is, in Mellempudi et al.'s terms."""

    WEIGHT = "weight"
    ACTIVATION = "activation"
    ERROR = "error"  # gradient w.r.t. a layer's output, entering its backward
    WEIGHT_GRAD = "weight_grad"


ROLES = tuple(role.value for role in Role)
# option -> (the role it rounds another way, the matmul of a layer's backward it rounds it for):
# torchao's per-GEMM cast configs (``cast_config_input_for_grad_weight``, ...)
PER_MATMUL = {
    "activation_for_weight_grad": ("activation", "weight_grad"),
    "error_for_weight_grad": ("error", "weight_grad"),
    "weight_for_input_grad": ("weight", "input_grad"),
}
# matmul -> the roles whose sites tell it apart (the weight gradient's also by the layer's weight)
MATMUL_ROLES = {"input_grad": ("error", "weight"), "weight_grad": ("error", "activation", "weight")}


def per_matmul_option(role: str, matmul: str) -> str:
    """The option that rounds ``role`` in a layer's ``matmul`` (:data:`PER_MATMUL`)."""
    return f"{role}_for_{matmul}"


EXECUTORS = ("inductor", "eager")
LOSS_SCALES = ("none", "adaptive")
CODEGENS = ("inductor", "triton")
MATMULS = ("auto", "fp32", "bf16")
WRAPPERS = ("auto", "cpp", "python")
CPP_OPT_LEVELS = ("O1", "O2", "O3")
CONVS = ("auto", "aten")
ATTENTIONS = ("operands", "full", "off")
SATURATIONS = ("off", "count", "raise")
# options key -> AdaptiveScaleConfig field
ADAPTIVE_KEYS = {
    "loss_scale_rule": "rule",
    "loss_scale_interval": "interval",
    "loss_scale_underflow": "underflow",
    "loss_scale_max": "max_scale",
    "loss_scale_max_cumulative": "max_cumulative",
    "loss_scale_init": "init",
}


@dataclass(frozen=True)
class AdaptiveScaleConfig:
    """Settings of adaptive loss scaling (``options`` keys ``loss_scale_*``).

    ``rule="fixed"`` never changes the scales (all ``init``): telemetry only,
    e.g. to measure a fixed loss scale's underflow per layer.
    """

    rule: str = "quantile"
    interval: int = 100
    underflow: float = 1e-3
    max_scale: float | None = None
    max_cumulative: float | None = None
    init: float = 1.0

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"loss_scale_rule must be one of {RULES}, got {self.rule!r}")
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"loss_scale_interval must be a positive int, got {self.interval!r}")
        if not (is_real(self.underflow) and 0 < self.underflow < 1):
            raise ValueError(f"loss_scale_underflow must be in (0, 1), got {self.underflow!r}")
        # Powers of two keep the scaling and unscaling exact, and the histogram's bins whole.
        limits = {"init": self.init, "max": self.max_scale, "max_cumulative": self.max_cumulative}
        for key, value in limits.items():
            if (value is not None or key == "init") and not _power_of_two_at_least_one(value):
                raise ValueError(f"loss_scale_{key} must be a power of two ≥ 1, got {value!r}")

    def bounds(self, fmt: FloatFormat) -> ScaleBounds:
        default = ScaleBounds.for_format(fmt)
        return ScaleBounds(self.max_scale or default.max_scale, self.max_cumulative or default.max_cumulative)


def _power_of_two_at_least_one(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value >= 1 and math.frexp(value)[0] == 0.5


@dataclass(frozen=True)
class QuantSpec:
    """How one role is quantized; ``fmt=None`` leaves it in higher precision.

    ``scaling="none"`` rounds the values as they are (Mellempudi et al.: loss scaling
    keeps the errors in range); ``"tensorwise"`` rounds each tensor times the factor that
    takes its largest magnitude to the format's largest value, and divides it back out
    (torchao float8's dynamic scaling, TransformerEngine's current scaling), so nothing
    overflows and ``overflow`` only decides what a non-finite input becomes;
    ``"rowwise"`` gives each row a factor of its own, a row being a line of an operand along
    the dimension its matmul sums over (every matmul, forward and backward, rounds its
    operands so; a convolution's and fused attention's per tensor); the ``_pow2`` scalings
    round the factors down to powers of two; ``"mx"`` gives each block of 32 values of a
    row a power-of-two factor (OCP microscaling's E8M0 scale), ``"mx_ceil"`` and
    ``"mx_rceil"`` the same rounded up (torchao's ``CEIL`` and cuBLAS's ``RCEIL`` scale
    calculations), ``"mx_even"`` from the block's largest magnitude rounded to the format's
    precision first (torchao's ``EVEN``), ``"nvfp4"`` each block of 16 an E4M3 factor under an FP32 one per
    tensor (NVIDIA's NVFP4), ``"nvfp4_2d"`` each tile of 16 x 16 values of the last two
    dimensions (NVIDIA's NVFP4 weights: one rounding for every matmul that reads it);
    ``"blockwise"`` a tensorwise factor per block of 128 values of a row, ``"blockwise_2d"``
    per tile of 128 x 128 values (DeepSeek-V3's activations and weights).
    """

    fmt: str | None = None
    rounding: str = "nearest"
    overflow: str = "saturate"
    scaling: str = "none"

    def __post_init__(self) -> None:
        if self.fmt is not None:
            object.__setattr__(self, "fmt", parse_format(self.fmt).name)
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.overflow not in OVERFLOWS:
            raise ValueError(f"overflow must be one of {OVERFLOWS}, got {self.overflow!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {self.scaling!r}")

    @property
    def enabled(self) -> bool:
        return self.fmt is not None


OFF = QuantSpec()


def _specs(fwd: QuantSpec, err: QuantSpec, wgrad: QuantSpec | None = None) -> dict[str, QuantSpec]:
    return {"weight": fwd, "activation": fwd, "error": err, "weight_grad": wgrad or err}


# Forward roles saturate (as torch's E4M3 cast and TransformerEngine do); backward
# roles overflow to inf so that loss scaling sees the overflow and skips the step.
_RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("no rewriting: the model as it is", _specs(OFF, OFF)),
    "fp8-e5m2": (
        "E5M2 everywhere, round to nearest even",
        _specs(QuantSpec("e5m2"), QuantSpec("e5m2", overflow="inf")),
    ),
    "fp8-e5m2-sr": (
        "Mellempudi et al. 2019: E5M2 everywhere, stochastic rounding on errors and weight gradients",
        _specs(QuantSpec("e5m2"), QuantSpec("e5m2", "stochastic", "inf")),
    ),
    "fp8-hybrid": (
        "E4M3 weights and activations, E5M2 errors and weight gradients (nearest even)",
        _specs(QuantSpec("e4m3"), QuantSpec("e5m2", overflow="inf")),
    ),
    "fp16": (
        "FP16 at every matmul/conv input and gradient",
        _specs(QuantSpec("fp16"), QuantSpec("fp16", overflow="inf")),
    ),
    "bf16": (
        "BF16 at every matmul/conv input and gradient",
        _specs(QuantSpec("bf16"), QuantSpec("bf16", overflow="inf")),
    ),
    "fp8-tensorwise": (
        "torchao float8's default: E4M3 weights and activations, E5M2 errors, each tensor"
        " scaled to its format's range (nearest even); weight gradients unrounded",
        _specs(
            QuantSpec("e4m3", scaling="tensorwise"),
            QuantSpec("e5m2", overflow="inf", scaling="tensorwise"),
            OFF,
        ),
    ),
    "fp8-rowwise": (
        "torchao float8's rowwise recipe: E4M3 weights, activations and errors, each row of a"
        " matmul operand scaled by a power of two (nearest even); weight gradients unrounded",
        _specs(
            QuantSpec("e4m3", scaling="rowwise_pow2"),
            QuantSpec("e4m3", overflow="inf", scaling="rowwise_pow2"),
            OFF,
        ),
    ),
    "mxfp8": (
        "OCP MXFP8 (torchao's MXFP8 training): E4M3 weights, activations and errors, each"
        " block of 32 values along a matmul's summed dimension scaled by a power of two"
        " (nearest even); weight gradients unrounded",
        _specs(QuantSpec("e4m3", scaling="mx"), QuantSpec("e4m3", overflow="inf", scaling="mx"), OFF),
    ),
    "mxfp8-rceil": (
        "mxfp8 with each block's scale rounded up as cuBLAS rounds it: 2^ceil(log2(amax / 448))"
        " (torchao's RCEIL, the default of its MXFP8 grouped-matmul training)",
        _specs(
            QuantSpec("e4m3", scaling="mx_rceil"),
            QuantSpec("e4m3", overflow="inf", scaling="mx_rceil"),
            OFF,
        ),
    ),
    "nvfp4": (
        "NVIDIA's NVFP4 training: E2M1 weights, activations and errors, each block of 16 values"
        " along a matmul's summed dimension scaled by an E4M3 factor under an FP32 one per tensor;"
        " errors stochastically rounded; weight gradients unrounded",
        _specs(
            QuantSpec("e2m1-finite", scaling="nvfp4"),
            QuantSpec("e2m1-finite", "stochastic", "inf", scaling="nvfp4"),
            OFF,
        ),
    ),
    "nvfp4-2d": (
        "nvfp4 with NVIDIA's weights: each tile of 16 x 16 weight values scaled by an E4M3 factor,"
        " one rounding that the forward's and the input gradient's matmuls both read",
        {
            **_specs(
                QuantSpec("e2m1-finite", scaling="nvfp4"),
                QuantSpec("e2m1-finite", "stochastic", "inf", scaling="nvfp4"),
                OFF,
            ),
            "weight": QuantSpec("e2m1-finite", scaling="nvfp4_2d"),
        },
    ),
    "fp8-rowwise-gw-hp": (
        "torchao float8's rowwise_with_gw_hp recipe: fp8-rowwise, but the weight scaled per tensor"
        " (a power of two) for the input gradient, and the weight gradient's operands unrounded",
        {
            **_specs(
                QuantSpec("e4m3", scaling="rowwise_pow2"),
                QuantSpec("e4m3", overflow="inf", scaling="rowwise_pow2"),
                OFF,
            ),
            # as in options: merged onto the role's final spec; None: unrounded
            "weight_for_input_grad": {"scaling": "tensorwise_pow2"},
            "activation_for_weight_grad": None,
            "error_for_weight_grad": None,
        },
    ),
    "fp8-blockwise": (
        "DeepSeek-V3's FP8 training (torchao's blockwise_fp8_training): E4M3 weights per tile of"
        " 128 x 128 values, activations and errors per block of 128 along a matmul's summed"
        " dimension, each scaled to E4M3's range (nearest even); weight gradients unrounded",
        {
            **_specs(
                QuantSpec("e4m3", scaling="blockwise"),
                QuantSpec("e4m3", overflow="inf", scaling="blockwise"),
                OFF,
            ),
            "weight": QuantSpec("e4m3", scaling="blockwise_2d"),
        },
    ),
}
_ALS = {"loss_scale": "adaptive"}
_RECIPES["fp8-e5m2-als"] = (
    "fp8-e5m2-sr with per-layer adaptive loss scaling (Zhao et al. 2019)",
    {**_RECIPES["fp8-e5m2-sr"][1], **_ALS},
)
_RECIPES["fp16-als"] = ("fp16 with per-layer adaptive loss scaling", {**_RECIPES["fp16"][1], **_ALS})


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline stages and weight prediction (``options={"pipeline": {...}}``).

    ``stages``: ``None`` (the model's ``pipe_split()`` markers), an int S
    (S stages balanced by a cost model) or ``"layer"`` (one stage per
    matmul/conv). ``prediction``: ``"none"``, ``"lwp_v"`` or ``"lwp_w"``:
    each parameter read at stage s goes through ``lowprec::predict_weight``
    with that stage's delay. See ``lpcompile.runtime.pipeline``.
    """

    stages: int | str | None = None
    prediction: str = "none"

    def __post_init__(self) -> None:
        stages = self.stages
        if not (stages is None or stages == "layer" or (type(stages) is int and stages >= 1)):
            raise ValueError(f"pipeline stages must be None, an int >= 1 or 'layer', got {stages!r}")
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"pipeline prediction must be one of {PREDICTIONS}, got {self.prediction!r}")

    @classmethod
    def from_option(cls, value: Any) -> PipelineConfig | None:
        """``None``/``False``: no pipeline; ``True``: the defaults; a dict: those fields."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            valid = sorted(f.name for f in dataclasses.fields(cls))
            unknown = sorted(set(value) - set(valid))
            if unknown:
                raise ValueError(f"unknown key(s) {unknown} for pipeline; valid keys: {valid}")
            return cls(**value)
        raise ValueError(f"pipeline: expected None, True, a dict or a PipelineConfig, got {value!r}")


@dataclass(frozen=True)
class LowPrecConfig:
    """Everything the lowprec backend does to a graph.

    ``exclude`` holds ``fnmatch`` patterns of layer names (module FQNs such as
    ``"features.0"``) whose matmul/conv stay in higher precision;
    ``keep_first_last`` does that for the first and last matmul/conv of each
    graph, as Mellempudi et al. do. ``loss_scale="adaptive"`` scales each
    layer's error by its own power of two (``adaptive`` holds the settings).
    ``matmul`` says how Inductor runs a matmul of two tensors quantized to a
    format bfloat16 holds exactly (E5M2, E4M3): ``"auto"`` on the CPU's
    bfloat16 dot products where it has them (``lowprec::mm_bf16``), ``"fp32"``
    as an FP32 GEMM, ``"bf16"`` like auto but an error where the kernel is missing.
    ``wrapper`` picks the code Inductor generates to call a graph's kernels:
    ``"auto"`` C++ for graphs on the CPU (fewer microseconds per kernel call) and
    Python elsewhere and for graphs of DTensors, ``"cpp"`` or ``"python"`` for every
    graph (these two need ``executor="inductor"`` and ``codegen="inductor"``; ``"cpp"``
    refuses graphs of DTensors). ``cpp_opt_level`` is the
    compiler's optimization level for the C++ Inductor builds for CPU graphs (kernels
    and wrapper; Inductor's own is ``"O3"``): ``"O2"`` and ``"O1"`` build faster and
    run slower. ``conv="auto"`` lets
    Inductor compiles for the CPU run small quantized 2-D convolutions (an im2col
    matrix of at most 2^18 elements) as that matrix, which Inductor writes, and a
    matmul (``lpcompile.passes.dynamo.conv``); ``"aten"`` keeps ATen's convolution
    everywhere. ``attention`` says what becomes of ``scaled_dot_product_attention``:
    ``"operands"`` rounds Q, K, V and the error entering it and keeps the fused kernel,
    ``"full"`` writes it as matmul → softmax (FP32) → matmul so the probabilities and
    their gradient are rounded too, ``"off"`` leaves it in higher precision.
    ``saturation="count"`` counts, per quantize site (weights and activations in the
    forward, errors and weight gradients in the backward), the inputs beyond the format's
    largest finite value (they saturate, or become inf with ``overflow="inf"``), the
    infinite or NaN ones, the non-zero ones, and the non-zero ones below its smallest
    positive value (``lpcompile.saturation(model)``); ``"raise"`` also raises
    ``FloatingPointError`` naming the layer at a call whose forward quantize inputs held
    inf or NaN; ``"off"`` adds nothing. ``seed_per_rank`` folds
    the process's ``torch.distributed`` rank into the stochastic-rounding seed, so that
    data-parallel ranks draw different bits (a graph of DTensors folds its device mesh's
    first rank, so that tensor-parallel replicas draw the same; ``PipelinedTrainer`` turns
    it off for its stages: its ranks hold different stages and draw the simulator's bits).
    ``wgrad_hadamard`` applies NVIDIA's random Hadamard transform to both operands of each
    layer's weight-gradient GEMM, along the tokens it sums over, in blocks of 16, before
    they are rounded (it needs activations and errors scaled per row or block): the
    transform cancels in the product, and spreads outliers over each block.
    ``weight_for_input_grad``, ``activation_for_weight_grad`` and ``error_for_weight_grad``
    round a role another way in one matmul of each layer's backward (torchao's per-GEMM
    cast configs): ``None`` (default) as the role, ``OFF`` unrounded (higher precision), or
    the role's spec with another scaling. The input-gradient matmul is the one of a layer's
    error and weight, the weight-gradient matmul the one of its error and activation.
    """

    recipe: str = "fp32"
    weight: QuantSpec = OFF
    activation: QuantSpec = OFF
    error: QuantSpec = OFF
    weight_grad: QuantSpec = OFF
    exclude: tuple[str, ...] = ()
    keep_first_last: bool = False
    seed: int = 0
    executor: str = "inductor"
    loss_scale: str = "none"
    adaptive: AdaptiveScaleConfig = AdaptiveScaleConfig()
    codegen: str = "inductor"
    pipeline: PipelineConfig | None = None
    matmul: str = "auto"
    wrapper: str = "auto"
    cpp_opt_level: str = "O3"
    conv: str = "auto"
    attention: str = "operands"
    saturation: str = "off"
    seed_per_rank: bool = True
    wgrad_hadamard: bool = False
    weight_for_input_grad: QuantSpec | None = None
    activation_for_weight_grad: QuantSpec | None = None
    error_for_weight_grad: QuantSpec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipeline", PipelineConfig.from_option(self.pipeline))
        if self.loss_scale not in LOSS_SCALES:
            raise ValueError(f"loss_scale must be one of {LOSS_SCALES}, got {self.loss_scale!r}")
        if self.loss_scale == "adaptive" and not self.error.enabled:
            raise ValueError("loss_scale='adaptive' scales quantized errors: the error role needs a format")
        if self.loss_scale == "adaptive" and self.error.scaling != "none":
            raise ValueError(
                f"loss_scale='adaptive' with error scaling={self.error.scaling!r}: the per-tensor scale"
                " divides each layer's loss scale back out of the error it rounds; use one or the other"
            )
        if self.codegen not in CODEGENS:
            raise ValueError(f"codegen must be one of {CODEGENS}, got {self.codegen!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, got {self.matmul!r}")
        if self.wrapper not in WRAPPERS:
            raise ValueError(f"wrapper must be one of {WRAPPERS}, got {self.wrapper!r}")
        if self.cpp_opt_level not in CPP_OPT_LEVELS:
            raise ValueError(f"cpp_opt_level must be one of {CPP_OPT_LEVELS}, got {self.cpp_opt_level!r}")
        if self.conv not in CONVS:
            raise ValueError(f"conv must be one of {CONVS}, got {self.conv!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.saturation not in SATURATIONS:
            raise ValueError(f"saturation must be one of {SATURATIONS}, got {self.saturation!r}")
        if self.saturation != "off" and self.pipeline is not None:
            raise ValueError(
                f"saturation={self.saturation!r} adds an output to the graph, which pipeline= splits into"
                " stages: count in the stages instead (PipelinedTrainer(compile={..., 'saturation': ...}))"
            )
        if self.wrapper != "auto" and (self.executor != "inductor" or self.codegen != "inductor"):
            raise ValueError(
                f"wrapper={self.wrapper!r} picks Inductor's wrapper code: it needs executor='inductor'"
                f" and codegen='inductor', got executor={self.executor!r}, codegen={self.codegen!r}"
            )
        if self.cpp_opt_level != "O3" and (self.executor != "inductor" or self.codegen != "inductor"):
            raise ValueError(
                f"cpp_opt_level={self.cpp_opt_level!r} is for the C++ Inductor builds: it needs"
                f" executor='inductor' and codegen='inductor', got executor={self.executor!r},"
                f" codegen={self.codegen!r}"
            )
        if self.matmul == "bf16" and (self.executor != "inductor" or self.codegen != "inductor"):
            raise ValueError(
                "matmul='bf16' is a kernel Inductor calls: it needs executor='inductor' and"
                f" codegen='inductor', got executor={self.executor!r}, codegen={self.codegen!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        if not isinstance(self.seed_per_rank, bool):
            raise ValueError(f"seed_per_rank must be a bool, got {self.seed_per_rank!r}")
        if not isinstance(self.wgrad_hadamard, bool):
            raise ValueError(f"wgrad_hadamard must be a bool, got {self.wgrad_hadamard!r}")
        if self.wgrad_hadamard and not self.weight.enabled:
            raise ValueError(
                "wgrad_hadamard=True transforms the operands of each layer's weight-gradient GEMM,"
                " which it finds by the layer's rounded weight: the weight role needs a format"
            )
        if self.wgrad_hadamard and not all(
            spec.enabled and is_rowwise(spec.scaling) for spec in (self.activation, self.error)
        ):
            raise ValueError(
                "wgrad_hadamard=True transforms the weight gradient GEMM's operands before each is"
                " rounded along the tokens it sums over: it needs activations and errors scaled per"
                f" row or block (fp8-rowwise, mxfp8, nvfp4, fp8-blockwise), got activation scaling="
                f"{self.activation.scaling!r}, error scaling={self.error.scaling!r}"
            )
        self._check_per_matmul()
        if not isinstance(self.keep_first_last, bool):
            raise ValueError(f"keep_first_last must be a bool, got {self.keep_first_last!r}")
        if not all(isinstance(p, str) for p in self.exclude):
            raise ValueError(f"exclude must be layer-name patterns (str), got {self.exclude!r}")
        for role in ROLES:
            if not isinstance(getattr(self, role), QuantSpec):
                raise ValueError(f"{role} must be a QuantSpec, got {getattr(self, role)!r}")

    def _check_per_matmul(self) -> None:
        """Refuse a per-matmul option the backend could not apply as it says."""
        for name, (role, matmul) in PER_MATMUL.items():
            spec, base = getattr(self, name), self.spec(role)
            if spec is None:
                continue
            if not isinstance(spec, QuantSpec):
                raise ValueError(f"{name} must be None or a QuantSpec, got {spec!r}")
            if off := [r for r in MATMUL_ROLES[matmul] if not self.spec(r).enabled]:
                raise ValueError(
                    f"{name} rounds the {role} another way in each layer's {matmul} matmul, which"
                    f" lowprec finds by its {', '.join(MATMUL_ROLES[matmul])} roundings: the"
                    f" {', '.join(off)} role(s) need a format"
                )
            if is_tiled(base.scaling) or (spec.enabled and is_tiled(spec.scaling)):
                tiled = spec.scaling if is_tiled(spec.scaling) else base.scaling
                raise ValueError(
                    f"{name}: the scaling {tiled!r} is one rounding that every matmul reads, not one matmul's"
                )
            if spec.enabled and _words(spec) != _words(base):
                raise ValueError(
                    f"{name} may change the {role}'s scaling only, or leave it unrounded (None in"
                    f" options): got {_words(spec)} for a {role} rounded {_words(base)}"
                )
            if self.loss_scale == "adaptive" and role == "error" and spec.enabled and spec.scaling != "none":
                raise ValueError(
                    f"loss_scale='adaptive' with {name} scaling={spec.scaling!r}: the per-tensor scale"
                    " divides each layer's loss scale back out of the error it rounds"
                )
        weight_grad = (self.activation_for_weight_grad, self.error_for_weight_grad)
        if self.wgrad_hadamard and weight_grad != (None, None):
            raise ValueError(
                "wgrad_hadamard=True transforms the weight gradient GEMM's operands before rounding"
                " them as activations and errors: it does not go with activation_for_weight_grad or"
                " error_for_weight_grad"
            )

    def spec(self, role: Role | str) -> QuantSpec:
        return getattr(self, Role(role).value)

    def in_matmul(self, role: str, matmul: str | None) -> QuantSpec | None:
        """How ``role`` is rounded in a layer's ``matmul`` (``"input_grad"``,
        ``"weight_grad"``) where an option rounds it another way there (:data:`PER_MATMUL`),
        else ``None``."""
        name = per_matmul_option(role, matmul) if matmul else None
        return getattr(self, name) if name in PER_MATMUL else None

    @property
    def per_matmul(self) -> tuple[str, ...]:
        """The options set that round some role another way in one matmul."""
        return tuple(name for name in PER_MATMUL if getattr(self, name) is not None)

    @property
    def quantizes(self) -> bool:
        return any(self.spec(role).enabled for role in ROLES)

    @classmethod
    def from_recipe(cls, name: str, **overrides: Any) -> LowPrecConfig:
        """The recipe ``name`` with ``overrides`` of its fields. The recipe's per-matmul
        roundings (option values) apply to its roles as overridden, where the roles that
        tell the matmul apart are all rounded, the role is not tiled, and (for the weight
        gradient's) ``wgrad_hadamard`` is off."""
        if not isinstance(name, str) or name not in _RECIPES:
            raise ValueError(f"unknown recipe {name!r}; valid recipes: {', '.join(_RECIPES)}")
        fields = dict(_RECIPES[name][1])
        per_matmul = {key: fields.pop(key) for key in PER_MATMUL if key in fields}
        fields.update(overrides)
        for key, value in per_matmul.items():
            (role, matmul), specs = PER_MATMUL[key], {r: fields.get(r, OFF) for r in ROLES}
            rounded = all(specs[r].enabled for r in MATMUL_ROLES[matmul])
            hadamard = matmul == "weight_grad" and fields.get("wgrad_hadamard", False)
            if key not in overrides and rounded and not is_tiled(specs[role].scaling) and not hadamard:
                fields[key] = _parse_spec(key, value, specs[role])
        return cls(recipe=name, **fields)

    @classmethod
    def from_options(cls, options: dict[str, Any] | None) -> LowPrecConfig:
        """Build a config from ``torch.compile(..., options=...)``."""
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(
                f"lowprec options must be a dict, got {type(options).__name__} {options!r}"
                " (a recipe goes in as options={'recipe': name})"
            )
        options = dict(options or {})
        valid = sorted(OPTION_KEYS)
        unknown = sorted(set(options) - OPTION_KEYS)
        if unknown:
            raise ValueError(f"unknown lowprec option(s) {unknown}; valid options: {valid}")
        recipe = options.pop("recipe", "fp32")
        base = cls.from_recipe(recipe)
        adaptive = {ADAPTIVE_KEYS[k]: options.pop(k) for k in list(options) if k in ADAPTIVE_KEYS}
        overrides: dict[str, Any] = {"adaptive": AdaptiveScaleConfig(**adaptive)} if adaptive else {}
        for key, value in options.items():
            if key in ROLES:
                overrides[key] = _parse_spec(key, value, base.spec(key))
            elif key in PER_MATMUL:  # (below: it derives from its role's final spec)
                continue
            elif key == "exclude":
                if not isinstance(value, (str, list, tuple)):
                    raise ValueError(f"exclude must be a pattern or a list of patterns, got {value!r}")
                overrides[key] = (value,) if isinstance(value, str) else tuple(value)
            else:
                overrides[key] = value
        for key in PER_MATMUL.keys() & options.keys():
            role = PER_MATMUL[key][0]
            overrides[key] = _parse_spec(key, options[key], overrides.get(role, base.spec(role)))
        config = cls.from_recipe(recipe, **overrides)
        if adaptive and config.loss_scale != "adaptive":
            keys = sorted(k for k in ADAPTIVE_KEYS if ADAPTIVE_KEYS[k] in adaptive)
            raise ValueError(
                f"{keys} apply to loss_scale='adaptive' only; the loss_scale here is {config.loss_scale!r}"
            )
        return config


OPTION_KEYS = {f.name for f in dataclasses.fields(LowPrecConfig)} - {"adaptive"} | set(ADAPTIVE_KEYS)


def _words(spec: QuantSpec) -> str:
    return f"{spec.fmt} {spec.rounding} {spec.overflow}"


def _parse_spec(role: str, value: Any, base: QuantSpec) -> QuantSpec:
    """A role's spec from an option value; a dict overrides fields of ``base``."""
    if isinstance(value, QuantSpec):
        return value
    if value is None or value is False:
        return OFF
    if isinstance(value, str):  # a format name: keep the recipe's rounding and overflow
        return dataclasses.replace(base, fmt=value) if base.enabled else QuantSpec(value)
    if isinstance(value, dict):
        valid = {f.name for f in dataclasses.fields(QuantSpec)}
        unknown = sorted(set(value) - valid)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} for {role}; valid keys: {sorted(valid)}")
        if "fmt" in value and value["fmt"] is None:  # {"fmt": None}: turned off
            return OFF
        spec = dataclasses.replace(base, **value)
        if not spec.enabled and value:
            raise ValueError(f"{role}: the recipe leaves it off, so the dict needs a 'fmt'")
        return spec
    raise ValueError(f"{role}: expected a format name, a dict, a QuantSpec or None, got {value!r}")


def recipes() -> dict[str, str]:
    """The named recipes with one-line descriptions."""
    return {name: description for name, (description, _) in _RECIPES.items()}
