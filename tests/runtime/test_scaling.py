"""Tests of lpcompile.runtime.scaler.LossScaler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lpcompile.runtime.scaler import LossScaleConfig, LossScaler


def _model_and_opt(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batch(i: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(i))


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _train(scaler, model, opt, steps: int, bad: dict[int, float], unscale_at=()) -> tuple[list, list]:
    """Train with ``bad[i]`` written into a grad at iteration i; return (scales, skipped)."""
    scales, skipped = [], []
    for i in range(steps):
        opt.zero_grad()
        scaler.scale(model(_batch(i)).square().mean()).backward()
        if i in bad:
            next(model.parameters()).grad[0, 0] = bad[i]
        before = _params(model)
        if i in unscale_at:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        result = scaler.step(opt)
        skipped.append(_same(before, _params(model)))
        if skipped[-1]:
            assert result is None
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, skipped


def test_defaults_match_grad_scaler():
    ref = torch.amp.GradScaler("cpu")
    cfg = LossScaler().config
    assert cfg.mode == "dynamic"
    assert (cfg.init_scale, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval) == (
        ref.get_scale(),
        ref.get_growth_factor(),
        ref.get_backoff_factor(),
        ref.get_growth_interval(),
    )


def test_dynamic_matches_grad_scaler_step_by_step():
    inf, nan = float("inf"), float("nan")
    bad = {2: inf, 3: nan, 9: -inf}
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    model, opt = _model_and_opt()
    ref_model, ref_opt = _model_and_opt()
    scales, skipped = _train(LossScaler("dynamic", **kwargs), model, opt, 14, bad, unscale_at=(4, 9))
    ref = torch.amp.GradScaler("cpu", **kwargs)
    ref_scales, ref_skipped = _train(ref, ref_model, ref_opt, 14, bad, unscale_at=(4, 9))
    assert scales == ref_scales
    assert skipped == ref_skipped == [i in bad for i in range(14)]
    assert _same(_params(model), _params(ref_model))
    steps = list(zip(scales[:-1], scales[1:], strict=True))
    assert any(b > a for a, b in steps) and any(b < a for a, b in steps)  # growth and backoff


def test_static_keeps_scale_and_skips_overflow():
    model, opt = _model_and_opt()
    scaler = LossScaler("static", init_scale=8.0)
    scales, skipped = _train(scaler, model, opt, 6, {1: float("inf"), 4: float("nan")})
    assert scales == [8.0] * 6
    assert skipped == [False, True, False, False, True, False]
    assert scaler.skipped_steps == 2


def test_skipped_step_leaves_optimizer_state_untouched():
    model, opt = _model_and_opt()
    scaler = LossScaler("static", init_scale=4.0)
    _train(scaler, model, opt, 2, {})
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    _train(scaler, model, opt, 1, {0: float("inf")})
    assert _same(momentum, [opt.state[p]["momentum_buffer"] for p in model.parameters()])


def test_enhanced_never_undercuts_min_scale_and_schedule_raises_it():
    always_bad = {i: float("inf") for i in range(10)}
    model, opt = _model_and_opt()
    scaler = LossScaler("enhanced", init_scale=2.0**10, min_scale=2.0**8, min_scale_schedule={6: 2.0**12})
    scales, skipped = _train(scaler, model, opt, 10, always_bad)
    assert all(skipped)
    # scales[i] is the scale after update i + 1; iteration 6 (the 7th) trains with the raised floor
    assert scales == [2.0**9, 2.0**8, 2.0**8, 2.0**8, 2.0**8] + [2.0**12] * 5
    assert scaler.get_min_scale() == 2.0**12
    model, opt = _model_and_opt()
    dynamic, _ = _train(LossScaler("dynamic", init_scale=2.0**10), model, opt, 10, always_bad)
    assert dynamic[-1] == 2.0**0  # what enhanced mode prevents


def test_enhanced_grows_like_dynamic_above_the_floor():
    model, opt = _model_and_opt()
    scaler = LossScaler("enhanced", init_scale=2.0**4, growth_interval=2, min_scale=2.0**2)
    scales, _ = _train(scaler, model, opt, 4, {})
    assert scales == [2.0**4, 2.0**5, 2.0**5, 2.0**6]


def test_state_dict_round_trip_continues_identically():
    kwargs = dict(init_scale=2.0**6, growth_interval=2, min_scale=2.0**3, min_scale_schedule={7: 2.0**5})
    bad = {1: float("inf"), 2: float("inf"), 6: float("inf")}
    model, opt = _model_and_opt()
    scaler = LossScaler("enhanced", **kwargs)
    _train(scaler, model, opt, 4, bad)
    state = scaler.state_dict()
    assert {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} <= state.keys()
    assert state["iteration"] == 4 and state["skipped_steps"] == 2
    restored = LossScaler("enhanced")  # settings come from the state dict
    restored.load_state_dict(state)
    assert restored.state_dict() == state and restored.skipped_steps == 2
    shifted = {i - 4: v for i, v in bad.items() if i >= 4}
    model2, opt2 = _model_and_opt()
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(opt.state_dict())
    first = _train(scaler, model, opt, 6, shifted)
    second = _train(restored, model2, opt2, 6, shifted)
    assert first == second
    assert first[0][-1] >= 2.0**5


def test_loads_grad_scaler_state_dict():
    ref = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=7)
    scaler = LossScaler()
    scaler.load_state_dict(ref.state_dict())
    assert scaler.get_scale() == 32.0 and scaler.config.growth_interval == 7
    with pytest.raises(ValueError, match="mode"):
        LossScaler("static").load_state_dict(LossScaler("dynamic").state_dict())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"scale": -5.0}, "scale"),
        ({"scale": float("nan")}, "scale"),
        ({"scale": "big"}, "scale"),
        ({"_growth_tracker": -1}, "_growth_tracker"),
        ({"iteration": 1.5}, "iteration"),
        ({"growth_factor": 0.5}, "growth_factor"),
    ],
)
def test_a_bad_state_dict_is_refused_before_any_of_it_applies(change, match):
    scaler = LossScaler(init_scale=8.0)
    saved = {**LossScaler(init_scale=16.0).state_dict(), "iteration": 7, "skipped_steps": 3}
    with pytest.raises(ValueError, match=match):
        scaler.load_state_dict({**saved, **change})
    assert (scaler.get_scale(), scaler.state_dict()["iteration"], scaler.skipped_steps) == (8.0, 0, 0)


def test_other_state_dicts_are_refused_by_name():
    with pytest.raises(ValueError, match=r"not a loss scaler state dict: it lacks \['scale'"):
        LossScaler().load_state_dict({"weight": torch.ones(3)})
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=128.0).state_dict()
    with pytest.raises(ValueError, match="mode 'adaptive' needs the per-layer state"):
        LossScaler("adaptive").load_state_dict(grad_scaler)


def _stepped_scaler() -> LossScaler:
    """A scaler that has scaled, and stepped on, one backward: ready for ``update``."""
    model, opt = _model_and_opt()
    scaler = LossScaler()
    scaler.scale(model(_batch(0)).sum()).backward()
    scaler.step(opt)
    return scaler


def test_update_takes_a_numpy_scale():
    scaler = _stepped_scaler()
    scaler.update(np.float32(4.0))
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize("new_scale", [0.0, -1.0, float("nan"), float("inf")])
def test_update_refuses_a_scale_that_is_not_finite_and_positive(new_scale):
    with pytest.raises(ValueError, match="new_scale must be a finite number > 0"):
        _stepped_scaler().update(new_scale)


def test_enhanced_keeps_its_floor_when_loading_a_grad_scaler_state_dict():
    """A GradScaler dict has no floor: the scaler keeps its own, and a loaded scale
    below the floor is raised to it before the first step, not after."""
    ref = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler = LossScaler("enhanced", min_scale=4.0, min_scale_schedule={5: 1024.0})
    scaler.load_state_dict(ref.state_dict())
    assert scaler.config.min_scale == 4.0 and scaler.config.min_scale_schedule == {5: 1024.0}
    assert scaler.get_scale() == 4.0
    assert scaler.scale(torch.ones(())).item() == 4.0


def test_unscale_twice_and_step_twice_raise():
    model, opt = _model_and_opt()
    scaler = LossScaler()
    scaler.scale(model(_batch(0)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already"):
        scaler.step(opt)
    scaler.update()
    scaler.scale(model(_batch(1)).sum()).backward()
    scaler.unscale_(opt)  # fine again after update()


@pytest.mark.parametrize("positional", [False, True], ids=["closure=", "step(opt, closure)"])
def test_a_closure_is_refused_however_it_is_passed(positional):
    """LBFGS's usual ``step(closure)`` was let through, unscaling the gradients from before
    the closure ran and optimizing on scaled ones."""
    model, _ = _model_and_opt()
    opt = torch.optim.LBFGS(model.parameters())
    scaler = LossScaler()
    scaler.scale(model(_batch(0)).sum()).backward()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = scaler.scale(model(_batch(0)).sum())
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="closure use is not supported"):
        scaler.step(opt, closure) if positional else scaler.step(opt, closure=closure)


def test_unscale_divides_grads_by_scale():
    model, opt = _model_and_opt()
    model(_batch(0)).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    scaler = LossScaler("static", init_scale=2.0**12)
    scaler.scale(model(_batch(0)).sum()).backward()
    scaler.unscale_(opt)
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_scale_nested_outputs_and_disabled():
    scaler = LossScaler(init_scale=4.0)
    a, (b, c) = scaler.scale([torch.tensor(1.0), (torch.tensor(2.0), torch.tensor(3.0))])
    assert (a.item(), b.item(), c.item()) == (4.0, 8.0, 12.0)
    off = LossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert off.scale(loss) is loss and not off.is_enabled()
    assert off.get_scale() == 1.0 and off.state_dict() == {}
    model, opt = _model_and_opt()
    model(_batch(0)).sum().backward()
    before = _params(model)
    off.unscale_(opt)
    off.step(opt)
    off.update()
    assert not _same(before, _params(model))


def test_update_with_new_scale():
    model, opt = _model_and_opt()
    scaler = LossScaler("enhanced", min_scale=16.0)
    scaler.scale(model(_batch(0)).sum()).backward()
    scaler.step(opt)
    scaler.update(2.0)
    assert scaler.get_scale() == 16.0  # never below the floor
    scaler.update(torch.tensor(64.0))
    assert scaler.get_scale() == 64.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="bogus"), "static"),
        (dict(mode="dynamic", growth_factor=1.0), "growth_factor"),
        (dict(mode="dynamic", backoff_factor=1.5), "backoff_factor"),
        (dict(mode="dynamic", growth_interval=0), "growth_interval"),
        (dict(mode="dynamic", init_scale=float("inf")), "init_scale"),
        (dict(mode="dynamic", min_scale=2.0), "enhanced"),
        (dict(mode="static", min_scale_schedule={1: 2.0}), "enhanced"),
        (dict(mode="enhanced", min_scale=-1.0), "min_scale"),
        (dict(mode="enhanced", min_scale=4.0, min_scale_schedule={10: 2.0}), "only raise"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaler(**kwargs)
    with pytest.raises(ValueError, match=match):
        LossScaleConfig(**kwargs)


def test_bad_mode_lists_valid_modes():
    with pytest.raises(ValueError, match=r"static.*dynamic.*enhanced"):
        LossScaler("dynamc")


def test_from_config_builds_the_same_scaler():
    from lpcompile.runtime.scaler import LossScaleConfig

    config = LossScaleConfig("enhanced", init_scale=2.0**10, min_scale=2.0**4)
    scaler = LossScaler.from_config(config)
    assert scaler.config == config and scaler.mode == "enhanced"
    assert LossScaler.from_config(config, enabled=False).is_enabled() is False
