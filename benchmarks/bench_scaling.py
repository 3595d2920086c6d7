"""Per-tensor, per-row and block scaling against unscaled FP8 and torchao's float8 training.

A byte-level TinyGPT (2 blocks, width 64, 4 heads, context 64) on the standard library's
sources, its weights drawn as GPT-2 draws them (normal, std 0.02; biases zero): many of
them lie below E4M3's smallest normal value (2^-6), where unscaled E4M3 keeps one to three
significant bits. Adam, 300 steps of 32 windows; validation bits per character on 4 fixed
batches of files never trained on (lower is better). Rows: FP32; ``fp8-hybrid`` (E4M3
forward, E5M2 backward, unscaled, under dynamic loss scaling); ``fp8-tensorwise`` (the
same formats, each tensor scaled to its format's range, weight gradients unrounded), with
its scales rounded down to powers of two, and with attention's operands left unrounded
(the products torchao's float8 training converts: its ``nn.Linear`` layers); ``fp8-rowwise``
(E4M3 everywhere, a power-of-two factor per row of each matmul operand), and with its
errors scaled per tensor instead; ``fp8-rowwise-gw-hp`` (the weight per tensor for the
input gradient, the weight gradient's operands unrounded); ``mxfp8`` (the same, a factor
per block of 32), and with torchao's ``EVEN`` scales (``scaling="mx_even"``);
``fp8-blockwise`` (DeepSeek-V3's: E4M3, FP32 factors per block of 128 and per weight tile of
128 x 128: the 64-wide operands in one block or tile, the 192- and 256-wide ones in two);
``nvfp4`` (E2M1 everywhere, an E4M3 factor per block of 16 under an FP32 one per tensor, errors
rounded stochastically), and with its errors rounded to nearest; torchao's
``convert_to_float8_training`` in its CPU emulation (its tensorwise, rowwise and
rowwise_with_gw_hp recipes).
lowprec compiles with Inductor; torchao runs eagerly. Per row: bits per character
over seeds, its difference from FP32's run of the same seed, and the share of the linear
layers' weights below E4M3's smallest normal value at the end. Runs use torch's
deterministic algorithms (Inductor's embedding backward otherwise adds rows in an order
that follows thread timing), so each run repeats its bits.

``python -m benchmarks.bench_scaling`` writes ``results/scaling.md``; ``--quick`` runs one
seed of 60 steps and prints the page.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import write_results
from benchmarks.papers.common import mean_std
from benchmarks.papers.mellempudi import BATCH, CONTEXT, DEPTH, HEADS, LM_LR, WIDTH, bits_per_char, windows
from examples.data import load_stdlib_source
from examples.models import TinyGPT
from examples.train import Updater

STEPS = 300


def gpt2_init(model: nn.Module) -> nn.Module:
    """GPT-2's initialisation: weights of linear and embedding layers normal with std 0.02,
    biases zero."""
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    return model


def lowprec(options: dict[str, Any]) -> Callable[[nn.Module], nn.Module]:
    return lambda model: torch.compile(model, backend="lowprec", options=options)


def torchao_float8(recipe: str) -> Callable[[nn.Module], nn.Module]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    return lambda model: convert_to_float8_training(model, config=config)


POW2 = {"scaling": "tensorwise_pow2"}
EVEN = {"scaling": "mx_even"}
# row -> (how the model is prepared, loss scaling)
ROWS: dict[str, tuple[Callable[[nn.Module], nn.Module], str]] = {
    "FP32": (lambda model: model, "none"),
    "fp8-hybrid (unscaled), dynamic loss scaling": (lowprec({"recipe": "fp8-hybrid"}), "dynamic"),
    "fp8-tensorwise": (lowprec({"recipe": "fp8-tensorwise"}), "none"),
    "fp8-tensorwise, power-of-two scales": (
        lowprec({"recipe": "fp8-tensorwise", "weight": POW2, "activation": POW2, "error": POW2}),
        "none",
    ),
    "fp8-tensorwise, attention unrounded": (
        lowprec({"recipe": "fp8-tensorwise", "attention": "off"}),
        "none",
    ),
    "torchao float8 (tensorwise, emulated)": (torchao_float8("tensorwise"), "none"),
    "fp8-rowwise": (lowprec({"recipe": "fp8-rowwise"}), "none"),
    "fp8-rowwise, errors scaled per tensor": (
        lowprec({"recipe": "fp8-rowwise", "error": POW2}),
        "none",
    ),
    "torchao float8 (rowwise, emulated)": (torchao_float8("rowwise"), "none"),
    "fp8-rowwise-gw-hp": (lowprec({"recipe": "fp8-rowwise-gw-hp"}), "none"),
    "torchao float8 (rowwise_with_gw_hp, emulated)": (torchao_float8("rowwise_with_gw_hp"), "none"),
    "mxfp8": (lowprec({"recipe": "mxfp8"}), "none"),
    "mxfp8, EVEN scales": (
        lowprec({"recipe": "mxfp8", "weight": EVEN, "activation": EVEN, "error": EVEN}),
        "none",
    ),
    "fp8-blockwise": (lowprec({"recipe": "fp8-blockwise"}), "none"),
    "nvfp4": (lowprec({"recipe": "nvfp4"}), "none"),
    "nvfp4, errors rounded to nearest": (
        lowprec({"recipe": "nvfp4", "error": {"rounding": "nearest"}}),
        "none",
    ),
}


E4M3_SMALLEST_NORMAL = 2.0**-6


def below_normal(model: nn.Module) -> float:
    """The share of the linear layers' weights below E4M3's smallest normal value, where
    unscaled E4M3 keeps three significant bits or fewer (below 2^-10: none)."""
    weights = [m.weight.detach().abs().flatten() for m in model.modules() if isinstance(m, nn.Linear)]
    return float((torch.cat(weights) < E4M3_SMALLEST_NORMAL).float().mean())


def run(
    prepare: Callable[[nn.Module], nn.Module], loss_scale: str, seed: int, steps: int, text
) -> tuple[float, float]:
    """Validation bits per character after ``steps``, and the weights' share :func:`below_normal`."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = gpt2_init(TinyGPT(width=WIDTH, depth=DEPTH, heads=HEADS, context=CONTEXT))
    step = prepare(model)
    updater = Updater(model, optimizer="adam", lr=LM_LR, loss_scale=loss_scale, seed=seed)
    batches = torch.Generator().manual_seed(seed)
    validation = [windows(text.validation, BATCH, torch.Generator().manual_seed(1000 + i)) for i in range(4)]
    for _ in range(steps):
        x, y = windows(text.train, BATCH, batches)
        updater.step(F.cross_entropy(step(x).flatten(0, 1), y.flatten()))
    return bits_per_char(step, validation), below_normal(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one seed of 60 steps; print the page")
    args = parser.parse_args()
    seeds, steps = (1, 60) if args.quick else (args.seeds, STEPS)
    torch.use_deterministic_algorithms(True)
    text = load_stdlib_source()
    lines = [
        "| variant | validation bits/char | − FP32's, same seed | linear weights below 2^-6 | s/run |",
        "| --- | --- | --- | --- | --- |",
    ]
    start = time.perf_counter()
    reference: list[float] = []
    for row, (prepare, loss_scale) in ROWS.items():
        found, below, begun = [], [], time.perf_counter()
        for seed in range(seeds):
            bits, share = run(prepare, loss_scale, seed, steps, text)
            found.append(bits)
            below.append(100 * share)
            print(f"{row:48s} seed {seed}: {bits:.4f} bits/char", flush=True)
        reference = reference or found  # the first row is FP32
        delta = [a - b for a, b in zip(found, reference, strict=True)]
        seconds = (time.perf_counter() - begun) / seeds
        lines.append(
            f"| {row} | {mean_std(found, digits=3)} | {mean_std(delta, digits=4)} "
            f"| {mean_std(below)}% | {seconds:.0f} |"
        )
    flag = " --quick" if args.quick else ""
    body = "\n".join(
        [
            f"Command: `python -m benchmarks.bench_scaling{flag}` ({seeds} seeds of {steps} steps, "
            f"mean ± std; {time.perf_counter() - start:.0f} s in all)",
            "",
            " ".join(__doc__.split("\n\n")[1].split()),
            "",
            *lines,
        ]
    )
    if args.quick:
        print(body)
        return
    title = "Per-tensor, per-row, MX, DeepSeek-block and NVFP4 scaling beside unscaled FP8 and torchao"
    path = write_results("scaling", title, body)
    print(body, f"\nwrote {path}", sep="\n")


if __name__ == "__main__":
    main()
