"""Tests of training telemetry and ``lowprec report`` (plots and page)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from examples.data import Split, load_digits
from examples.train import train_digits
from lpcompile.tools import dump
from lpcompile.tools.cli import main
from lpcompile.tools.report import TELEMETRY_FORMAT, RunTelemetry, load_runs, write_report


@pytest.fixture(scope="module")
def small_digits() -> Split:
    full = load_digits()
    return Split(full.train_x[:128], full.train_y[:128], full.test_x[:32], full.test_y[:32])


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, small_digits) -> Path:
    """A dump folder holding the telemetry of one short uncompiled training run."""
    root = tmp_path_factory.mktemp("run") / "dump"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(dump.ENV, str(root))
        train_digits("fp32 eager", compiled=False, epochs=1, data=small_digits, loss_scale="dynamic")
    return root


@pytest.fixture
def recorded(recorded_run, tmp_path) -> Path:
    """A copy of the recorded run's folder, for a test to add to."""
    return Path(shutil.copytree(recorded_run, tmp_path / "dump"))


def synthetic_run(root: Path) -> None:
    """A run with per-layer telemetry, as adaptive loss scaling records it."""
    run = RunTelemetry("adaptive", meta={"note": "synthetic"})
    for step in range(12):
        run.step(loss=2.0 / (step + 1), step_time=0.01 + 0.001 * step, loss_scale=None if step < 2 else 1.0)
    for step in range(0, 12, 3):
        for i, layer in enumerate(["conv1", "conv2", "fc"]):
            run.layer(layer, step, scale=2.0 ** (i + step // 3), underflow=0.1 / (i + 1 + step), overflow=0.0)
    run.write(root / "telemetry" / "adaptive.json")


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0, path
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        image = image.convert("RGB")
        assert image.width > 100 and image.height > 100
        assert len(image.getcolors(maxcolors=1 << 20)) > 10, f"{path.name} is blank"


def test_train_digits_writes_telemetry_when_dumping(recorded):
    path = recorded / "telemetry" / "fp32_eager.json"
    data = json.loads(path.read_text())
    assert data["format"] == TELEMETRY_FORMAT and data["name"] == "fp32 eager"
    steps = data["steps"]
    assert steps["step"] == [0, 1]  # 128 samples, batch 64, one epoch
    assert all(math.isfinite(v) and v > 0 for v in steps["loss"])
    assert all(v > 0 for v in steps["step_time"])
    assert steps["loss_scale"][0] == 2.0**16 and steps["skipped"] == [False] * 2
    assert data["layers"] == {}
    assert data["result"]["final_loss"] == pytest.approx(sum(steps["loss"]) / 2)


def test_telemetry_file_when_asked_without_lowprec_dump(tmp_path, monkeypatch, small_digits):
    monkeypatch.delenv(dump.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    train_digits("asked", compiled=False, epochs=1, data=small_digits, telemetry="t.json")
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["steps"]["step"] == [0, 1] and "loss_scale" in data["steps"]
    assert data["steps"]["loss_scale"] == [None, None]  # no loss scaling in this run


def test_a_second_dumped_run_of_one_name_keeps_the_first(tmp_path, monkeypatch, small_digits):
    monkeypatch.setenv(dump.ENV, str(tmp_path))
    for epochs in (1, 2):
        train_digits("twice", compiled=False, epochs=epochs, data=small_digits)
    files = sorted((tmp_path / "telemetry").glob("*.json"))
    assert [p.name for p in files] == ["twice-2.json", "twice.json"]
    steps = {p.name: json.loads(p.read_text())["steps"]["step"] for p in files}
    assert steps == {"twice.json": [0, 1], "twice-2.json": [0, 1, 2, 3]}


def test_run_telemetry_pads_missing_values():
    run = RunTelemetry("r")
    run.step(loss=1.0)
    run.step(loss=0.5, loss_scale=8.0)
    run.layer("fc", 0, underflow=0.25)
    run.layer("fc", 5, scale=4.0, underflow=0.0)
    assert run.steps == {"step": [0, 1], "loss": [1.0, 0.5], "loss_scale": [None, 8.0]}
    assert run.layers == {"fc": {"step": [0, 5], "underflow": [0.25, 0.0], "scale": [None, 4.0]}}


def test_runs_of_one_name_keep_their_own_files_when_asked(tmp_path):
    """Two runs named alike (two processes, or two runs of one script) under one dump
    folder: the second used to replace the first's file."""
    path = tmp_path / "telemetry" / "fp8.json"
    first, second, third = (RunTelemetry("fp8", meta={"run": i}) for i in range(3))
    assert first.write(path, keep_existing=True) == path
    assert second.write(path, keep_existing=True) == tmp_path / "telemetry" / "fp8-2.json"
    assert third.write(path) == path  # a path the caller chose: replaced
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["fp8-2.json", "fp8.json"]  # no hidden part files left
    runs = {p.name: json.loads(p.read_text())["meta"]["run"] for p in path.parent.iterdir()}
    assert runs == {"fp8.json": 2, "fp8-2.json": 1}


def test_report_plots_a_recorded_run_and_per_layer_telemetry(recorded):
    synthetic_run(recorded)
    assert [r["name"] for r in load_runs(recorded)] == ["adaptive", "fp32 eager"]
    page = write_report(recorded)
    out = recorded / "report"
    assert page == out / "report.html"
    names = ["loss", "step_time", "loss_scale", "layer_scale", "underflow", "overflow"]
    for name in names:
        assert_png(out / f"{name}.png")
    text = page.read_text()
    markdown = (out / "report.md").read_text()
    for name in names:
        assert f'src="{name}.png"' in text and f"({name}.png)" in markdown
    assert "fp32 eager" in text and "adaptive" in markdown
    assert "No per-layer telemetry" not in text


def test_report_cli_without_per_layer_telemetry(recorded_run, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["report", str(recorded_run), "-o", str(out)]) == 0
    assert "report.html" in capsys.readouterr().out
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["loss.png", "loss_scale.png", "step_time.png"]
    for png in out.glob("*.png"):
        assert_png(png)
    assert "No per-layer telemetry" in (out / "report.html").read_text()
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "no telemetry" in capsys.readouterr().err


def test_adaptive_run_records_per_layer_telemetry_that_report_plots(tmp_path, monkeypatch, small_digits):
    """A real adaptive-scaling run (not synthetic): its refreshes reach the file and the plots."""
    from examples.models import MLP

    monkeypatch.delenv(dump.ENV, raising=False)
    options = {"recipe": "fp8-e5m2-als", "executor": "eager", "loss_scale_interval": 1}
    train_digits(
        "als",
        options,
        model=MLP(64, 16, 10),
        epochs=2,
        data=small_digits,
        loss_scale="adaptive",
        telemetry=tmp_path / "telemetry" / "als.json",
    )
    layers = json.loads((tmp_path / "telemetry" / "als.json").read_text())["layers"]
    assert sorted(layers) == ["1", "3"]
    assert len(layers["1"]["step"]) >= 2 and all(s >= 1.0 for s in layers["1"]["scale"])
    page = write_report(tmp_path, tmp_path / "report")
    assert page.is_file()
    assert_png(tmp_path / "report" / "layer_scale.png")
    assert_png(tmp_path / "report" / "underflow.png")


def test_report_shows_the_runs_final_loss_and_reads_partial_files(recorded, tmp_path):
    """ "final loss" is the run's own (mean over its last epoch, as ``lowprec demo``
    prints it), not the last step's; a file without per-layer or step sections is read."""
    (recorded / "telemetry" / "bare.json").write_text(json.dumps({"format": TELEMETRY_FORMAT}))
    runs = {r["name"]: r for r in load_runs(recorded)}
    assert set(runs) == {"bare", "fp32 eager"}
    final = runs["fp32 eager"]["result"]["final_loss"]
    assert final != runs["fp32 eager"]["steps"]["loss"][-1]
    markdown = (write_report(recorded).parent / "report.md").read_text()
    assert f"{final:.4f}" in markdown


@pytest.mark.parametrize(
    ("sections", "complaint"),
    [
        ({"steps": [1, 2]}, "steps must map names to lists"),
        ({"steps": {"step": [0, 1], "loss": ["a", "b"]}}, "steps['loss'] must be a list of numbers"),
        ({"layers": {"fc": {"step": 3}}}, "layers['fc']['step'] must be a list of numbers"),
        # cut short or written by hand: the plots index 'step' with each series (a traceback)
        ({"steps": {"loss": [1.0]}}, "steps has ['loss'] longer than its 'step' list (0)"),
        ({"steps": {"step": [0, 1], "loss": [1.0, 0.9, 0.8]}}, "steps has ['loss'] longer than"),
        ({"layers": {"fc": {"scale": [2.0]}}}, "layers['fc'] has no 'step' list"),
        ({"layers": {"fc": {"step": [None], "scale": [2.0]}}}, "layers['fc']['step'] must be a list of"),
        ({"steps": {"step": [0], "loss": [10**400]}}, "steps['loss'] must be a list of numbers"),
        ({"steps": {"step": [0, 1], "loss": [True, False]}}, "steps['loss'] must be a list of numbers"),
        ({"steps": {"step": [0], "step_time": [float("nan")]}}, "steps['step_time'] must be a list of fin"),
        ({"steps": {"step": [0], "step_time": [float("inf")]}}, "steps['step_time'] must be a list of fin"),
        ({"steps": {"step": [True]}}, "steps['step'] must be a list of numbers"),
        ({"name": 5}, "'name' must be a string and 'result' a dict"),
        ({"result": [1]}, "'name' must be a string and 'result' a dict"),
    ],
)
def test_a_malformed_telemetry_file_is_skipped_by_name(tmp_path, sections, complaint):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": TELEMETRY_FORMAT, **sections}))
    good = RunTelemetry("good")
    good.step(loss=0.5)
    good.write(tmp_path / "good.json")
    with pytest.warns(UserWarning, match=re.escape(f"{bad}: {complaint}") + ".*; file skipped"):
        assert [run["name"] for run in load_runs(tmp_path)] == ["good"]


def test_flags_and_a_diverged_loss_are_read(tmp_path):
    """``skipped`` holds flags and a loss may be NaN (training diverged): both are kept."""
    path = tmp_path / "run.json"
    data = {"format": TELEMETRY_FORMAT, "name": "r", "layers": {}, "result": {}}
    steps = {"step": [0, 1], "loss": [1.0, float("nan")], "skipped": [False, True]}
    path.write_text(json.dumps({**data, "steps": steps}))
    assert [run["name"] for run in load_runs(tmp_path)] == ["r"]


def test_unreadable_files_and_paths_are_named(tmp_path, capsys):
    (tmp_path / "cut.json").write_text('{"format": "')
    with pytest.warns(UserWarning, match=re.escape(str(tmp_path / "cut.json")) + ": not readable as JSON"):
        assert load_runs(tmp_path) == []
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'step' is not a column"):
        RunTelemetry("r").step(step=100, loss=1.0)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        RunTelemetry("r").layer("fc", None, scale=2.0)


def test_numpy_and_tensor_values_are_written_as_numbers(tmp_path):
    run = RunTelemetry("numbers")
    run.step(loss=np.float32(0.5), step_time=torch.tensor(0.25), skipped=False)
    run.layer("fc", 0, scale=np.float64(2.0))
    run.write(tmp_path / "numbers.json")
    (loaded,) = load_runs(tmp_path)
    assert loaded["steps"]["loss"] == [0.5] and loaded["steps"]["step_time"] == [0.25]
    assert loaded["layers"]["fc"]["scale"] == [2.0]


def test_report_reads_files_with_columns_of_their_own(tmp_path):
    """``RunTelemetry.step`` takes any column; the report checks only those it plots."""
    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"format": TELEMETRY_FORMAT, "steps": {"step": [0], "phase": ["warm-up"]}}))
    assert [run["name"] for run in load_runs(tmp_path)] == ["extra"]


def test_report_without_matplotlib_says_what_to_install(recorded, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["report", str(recorded)]) == 2
    assert "needs matplotlib" in capsys.readouterr().err
