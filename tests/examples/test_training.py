"""End-to-end: FP8 training on real data. The slow tests check the claims of Mellempudi et al.
2019 that ``benchmarks/papers/mellempudi.py`` supports at small scale (docs/papers.md), by the
seeds' spread, with the benchmark's settings and seeds (the same numbers as its page)."""

import statistics

import pytest

from benchmarks.papers.common import mean_std, standard_error, within_spread, worse_by
from benchmarks.papers.mellempudi import (
    DIGITS_EPOCHS,
    LM_EVAL_EVERY,
    LM_FLOORS,
    LM_STEPS,
    VARIANTS,
    run_digits,
    run_lm,
    scaler_options,
)
from examples.data import load_digits, load_stdlib_source
from examples.train import train_digits


def _report(results: dict[str, list[float]], a: str, b: str) -> str:
    rows = [f"{name:<22} {mean_std(values, 4)}  {values}" for name, values in results.items()]
    gap = statistics.fmean(results[a]) - statistics.fmean(results[b])
    return "\n".join(
        [*rows, f"{a} - {b}: {gap:+.4f}, standard error {standard_error(results[a], results[b]):.4f}"]
    )


@pytest.mark.slow
def test_fp8_full_recipe_on_digits_is_within_two_standard_errors_of_fp32():
    """FP8 compute with SR on errors and weight gradients, FP16 master weights with SR and
    enhanced loss scaling: the digits CNN's test accuracy within the spread of five seeds."""
    data = load_digits()
    accuracy = {
        name: [run_digits(name, VARIANTS[name], seed, DIGITS_EPOCHS, data)["metric"] for seed in range(5)]
        for name in ("FP32", "full recipe")
    }
    floor = 100 / len(data.test_y) / 2  # half a test image: seeds can agree to the image
    assert within_spread(accuracy["full recipe"], accuracy["FP32"], k=2.0, floor=floor), _report(
        accuracy, "full recipe", "FP32"
    )


@pytest.fixture(scope="module")
def bits_per_char() -> dict[str, list[float]]:
    """The byte-level LM's validation bits per character, three seeds per variant (a run is long)."""
    text = load_stdlib_source()
    return {
        name: [
            run_lm(name, VARIANTS[name], seed, LM_STEPS, LM_EVAL_EVERY, text)["metric"] for seed in range(3)
        ]
        for name in ("full recipe", "FP16 master RNE", "full, no loss scaling")
    }


@pytest.mark.slow
def test_fp16_master_weights_rounded_to_nearest_stagnate_behind_stochastic_rounding_on_the_lm(bits_per_char):
    """Adam's updates below half an FP16 ulp of the larger weights (embeddings, LayerNorm gains)
    are lost to round-to-nearest: worse than the full recipe by more than two standard errors."""
    bpc = bits_per_char
    worse = worse_by(bpc["FP16 master RNE"], bpc["full recipe"], k=2.0, higher_is_better=False)
    assert worse, _report(bpc, "FP16 master RNE", "full recipe")


@pytest.mark.slow
def test_fp8_without_loss_scaling_is_worse_than_the_full_recipe_on_the_lm(bits_per_char):
    """Without loss scaling small errors underflow E5M2: worse by more than two standard errors."""
    bpc = bits_per_char
    worse = worse_by(bpc["full, no loss scaling"], bpc["full recipe"], k=2.0, higher_is_better=False)
    assert worse, _report(bpc, "full, no loss scaling", "full recipe")


def test_the_binding_floor_variant_raises_every_floor_one_binade_and_only_scaled_variants_get_one():
    full = scaler_options(300, LM_FLOORS, VARIANTS["full recipe"])
    binding = scaler_options(300, LM_FLOORS, VARIANTS["full, binding floor"])
    assert full["min_scale"] == LM_FLOORS[0] and binding["min_scale"] == 2 * LM_FLOORS[0]
    assert full["min_scale_schedule"] == {100: LM_FLOORS[1], 200: LM_FLOORS[2]}
    assert binding["min_scale_schedule"] == {step: 2 * f for step, f in full["min_scale_schedule"].items()}
    assert scaler_options(300, LM_FLOORS, VARIANTS["FP32"]) is None
    assert scaler_options(300, LM_FLOORS, VARIANTS["full, no loss scaling"]) is None


@pytest.mark.parametrize("kwargs", [{"epochs": 0}, {"batch_size": 0}, {"batch_size": 10**6}])
def test_a_run_without_steps_is_refused(kwargs):
    """Zero steps used to end in an IndexError after the (empty) loop."""
    with pytest.raises(ValueError, match="epochs ≥ 1 and 1 ≤ batch_size"):
        train_digits("none", None, compiled=False, **kwargs)


def test_demo_refuses_zero_epochs(capsys):
    from examples.demo import main

    with pytest.raises(SystemExit):
        main(["--epochs", "0"])
    assert "must be ≥ 1" in capsys.readouterr().err
