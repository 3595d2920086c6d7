"""Loss scaling per pipeline stage: each stage's scale, its skipped updates, and what
the scaled run computes against an unscaled one.

The chain models (``x * w0 * w1 * w2``, one stage per weight, the loss their output) let
the overflows be placed by hand. With ``x = 1``, ``w0 = w1 = 0.5`` and ``w2 = 2**100``,
at scale ``S`` the last stage's error out is ``S * 2**100``, inf in FP32 from
``S = 2**28``; stage 1's error in is ``S * 2**100`` too (inf from ``2**28``); stage 0's
weight gradient is ``S * 2**99`` (inf from ``2**29``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from test_pipeline import Chain, chain_trainer, output_loss

from examples.models import MLP
from lpcompile.backend import stats
from lpcompile.backend.adaptive import AdaptiveScaleState
from lpcompile.runtime.pipeline import PipelinedTrainer
from lpcompile.runtime.scaler import LossScaleConfig, LossScaler

pytestmark = pytest.mark.usefixtures("single_thread")


def applied_gradients(
    trainer: PipelinedTrainer, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]
) -> dict[tuple[int, int], torch.Tensor]:
    """Feed the samples ``xs`` (targets ``ys``) and drain; returns the gradient each stage
    applied for each sample, by (stage, sample), read at every optimizer step."""
    got: dict[tuple[int, int], torch.Tensor] = {}
    step = trainer.optimizer.step

    def recording_step():
        for event in trainer.history:
            if event.kind == "backward" and event.step == trainer.steps:
                grad = trainer.stages[event.stage].params[0].grad
                if grad is not None:
                    got[(event.stage, event.sample)] = grad.clone()
        return step()

    trainer.optimizer.step = recording_step
    for x, y in zip(xs, ys, strict=True):
        trainer.step(x, y)
    trainer.drain()
    return got


def test_each_stage_skips_what_overflowed_in_it_and_backs_off_alone():
    """Scales start at 2**30 (module doc). The last stage overflows until its scale is
    2**27 (samples 0-2 skipped there, and upstream); stage 1 then rescales the error to
    its own 2**30, overflows in turn and backs off to 2**27 (samples 3-5); stage 0 to 2**28
    (samples 6, 7). Every other (stage, sample) applies exactly the unscaled run's
    gradient (lr = 0: both runs keep the same weights; power-of-two scales are exact)."""
    weights = [0.5, 0.5, 2.0**100]
    config = LossScaleConfig("dynamic", init_scale=2.0**30, growth_interval=1000)
    scaled = chain_trainer(weights, 0, lr=0.0, loss_scale=config)
    plain = chain_trainer(weights, 0, lr=0.0)
    xs, ys = [torch.ones(1)] * 12, [torch.zeros(1)] * 12
    got, expected = applied_gradients(scaled, xs, ys), applied_gradients(plain, xs, ys)
    assert len(expected) == 3 * 12
    first_applied = {2: 3, 1: 6, 0: 8}
    assert sorted(got) == sorted(key for key in expected if key[1] >= first_applied[key[0]])
    assert all(torch.equal(got[key], expected[key]) for key in got)
    assert scaled.loss_scales == {0: 2.0**28, 1: 2.0**27, 2: 2.0**27}
    assert scaled.skipped_samples == {0: 2, 1: 3, 2: 3}  # upstream skips are not counted
    assert scaled.losses == plain.losses


def test_scales_grow_after_clean_samples_with_gradscalers_rule():
    """Without overflow each stage doubles its scale after every ``growth_interval`` clean
    samples (torch.amp.GradScaler's rule, per sample), and its gradients stay exactly
    the unscaled run's. ``"enhanced"`` holds a stage at its floor."""
    weights = [0.9, -0.7, 1.1]
    config = LossScaleConfig("dynamic", init_scale=2.0**4, growth_interval=3)
    scaled = chain_trainer(weights, 0, loss_scale=config)
    plain = chain_trainer(weights, 0)
    xs, ys = [torch.tensor([n + 1.0]) for n in range(10)], [torch.zeros(1)] * 10
    got, expected = applied_gradients(scaled, xs, ys), applied_gradients(plain, xs, ys)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert [p.item() for p in scaled.model.parameters()] == [p.item() for p in plain.model.parameters()]
    assert scaled.loss_scales == {s: 2.0 ** (4 + 10 // 3) for s in range(3)}
    # the reference: GradScaler fed ten clean steps
    param = torch.nn.Parameter(torch.zeros(1))
    reference = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=3)
    optimizer = torch.optim.SGD([param], lr=0.0)
    for _ in range(10):
        reference.scale(param.sum()).backward()
        reference.step(optimizer)
        reference.update()
    assert scaled.loss_scales[0] == reference.get_scale()
    floor = LossScaleConfig("enhanced", init_scale=2.0**30, growth_interval=1000, min_scale=2.0**29)
    held = chain_trainer([0.5, 0.5, 2.0**100], 12, lr=0.0, loss_scale=floor)
    held.drain()
    assert held.loss_scales == {0: 2.0**30, 1: 2.0**30, 2: 2.0**29}  # 0 and 1 get no error
    assert held.skipped_samples == {0: 0, 1: 0, 2: 12}  # the floor keeps it overflowing


def test_a_static_scale_that_overflows_skips_instead_of_breaking_the_weights():
    """FP8 stages whose errors overflow E5M2 (to inf) at a static 2**24: every sample is
    skipped at the last stage and the weights stay as they were; a dynamic scale from
    the same start backs off per stage and trains."""
    torch.manual_seed(0)
    xs, ys = torch.randn(16, 16), torch.randint(0, 4, (16,))
    options = {"recipe": "fp8-e5m2-sr", "executor": "eager"}
    runs = {}
    for name, loss_scale in [
        ("static", 2.0**24),
        ("dynamic", LossScaleConfig("dynamic", init_scale=2.0**24, growth_interval=8)),
    ]:
        torch.manual_seed(1)
        model = MLP(16, 32, 32, 4)
        before = [p.detach().clone() for p in model.parameters()]
        trainer = PipelinedTrainer(
            model, xs[:1], stages="layer", lr=0.05, compile=options, loss_scale=loss_scale
        )
        trainer.fit(xs, ys, epochs=2)
        moved = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
        runs[name] = (trainer, moved, all(torch.isfinite(p).all() for p in model.parameters()))
    static, moved, finite = runs["static"]
    assert finite and not any(moved)
    assert static.skipped_samples[static.num_stages - 1] == 32
    assert set(static.loss_scales.values()) == {2.0**24}
    dynamic, moved, finite = runs["dynamic"]
    assert finite and all(moved)
    assert all(scale < 2.0**24 for scale in dynamic.loss_scales.values())
    assert 0 < sum(dynamic.skipped_samples.values()) < 3 * 32


def _small_loss(output, target):  # errors small enough to underflow E5M2 at scale 1
    return F.mse_loss(output, target) * 2**-12


def _finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_adaptive_stages_start_where_errors_overflow_and_skip_instead_of_breaking_the_weights():
    """Per-layer adaptive scales compiled into the stages, starting at 2**24 (FP8 errors
    overflow E5M2 to inf), with no per-stage scaling asked for: the stages check their
    gradients anyway and skip what overflowed (stepping on it made every weight NaN)."""
    torch.manual_seed(0)
    xs, ys = torch.randn(16, 16), torch.randint(0, 4, (16,))
    torch.manual_seed(1)
    model = MLP(16, 32, 32, 4)
    options = {"recipe": "fp8-e5m2-als", "executor": "eager", "loss_scale_init": 2**24}
    trainer = PipelinedTrainer(model, xs[:1], stages="layer", lr=0.05, compile=options)
    trainer.fit(xs, ys, epochs=2)
    assert _finite(model) and all(torch.isfinite(torch.tensor(trainer.losses)))
    assert all(trainer.skipped_samples.values()), trainer.skipped_samples
    assert trainer.loss_scales == {0: 1.0, 1: 1.0, 2: 1.0}  # checked, not scaled per stage
    assert all(t.cumulative < 2**24 for t in stats(model))
    state = trainer.state_dict()
    assert set(state["loss_scales"]) == {0, 1, 2}  # the checks' counts
    state["loss_scales"] = {}  # a state without them loads too (the counts restart)
    trainer.load_state_dict(state)


def test_an_adaptive_stage_backs_off_the_layer_that_overflowed():
    """Once the layers' scales are set (small errors raise them above 1), a sample whose
    error overflows near the loss: the stage where it overflows skips it (and the stages
    before it, which receive no error; the stages after it step), the layer of that stage
    halves its scale, the others keep theirs. (The stages after it step on the spike: with
    this one, the samples after it overflow there in turn.)"""
    torch.manual_seed(0)
    xs, ys = torch.randn(8, 16), torch.randn(8, 4)
    torch.manual_seed(1)
    model = MLP(16, 32, 32, 4)  # one layer (weight, bias) per stage
    options = {"recipe": "fp8-e5m2-als", "executor": "eager", "loss_scale_interval": 1000}
    trainer = PipelinedTrainer(model, xs[:1], stages="layer", lr=0.05, compile=options, loss_fn=_small_loss)
    trainer.fit(xs, ys, epochs=2)
    scales = [t.cumulative for t in stats(model)]
    calibration = trainer.calibration_samples
    assert trainer.skipped_samples == calibration and scales[0] > 1  # no overflow yet
    before = [p.detach().clone() for p in model.parameters()]
    trainer.step(xs[:1], ys[:1] * 1e8)  # the error overflows E5M2
    trainer.drain()
    assert trainer.calibration_samples == calibration
    skipped = {stage: count - calibration[stage] for stage, count in trainer.skipped_samples.items()}
    (hit,) = [stage for stage, count in skipped.items() if count]
    assert skipped[hit] == 1
    kept = [torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
    assert kept == [stage <= hit for stage in range(3) for _ in range(2)]
    assert [t.cumulative for t in stats(model)] == [s / 2 if i == hit else s for i, s in enumerate(scales)]
    assert [t.overflow for t in stats(model)] == [int(i == hit) for i in range(3)]
    assert _finite(model)


def test_samples_in_flight_that_overflow_together_back_off_once():
    """Two consecutive samples whose errors overflow in a stage before the last: its
    forwards run ahead, so both read the same scale s; the first backward halves it, the
    second keeps s/2 (half what it read), not s/4. lr = 0: the stages after it, which step
    on the first spike, keep their weights, and the second overflows where the first did."""
    torch.manual_seed(0)
    xs, ys = torch.randn(8, 16), torch.randn(8, 4)
    torch.manual_seed(1)
    model = MLP(16, 32, 32, 4)  # one layer per stage
    options = {"recipe": "fp8-e5m2-als", "executor": "eager", "loss_scale_interval": 1000}
    trainer = PipelinedTrainer(model, xs[:1], stages="layer", lr=0.0, compile=options, loss_fn=_small_loss)
    trainer.fit(xs, ys, epochs=2)
    scales, skipped = [t.cumulative for t in stats(model)], trainer.skipped_samples
    for x, y in zip(xs[:2], ys[:2], strict=True):
        trainer.step(x[None], y[None] * 3e7)  # overflows E5M2 in one stage (at scale s)
    trainer.drain()
    overflows = [t.overflow for t in stats(model)]
    (hit,) = [stage for stage, count in enumerate(overflows) if count]
    assert hit < 2 and overflows[hit] == 2  # a delayed stage, both samples
    assert trainer.skipped_samples == {
        stage: count + 2 * (stage == hit) for stage, count in skipped.items()
    }  # the stages before it receive no error (uncounted)
    assert [t.cumulative for t in stats(model)] == [s / 2 if i == hit else s for i, s in enumerate(scales)]


def _train_without_pipeline(
    model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor, options: dict, lr: float
) -> LossScaler:
    """SGD on one sample at a time of ``model`` compiled with ``options``, under
    ``LossScaler("adaptive")`` (returned)."""
    compiled = torch.compile(model, backend="lowprec", options=options)
    optimizer, scaler = torch.optim.SGD(model.parameters(), lr=lr), LossScaler("adaptive")
    for x, y in zip(xs, ys, strict=True):
        scaler.scale(_small_loss(compiled(x[None]), y[None])).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return scaler


def _rule_raising_8x(monkeypatch, cap: float = math.inf) -> None:
    """Make every refresh ask for 8 times the scales its call read (at most ``cap``): a
    cascade that settles at ``cap``, or never (calibration gives up)."""
    take_statistics = AdaptiveScaleState.take_statistics

    def raising(state):
        read = state.recorded.tolist()
        return (
            None if take_statistics(state) is None else ([min(8 * s, cap) for s in read], [None] * len(read))
        )

    monkeypatch.setattr(AdaptiveScaleState, "take_statistics", raising)


@pytest.mark.parametrize("rule", ["measured", "never-settles"])
def test_a_one_stage_pipeline_skips_the_calibrating_steps_loss_scaler_skips(monkeypatch, rule):
    """One stage (no delay) with per-layer adaptive scales from 1, where the errors
    underflow: the pipeline skips the samples ``LossScaler("adaptive")`` skips while the
    scales calibrate, and ends with the same weights and scales as that scaler's loop over
    the same samples (applying every sample, the pipeline's weights differed). Also where
    calibration gives up (each refresh asks for more): the sample of the last refresh
    is stepped on, as the scaler steps."""
    if rule == "never-settles":
        _rule_raising_8x(monkeypatch)
    torch.manual_seed(0)
    xs, ys = torch.randn(12, 16), torch.randn(12, 4)
    options = {"recipe": "fp8-e5m2-als", "executor": "eager", "loss_scale_interval": 1}
    torch.manual_seed(1)
    piped, plain = MLP(16, 32, 32, 4), MLP(16, 32, 32, 4)
    plain.load_state_dict(piped.state_dict())
    trainer = PipelinedTrainer(piped, xs[:1], stages=1, lr=0.05, compile=options, loss_fn=_small_loss)
    for x, y in zip(xs, ys, strict=True):
        trainer.step(x[None], y[None])
    scaler = _train_without_pipeline(plain, xs, ys, options, lr=0.05)
    assert scaler.calibration_steps > 1
    assert trainer.calibration_samples == trainer.skipped_samples == {0: scaler.calibration_steps}
    assert all(torch.equal(a, b) for a, b in zip(piped.parameters(), plain.parameters(), strict=True))
    # the same refreshes, at the same scales; the pipeline's last at once (the loop's waits
    # for a next call)
    assert [t.history[:-1] for t in stats(piped)] == [t.history for t in stats(plain)]


def test_delayed_stages_skip_every_sample_quantized_at_uncalibrated_scales():
    """Three stages, per-layer adaptive scales from 1 where the errors underflow. A stage's
    forwards run ahead of its backwards, so several samples read the initial scales before
    the first statistics come back: every one of them whose statistics raise a scale more
    than a binade is skipped (not only those before calibration ends), and no update
    quantized at the initial scale of a layer that had to rise is applied. Each refresh is
    read against the scales that sample's forward read (the telemetry's history)."""
    torch.manual_seed(0)
    xs, ys = torch.randn(8, 16), torch.randn(8, 4)
    torch.manual_seed(1)
    model = MLP(16, 32, 32, 4)  # one layer per stage
    options = {"recipe": "fp8-e5m2-als", "executor": "eager", "loss_scale_interval": 1}
    trainer = PipelinedTrainer(
        model, xs[:1], stages="layer", lr=0.05, compile=options, loss_fn=_small_loss, record=True
    )
    applied = applied_gradients(trainer, xs[:, None], ys[:, None])
    calibration = trainer.calibration_samples
    assert calibration == trainer.skipped_samples  # nothing overflowed
    rising = 0
    for stage, telemetry in enumerate(stats(model)):  # one layer per stage
        # one refresh per backward that reached the stage: the call and scale of that
        # sample's forward (sample n is the stage's call n)
        read = [scale for _, scale, _ in telemetry.history]
        calls = [call for call, _, _ in telemetry.history]
        stepped = {sample for s, sample in applied if s == stage}
        assert len(read) == len(stepped) + calibration[stage]
        assert stepped <= set(calls) and calls == sorted(set(calls))
        if telemetry.cumulative <= 2:  # a layer whose scale need not rise
            assert calibration[stage] == 0
            continue
        rising += 1
        # the samples in flight when the first statistics came back read scale 1, and
        # none of those is applied
        assert read.count(1.0) >= 2
        assert not stepped & {call for call, scale, _ in telemetry.history if scale == 1.0}
    assert rising >= 2 and len(applied) > 8  # the stages do train


def test_a_delayed_stage_calibrates_through_as_many_rounds_as_without_a_pipeline(monkeypatch):
    """A refresh may raise a scale 8-fold at most, up to 512: three rounds from 1. The
    first stage (two layers, delay 2) reaches 512 as the model without a pipeline does:
    the samples in flight that read the scales of an earlier round are no rounds of
    their own (counted as such, calibration gave up at 64)."""
    _rule_raising_8x(monkeypatch, cap=512.0)
    torch.manual_seed(0)
    xs, ys = torch.randn(16, 16), torch.randn(16, 4)
    options = {"recipe": "fp8-e5m2-als", "executor": "eager"}
    torch.manual_seed(1)
    piped, plain = MLP(16, 32, 32, 32, 32, 4), MLP(16, 32, 32, 32, 32, 4)
    plain.load_state_dict(piped.state_dict())
    trainer = PipelinedTrainer(piped, xs[:1], stages=2, lr=0.0, compile=options, loss_fn=_small_loss)
    assert [len(stage.params) for stage in trainer.stages] == [4, 6] and trainer.delays == [2, 0]
    for x, y in zip(xs, ys, strict=True):
        trainer.step(x[None], y[None])
    trainer.drain()
    _train_without_pipeline(plain, xs, ys, options, lr=0.0)
    assert [t.cumulative for t in stats(plain)] == [512.0] * 5
    assert [t.cumulative for t in stats(piped)] == [512.0] * 5


def test_the_scales_resume_with_the_trainer_state():
    """A drained run saved and resumed in a new trainer equals the uninterrupted run:
    weights, losses and every stage's scale."""
    config = LossScaleConfig("dynamic", init_scale=2.0**30, growth_interval=2)
    weights = [0.5, 0.5, 2.0**100]

    def run(trainer, first, count):
        for n in range(first, first + count):
            trainer.step(torch.tensor([float(n % 5 + 1)]), torch.zeros(1))
        trainer.drain()

    full = chain_trainer(weights, 0, lr=2.0**-120, momentum=0.0, loss_scale=config)
    run(full, 0, 14)
    first = chain_trainer(weights, 0, lr=2.0**-120, momentum=0.0, loss_scale=config)
    run(first, 0, 7)
    state, model_state = first.state_dict(), first.model.state_dict()
    assert set(state["loss_scales"]) == {0, 1, 2}
    rest = PipelinedTrainer(
        Chain(*weights), torch.ones(1), lr=2.0**-120, loss_fn=output_loss, loss_scale=config
    )
    rest.model.load_state_dict(model_state)
    rest.load_state_dict(state)
    run(rest, 7, 7)
    assert rest.loss_scales == full.loss_scales and rest.skipped_samples == full.skipped_samples
    assert first.losses + rest.losses == full.losses
    assert [p.item() for p in rest.model.parameters()] == [p.item() for p in full.model.parameters()]
    # a state saved before the stages counted calibration skips loads, the count at 0
    state["loss_scales"] = {
        index: {key: v for key, v in saved.items() if key != "calibration"}
        for index, saved in state["loss_scales"].items()
    }
    rest.load_state_dict(state)
    assert rest.calibration_samples == {0: 0, 1: 0, 2: 0}
    unscaled = chain_trainer(weights, 0)
    with pytest.raises(ValueError, match=r"'loss_scales' must hold the loss scales of stages \[\]"):
        unscaled.load_state_dict(state)
    state["loss_scales"][1]["scale"] = 0.0
    with pytest.raises(ValueError, match="stage 1's saved scale must be a finite number > 0"):
        rest.load_state_dict(state)


def test_loss_scale_settings_are_checked_up_front():
    model, x = MLP(8, 8, 4), torch.rand(1, 8)
    with pytest.raises(ValueError, match="loss scaling mode must be one of"):
        PipelinedTrainer(model, x, stages=2, lr=0.1, loss_scale="dynamc")
    with pytest.raises(ValueError, match="per-layer adaptive scales are compiled into the stages"):
        PipelinedTrainer(model, x, stages=2, lr=0.1, loss_scale="adaptive")
    with pytest.raises(ValueError, match="loss_scale must be a normal float32 number"):
        PipelinedTrainer(model, x, stages=2, lr=0.1, loss_scale=1e-50)
    trainer = PipelinedTrainer(model, x, stages=2, lr=0.1, loss_scale="enhanced")
    assert trainer.loss_scales == {0: 2.0**16, 1: 2.0**16}
    assert trainer.loss_scale_config == LossScaleConfig("enhanced")
    assert PipelinedTrainer(model, x, stages=2, lr=0.1).loss_scale_config is None
