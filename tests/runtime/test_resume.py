"""Resuming from an ordinary checkpoint (``torch.save`` of the model's, optimizer's and
scaler's state dicts) in a fresh process continues the run bit for bit, for every
recipe; a checkpoint without lowprec's stream state warns that the streams restart."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lpcompile import LossScaler, PipelinedTrainer

SCRIPT = Path(__file__).with_name("resume_run.py")
ROOT = SCRIPT.parents[2]


def _run(case: str, folder: Path, phase: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-W", "always::UserWarning", str(SCRIPT), case, str(folder), phase],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names of the tensors whose bits differ."""
    return [name for name in a if not torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))]


@pytest.mark.parametrize(
    "case",
    [
        pytest.param("nearest", marks=pytest.mark.slow),
        pytest.param("stochastic", marks=pytest.mark.slow),
        "adaptive",
        pytest.param("master", marks=pytest.mark.slow),
        pytest.param("pipeline", marks=pytest.mark.slow),
    ],
)
def test_a_fresh_process_resumes_bit_for_bit(case, tmp_path):
    _run(case, tmp_path, "full")
    stderr = _run(case, tmp_path, "rest")
    assert "restart" not in stderr, stderr[-2000:]
    full, rest = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "rest.pt")
    assert _same_bits(full, rest) == []


@pytest.mark.slow
def test_a_checkpoint_without_stream_state_warns_that_the_streams_restart(tmp_path):
    _run("stochastic", tmp_path, "full")
    stderr = _run("stochastic", tmp_path, "rest-old")
    assert stderr.count("restarts its streams at call 0") == 1, stderr[-2000:]
    full, old = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "rest-old.pt")
    assert _same_bits(full, old), "the restarted streams should round differently"


def _sr_model() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return model, torch.compile(
        model, backend="lowprec", options={"recipe": "fp8-e5m2-sr", "executor": "eager"}
    )


def _grads(model: torch.nn.Module, run: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The weight gradients of one call (the recipe rounds them stochastically)."""
    model.zero_grad()
    run(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_stream_state_loads_into_a_model_alive_with_the_saved_weights():
    """Loaded after the model already ran (the live-model path): its next call rounds as
    the saved model's next call does, which a restarted stream would not."""
    x = torch.randn(4, 8)
    model, run = _sr_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        _grads(model, run, x)
        opt.step()
    saved = LossScaler().state_dict()
    weights = copy.deepcopy(model.state_dict())
    expected = _grads(model, run, x)
    opt.step()  # the saved model moves on: only the new one has the saved weights
    other, other_run = _sr_model()
    other.load_state_dict(weights)
    restarted = _grads(other, other_run, x)
    LossScaler().load_state_dict(saved)
    assert not all(map(torch.equal, restarted, expected))
    assert all(map(torch.equal, _grads(other, other_run, x), expected))


def test_two_copies_of_one_network_take_their_own_counts_by_their_weights():
    """Models with the same layers share random streams: the saved counts go to the
    model whose weights they were saved with, whichever runs first."""
    x = torch.randn(4, 8)
    saved_models, expected, weights = [], [], []
    for calls in (3, 5):
        model, run = _sr_model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * calls)  # copies with different weights
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(calls):
            _grads(model, run, x)
            opt.step()
        saved_models.append((model, run, opt))
    saved = LossScaler().state_dict()
    for model, run, opt in saved_models:
        weights.append(copy.deepcopy(model.state_dict()))
        expected.append(_grads(model, run, x))
        opt.step()  # the saved models move on
    LossScaler().load_state_dict(saved)
    for i in (1, 0):  # the second copy first
        model, run = _sr_model()
        model.load_state_dict(weights[i])
        assert all(map(torch.equal, _grads(model, run, x), expected[i])), f"copy {i}"


def test_calls_inside_unrecorded_leave_the_streams_and_saved_state_alone():
    """What a pipeline's warm-up relies on: calls inside ``REGISTRY.unrecorded()`` do not
    advance the call counts, and saved counts still waiting for their model stay saved."""
    from lpcompile.backend.state import REGISTRY

    x = torch.randn(4, 8)
    model, run = _sr_model()
    _grads(model, run, x)
    saved = LossScaler().state_dict()
    expected = _grads(model, run, x)  # the second call's bits
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the saved model moves on: only the new one has the saved weights
    other, other_run = _sr_model()  # the saved weights, its counts not yet taken
    LossScaler().load_state_dict(saved)
    with REGISTRY.unrecorded():
        inside = [_grads(other, other_run, x) for _ in range(2)]  # takes the counts: calls 1, 2
    assert all(map(torch.equal, inside[0], expected))
    assert all(map(torch.equal, _grads(other, other_run, x), expected))  # call 1 again
    with REGISTRY.unrecorded():
        _grads(model, run, x)
    assert sum(REGISTRY.entry(next(model.parameters())).steps.values()) == 2
    # and without it the counts do move
    _grads(model, run, x)
    assert sum(REGISTRY.entry(next(model.parameters())).steps.values()) == 3


def test_saving_the_stream_state_leaves_the_weights_storage_resizable():
    """The digest of a model's first weight read it through ``Tensor.numpy()``, which marks
    a CPU tensor's storage as not resizable: FSDP2, which frees an unsharded parameter by
    resizing its storage to 0, then failed at the next reshard (a scaler's state saved
    after an eval forward, which leaves the root's parameters unsharded)."""
    model, run = _sr_model()
    _grads(model, run, torch.randn(4, 8))
    LossScaler().state_dict()
    for p in model.parameters():
        p.untyped_storage().resize_(0)


@pytest.mark.parametrize(
    ("streams", "match"),
    [
        ("counts", "must be a list"),
        ([{"steps": []}], "'model' digest"),
        ([{"model": "ab", "steps": [[1, "cfg", True, -1]]}], r"count >= 0\], got \[1, 'cfg', True, -1\]"),
        ([{"model": "ab", "steps": [[1, "cfg", 1, 2]]}], "grad mode"),
    ],
)
def test_bad_stream_state_is_refused_before_anything_loads(streams, match):
    scaler = LossScaler(init_scale=8.0)
    saved = {**LossScaler(init_scale=16.0).state_dict(), "streams": streams}
    with pytest.raises(ValueError, match=match):
        scaler.load_state_dict(saved)
    assert scaler.get_scale() == 8.0


def test_the_trainer_saves_and_loads_only_a_drained_pipeline():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    trainer = PipelinedTrainer(model, torch.randn(1, 4), stages=2, lr=0.1)
    trainer.step(torch.randn(1, 4), torch.tensor([1]))
    with pytest.raises(RuntimeError, match=r"cannot save .* samples are in the pipeline: call drain\(\)"):
        trainer.state_dict()
    trainer.drain()
    state = trainer.state_dict()
    with pytest.raises(ValueError, match=r"not a PipelinedTrainer state dict: it lacks \['samples'\]"):
        trainer.load_state_dict({k: v for k, v in state.items() if k != "samples"})
    with pytest.raises(
        ValueError, match=r"'random' must hold the random streams of stages \[0, 1\], it holds \[\]"
    ):
        trainer.load_state_dict({**state, "random": {}})
    with pytest.raises(ValueError, match=r"stage 1's saved cpu random state is not a generator state"):
        trainer.load_state_dict({**state, "random": {**state["random"], 1: {"cpu": torch.zeros(3)}}})
    assert state["steps"] == 3 and state["samples"] == 1
