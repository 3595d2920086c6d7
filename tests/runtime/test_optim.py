"""Tests of lpcompile.runtime.optim.MasterWeightOptimizer."""

from __future__ import annotations

import io

import pytest
import torch

from lpcompile.runtime.optim import MasterWeightOptimizer
from lpcompile.runtime.scaler import LossScaler

DTYPES = [torch.float16, torch.bfloat16]


def _grads(n: int, shape: tuple[int, ...], dtype: torch.dtype, scale: float = 0.1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(shape, generator=gen) * scale).to(dtype) for _ in range(n)]


def _model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(dtype)


def _loss(model: torch.nn.Module, i: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + i)
    x = torch.randn(6, 5, generator=gen).to(next(model.parameters()).dtype)
    return model(x).float().square().mean()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        opt.zero_grad()
        _loss(model, i).backward()
        opt.step()


def _snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_params_stay_16_bit_and_state_is_fp32(dtype):
    model = _model(dtype)
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.Adam, dtype=dtype, lr=1e-2)
    before = _snapshot(model)
    _train(model, opt, range(3))
    assert all(p.dtype == dtype for p in model.parameters())
    assert not _same(before, _snapshot(model))
    states = list(opt.optimizer.state.values())
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
    assert opt.steps == 3
    assert all(s.numel() == 0 for g in opt.optimizer.param_groups for s in g["params"])  # FP32 freed


@pytest.mark.parametrize("dtype", DTYPES)
def test_sgd_equals_fp32_sgd_rounded_to_nearest_each_step(dtype):
    lr, momentum = 0.05, 0.9
    w0 = (torch.randn(64, generator=torch.Generator().manual_seed(0)) + 2.0).to(dtype)
    # Alternate ordinary and tiny gradients: tiny updates are lost in 16 bits but
    # would accumulate in a persistent FP32 master copy.
    grads = [g * (1.0 if i % 2 else 1e-3) for i, g in enumerate(_grads(12, (64,), dtype))]
    p = torch.nn.Parameter(w0.clone())
    opt = MasterWeightOptimizer([p], torch.optim.SGD, dtype=dtype, lr=lr, momentum=momentum)
    for g in grads:
        p.grad = g.clone()
        opt.step()

    w16, buf = w0.clone(), None
    w32, buf32 = w0.float(), None  # a persistent FP32 master, for contrast
    for g in grads:
        g32 = g.float()
        buf = g32.clone() if buf is None else buf.mul(momentum).add(g32)
        w16 = w16.float().add(buf, alpha=-lr).to(dtype)
        buf32 = g32.clone() if buf32 is None else buf32.mul(momentum).add(g32)
        w32 = w32.add(buf32, alpha=-lr)
    assert p.dtype == dtype
    assert torch.equal(p.detach(), w16)
    assert not torch.equal(w16, w32.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_equals_fp32_adam_from_rounded_weights(dtype):
    w0 = torch.randn(32, generator=torch.Generator().manual_seed(2)).to(dtype)
    grads = _grads(6, (32,), dtype)
    p = torch.nn.Parameter(w0.clone())
    opt = MasterWeightOptimizer([p], torch.optim.Adam, dtype=dtype, lr=1e-2, betas=(0.8, 0.9))
    ref = torch.nn.Parameter(w0.float())
    ref_opt = torch.optim.Adam([ref], lr=1e-2, betas=(0.8, 0.9))
    for g in grads:
        p.grad = g.clone()
        opt.step()
        ref.grad = g.float()
        ref_opt.step()
        ref.data = ref.data.to(dtype).float()  # the stored weight is the rounded one
    assert torch.equal(p.detach(), ref.detach().to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_rounding_keeps_tiny_updates_in_expectation(dtype):
    ulp = 2.0 ** (-10 if dtype == torch.float16 else -7)  # spacing in [1, 2)
    steps, n = 200, 256

    def run(rounding: str) -> torch.Tensor:
        a = torch.nn.Parameter(torch.full((n,), 1.5, dtype=dtype))
        b = torch.nn.Parameter(torch.full((n,), 1.5, dtype=dtype))
        opt = MasterWeightOptimizer([a, b], torch.optim.SGD, dtype=dtype, rounding=rounding, seed=3, lr=1.0)
        for _ in range(steps):
            a.grad = torch.full((n,), 0.1 * ulp, dtype=dtype)  # a tenth of an ulp per step
            b.grad = a.grad.clone()
            opt.step()
        return torch.stack([(1.5 - a.detach().float()) / ulp, (1.5 - b.detach().float()) / ulp])

    assert torch.equal(run("nearest"), torch.zeros(2, n))  # RNE: stuck
    moved = run("stochastic")
    assert 19.0 < moved.mean().item() < 21.0  # about 200 * 0.1 ulp
    # Fresh bits at every step and for every parameter: Binomial(200, 0.1) per element.
    assert 3 <= moved.min().item() and moved.max().item() <= 45
    assert not torch.equal(moved[0], moved[1])


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_checkpoint_continuation_is_bit_identical(rounding):
    def make(seed_model: int = 0):
        model = _model(torch.float16, seed_model)
        opt = MasterWeightOptimizer(
            model.parameters(), torch.optim.Adam, rounding=rounding, seed=7, lr=1e-2, weight_decay=1e-3
        )
        return model, opt

    model, opt = make()
    _train(model, opt, range(8))
    straight = _snapshot(model)

    model, opt = make()
    _train(model, opt, range(4))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed_model, resumed_opt = make(seed_model=1)  # different init, overwritten by the checkpoint
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    assert resumed_opt.steps == 4
    _train(resumed_model, resumed_opt, range(4, 8))
    assert _same(straight, _snapshot(resumed_model))


def test_load_state_dict_rejects_other_settings():
    model = _model(torch.float16)
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    other = MasterWeightOptimizer(model.parameters(), torch.optim.SGD, rounding="stochastic", lr=0.1)
    with pytest.raises(ValueError, match="rounding"):
        opt.load_state_dict(other.state_dict())


def test_load_state_dict_checks_the_dict_before_applying_it():
    model = _model(torch.float16)
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"not a MasterWeightOptimizer state dict: it lacks \['optimizer'"):
        opt.load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())
    for key, value in [("seed", 2**40), ("seed", -5), ("steps", -1), ("steps", 2.5)]:
        with pytest.raises(ValueError, match=key):
            opt.load_state_dict({**opt.state_dict(), key: value})
    assert opt.seed == 0 and opt.state_dict()["steps"] == 0


def test_param_groups_and_lr_scheduler_pass_through():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    q = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = MasterWeightOptimizer([{"params": [p]}, {"params": [q], "lr": 0.5}], torch.optim.SGD, lr=0.25)
    assert opt.param_groups[0]["params"] == [p] and opt.param_groups[1]["lr"] == 0.5
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        p.grad = torch.ones(4, dtype=torch.float16)
        q.grad = torch.ones(4, dtype=torch.float16)
        opt.step()
        sched.step()
    assert p.detach().tolist() == [1 - 0.25 - 0.125] * 4
    assert q.detach().tolist() == [1 - 0.5 - 0.25] * 4
    opt.zero_grad()
    assert p.grad is None and q.grad is None
    r = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt.add_param_group({"params": [r], "lr": 1.0})
    r.grad = torch.ones(2, dtype=torch.float16)
    opt.step()
    assert r.detach().tolist() == [0.0, 0.0]
    # a group refused (a parameter already held) is added to neither optimizer
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [r]})
    assert len(opt.param_groups) == len(opt.optimizer.param_groups) == 3
    r.grad = torch.ones(2, dtype=torch.float16)
    opt.step()
    assert r.detach().tolist() == [-1.0, -1.0]
    opt.load_state_dict(opt.state_dict())  # failed: the copies held a group more than the wrapper


def test_param_groups_given_as_generators():
    """``{"params": module.parameters()}`` (a generator) must fill both the FP32 copies
    and the 16-bit group; it used to leave the 16-bit groups empty."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)).half()
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}]
    opt = MasterWeightOptimizer(groups[:1], torch.optim.SGD, lr=0.25)
    opt.add_param_group(groups[1])
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    assert [len(g["params"]) for g in opt.optimizer.param_groups] == [2, 2]
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 3, dtype=torch.float16)).sum().backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_closure_optimizer_lbfgs():
    target = torch.tensor([0.3, -1.2, 2.0])
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt = MasterWeightOptimizer([w], torch.optim.LBFGS, dtype=torch.bfloat16, lr=0.5, max_iter=10)

    def closure():
        opt.zero_grad()
        loss = (w.float() - target).square().sum()
        loss.backward()
        return loss

    first = opt.step(closure).item()
    for _ in range(3):
        opt.step(closure)
    assert w.dtype == torch.bfloat16
    assert closure().item() < 1e-3 * first


def _scaled_run(scaler, dtype: torch.dtype, bad_steps: set[int], unscale: bool = False):
    model = _model(dtype)
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.Adam, dtype=dtype, lr=1e-2)
    history = []
    for i in range(6):
        opt.zero_grad()
        scaler.scale(_loss(model, i)).backward()
        if i in bad_steps:
            model[0].weight.grad[0, 0] = float("inf")
        before, state_before = _snapshot(model), opt.state_dict()
        if unscale:
            scaler.unscale_(opt)
        result = scaler.step(opt)
        skipped = _same(before, _snapshot(model))
        if i in bad_steps:
            assert skipped and result is None
            after = opt.state_dict()
            assert after["steps"] == state_before["steps"]
            for k, v in state_before["optimizer"]["state"].items():
                assert all(torch.equal(v[n], after["optimizer"]["state"][k][n]) for n in v)
        history.append(skipped)
        scaler.update()
    return _snapshot(model), history


@pytest.mark.parametrize("dtype", DTYPES)
def test_with_loss_scaler_skips_and_matches_grad_scaler(dtype):
    kwargs = dict(init_scale=2.0**8, growth_interval=2)
    params, skipped = _scaled_run(LossScaler(**kwargs), dtype, {1, 4})
    assert skipped == [False, True, False, False, True, False]
    ref_params, _ = _scaled_run(torch.amp.GradScaler("cpu", **kwargs), dtype, {1, 4})
    assert _same(params, ref_params)
    unscaled_params, _ = _scaled_run(LossScaler(**kwargs), dtype, {1, 4}, unscale=True)
    assert all(p.dtype == dtype for p in unscaled_params)
    if dtype == torch.bfloat16:  # power-of-two unscaling is exact in bf16's range
        assert _same(params, unscaled_params)


def test_unscales_in_fp32_without_underflow():
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = MasterWeightOptimizer([p], torch.optim.SGD, lr=1.0, momentum=0.5)
    scaler = LossScaler("static", init_scale=2.0**16)
    scaler.scale((p.float() * 2.0**-26).sum()).backward()  # unscaled grad 2**-26 < fp16's min subnormal
    assert p.grad.tolist() == [2.0**-10] * 2
    scaler.step(opt)
    scaler.update()
    buf = next(iter(opt.optimizer.state.values()))["momentum_buffer"]
    assert buf.tolist() == [2.0**-26] * 2


def test_bad_arguments():
    p16 = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    p32 = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="dtype"):
        MasterWeightOptimizer([p16], torch.optim.SGD, dtype=torch.float32, lr=0.1)
    with pytest.raises(TypeError, match="model.to"):
        MasterWeightOptimizer([p32], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="rounding"):
        MasterWeightOptimizer([p16], torch.optim.SGD, rounding="up", lr=0.1)
    with pytest.raises(ValueError, match="seed"):
        MasterWeightOptimizer([p16], torch.optim.SGD, seed=-1, lr=0.1)
