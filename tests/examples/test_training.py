"""End-to-end: FP8 training on real data (scikit-learn's digits)."""

import pytest

from examples.data import load_digits
from examples.train import train_digits


@pytest.mark.slow
def test_fp8_e5m2_sr_with_enhanced_scaling_matches_fp32_accuracy():
    data = load_digits()
    epochs = 8
    fp32 = train_digits("fp32", None, compiled=False, epochs=epochs, data=data)
    fp8 = train_digits(
        "fp8-e5m2-sr",
        {"recipe": "fp8-e5m2-sr", "executor": "eager"},
        epochs=epochs,
        loss_scale="enhanced",
        data=data,
    )
    table = "\n".join(
        f"{r.name:<12} acc {r.test_accuracy:6.2f}%  final loss {r.final_loss:.4f}  skipped {r.skipped_steps}"
        for r in (fp32, fp8)
    )
    assert fp32.test_accuracy > 90.0, f"FP32 baseline failed to train:\n{table}"
    assert fp8.test_accuracy >= fp32.test_accuracy - 1.0, f"FP8 lags FP32 by more than 1 point:\n{table}"


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
