"""Pipelined backpropagation: schedule, delays, Spike Compensation, weight prediction.

The chain models multiply a scalar by one weight per stage and the loss is
the output itself, so every number below can be worked out by hand: with
``x_n = n + 1``, ``lr = m = 0.5`` all values are dyadic and exact in FP32.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import pipe_split

from examples.models import MLP, DigitsCNN
from lpcompile.runtime.pipeline import (
    PipelinedTrainer,
    PipelineSGD,
    scale_hyperparameters,
    spike_coefficients,
    stage_delays,
)

# Batch-1 steps gain nothing from threads, and lose much on a busy machine.
pytestmark = pytest.mark.usefixtures("single_thread")


class Chain(nn.Module):
    """``x * w0 * w1 * ...`` with a ``pipe_split()`` between factors: one stage per weight."""

    def __init__(self, *weights: float) -> None:
        super().__init__()
        self.n = len(weights)
        for i, w in enumerate(weights):
            setattr(self, f"w{i}", nn.Parameter(torch.tensor([w])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.w0
        for i in range(1, self.n):
            pipe_split()
            x = x * getattr(self, f"w{i}")
        return x


def output_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.sum()


def chain_trainer(weights, steps: int, **kwargs) -> PipelinedTrainer:
    kwargs = {"lr": 0.5, "momentum": 0.5, "loss_fn": output_loss, "record": True, **kwargs}
    trainer = PipelinedTrainer(Chain(*weights), torch.ones(1), **kwargs)
    for n in range(steps):
        trainer.step(torch.tensor([float(n + 1)]), torch.zeros(1))
    return trainer


def weights(trainer: PipelinedTrainer) -> list[float]:
    return [p.item() for p in trainer.model.parameters()]


# -- the schedule ----------------------------------------------------------------------


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_simulator_realises_the_delay(num_stages):
    """At step t stage s runs the forward of sample t-s and applies the gradient of its
    forward of step t-D_s, for every t once the pipeline is full, and never earlier."""
    assert stage_delays(1) == [0]
    trainer = chain_trainer([0.5] * num_stages, 12, lr=0.0)
    trainer.drain()
    delays = stage_delays(num_stages)
    assert delays == [2 * (num_stages - 1 - s) for s in range(num_stages)] == trainer.delays
    assert [g["delay"] for g in trainer.optimizer.param_groups] == delays
    forwards = [e for e in trainer.history if e.kind == "forward"]
    backwards = [e for e in trainer.history if e.kind == "backward"]
    assert all(e.sample == e.step - e.stage for e in forwards)
    assert all(e.step - e.forward_step == delays[e.stage] for e in backwards)
    for s in range(num_stages):
        steps = [e.step for e in backwards if e.stage == s]
        # one backward per step from step D_s + s (sample 0) until the last sample's
        assert steps == list(range(delays[s] + s, delays[s] + s + 12))
    # every stage steps its weights exactly when it has a gradient
    assert len(trainer.losses) == 12


# -- hand-computed runs ------------------------------------------------------------------
#
# Two stages, w = (1, 2), D = (2, 0), loss = output, lr = m = 0.5, x_n = n + 1.
#   step 0: h0 = w0*x0 = 1.
#   step 1: h1 = 2; stage 1: y0 = w1*h0 = 2, g_w1 = h0 = 1, error to stage 0 = w1 = 2;
#           v1 = 1, w1 = 2 - 0.5*1 = 1.5.
#   step 2: h2 = 3; stage 0 gets sample 0's error: g_w0 = 2*x0 = 2, v0 = 2, w0 = 1 - 1 = 0;
#           stage 1: y1 = 1.5*2 = 3, g_w1 = 2, error 1.5; v1 = 0.5 + 2 = 2.5, w1 = 1.5 - 1.25 = 0.25.
#   step 3: h3 = 0*4 = 0; stage 0: g_w0 = 1.5*x1 = 3, v0 = 1 + 3 = 4, w0 = 0 - 2 = -2;
#           stage 1: y2 = 0.25*3 = 0.75, g_w1 = 3, v1 = 1.25 + 3 = 4.25, w1 = 0.25 - 2.125 = -1.875.


def test_two_stages_plain_pb_by_hand():
    trainer = chain_trainer([1.0, 2.0], 4)
    assert trainer.losses == [2.0, 3.0, 0.75]
    assert weights(trainer) == [-2.0, -1.875]
    assert [trainer.optimizer.state[p]["momentum_buffer"].item() for p in trainer.model.parameters()] == [
        4.0,
        4.25,
    ]


def test_two_stages_spike_compensation_by_hand():
    # D_0 = 2, m = 0.5: a = 0.25, b = (1 - 0.25)/0.5 = 1.5 (stage 1 has D = 0: a = 1, b = 0).
    # step 2: v0 = 2, w0 = 1 - 0.5*(0.25*2 + 1.5*2) = -0.75
    # step 3: h3 = -0.75*4 = -3 (not seen by a loss yet); v0 = 1 + 3 = 4,
    #         w0 = -0.75 - 0.5*(0.25*4 + 1.5*3) = -3.5
    assert spike_coefficients(0.5, 2) == (0.25, 1.5)
    trainer = chain_trainer([1.0, 2.0], 4, spike_compensation=True)
    assert weights(trainer) == [-3.5, -1.875]
    trainer.step(None)  # stage 1 now sees h3 = -3: y3 = w1*h3 = -1.875*-3
    assert trainer.losses[-1] == 5.625


def test_two_stages_lwp_v_by_hand():
    # Stage 0 reads w0 - lr*2*v0. v0 = 0 until step 2 (h0..h2 as without prediction), then
    # step 2: v0 = 2, w0 = 0; step 3: forward reads 0 - 0.5*2*2 = -2, h3 = -8;
    #         update v0 = 4, w0 = -2; step 4: forward reads -2 - 0.5*2*4 = -6.
    trainer = chain_trainer([1.0, 2.0], 4, prediction="lwp_v")
    assert trainer.losses == [2.0, 3.0, 0.75]
    assert weights(trainer) == [-2.0, -1.875]
    w0 = trainer.model.w0
    assert trainer.optimizer.predicted_weight(w0).item() == -6.0
    assert trainer.optimizer.predicted_weight(trainer.model.w1).item() == -1.875  # D = 0
    trainer.step(None)
    assert trainer.losses[-1] == -1.875 * -8.0  # stage 1 used h3 = -2*4


def test_two_stages_lwp_w_by_hand():
    # Stage 0 reads w0 + 2*(w0 - w0_prev): w0 goes 1 -> 0 at step 2, so step 3 reads
    # 0 + 2*(0 - 1) = -2 (h3 = -8); w0 goes 0 -> -2 at step 3, step 4 reads -2 + 2*(-2) = -6.
    trainer = chain_trainer([1.0, 2.0], 4, prediction="lwp_w")
    assert weights(trainer) == [-2.0, -1.875]
    assert trainer.optimizer.predicted_weight(trainer.model.w0).item() == -6.0
    trainer.step(None)
    assert trainer.losses[-1] == -1.875 * -8.0


# Three stages, w = (1, 2, 3), D = (4, 2, 0). Stage 1's backward multiplies the error by
# w1, which changes between its forward and its backward from step 3 on:
#   step 2: y0 = 3*2 = 6; w2: v2 = 2, w2 = 2.
#   step 3: stage 1, sample 0: g_w1 = 3*a0 = 3, error 3*w1 = 6 (w1 = 2 either way);
#           v1 = 3, w1 = 0.5. Stage 2: y1 = 2*4 = 8, error 2; v2 = 5, w2 = -0.5.
#   step 4: stage 0, sample 0: g_w0 = 6*x0 = 6, v0 = 6, w0 = -2.
#           stage 1, sample 1: g_w1 = 2*a1 = 4; error 2*w1 with w1 = 0.5 now (real PB) -> 1,
#           or w1 = 2 of its forward at step 2 (weight stash) -> 4. v1 = 5.5, w1 = -2.25.
#   step 5: stage 0, sample 1: g_w0 = 1*x1 = 2 (real) or 4*x1 = 8 (stash);
#           v0 = 3 + 2 = 5, w0 = -2 - 2.5 = -4.5 (real) or v0 = 11, w0 = -7.5 (stash).


@pytest.fixture(scope="module")
def three_stage_pb():
    return chain_trainer([1.0, 2.0, 3.0], 6)


def test_three_stages_real_pb_and_weight_stash_by_hand(three_stage_pb):
    real = three_stage_pb
    stash = chain_trainer([1.0, 2.0, 3.0], 6, weight_stash=True)
    assert real.losses[:3] == stash.losses[:3] == [6.0, 8.0, -3.0]
    assert real.model.w0.item() == -4.5
    assert stash.model.w0.item() == -7.5
    # stage 1's own gradient (error * a_n) does not read w1: the same in both; at step 5
    # g_w1 = -0.5*a2 = -1.5, v1 = 2.75 - 1.5 = 1.25, w1 = -2.25 - 0.625
    assert real.model.w1.item() == stash.model.w1.item() == -2.875


def test_three_stages_lwp_v_predicted_weights_by_hand(three_stage_pb):
    # Stage 1 (D = 2) at step 4 reads w1 - 0.5*2*v1 = 0.5 - 3 = -2.5, so b3 = -2.5*a3 = -10
    # (stage 0, D = 4, still reads w0 = 1 at step 3: v0 = 0 until step 4).
    # Stage 2 (D = 0) reads w2 = -4.75 at step 5 (w2: 2 -> -0.5 -> -4.75, as without
    # prediction, since b0, b1, b2 are unchanged), so y3 = -4.75 * -10 = 47.5.
    trainer = chain_trainer([1.0, 2.0, 3.0], 6, prediction="lwp_v")
    plain = three_stage_pb
    assert trainer.losses[:3] == plain.losses[:3] == [6.0, 8.0, -3.0]
    assert plain.losses[3] == -4.75 * 2.0
    assert trainer.losses[3] == 47.5


class ScalarPipeline:
    """An independent reference: PB written from the schedule, in Python floats.

    Sample n is at stage s at step n + s (forward) and n + 2(S-1) - s (backward).
    """

    def __init__(self, w, lr, m, sc=False, prediction="none", stash=False):
        self.w, self.v = list(w), [None] * len(w)
        self.prev = list(w)
        self.lr, self.m, self.sc, self.pred, self.stash = lr, m, sc, prediction, stash
        self.S = len(w)
        self.D = [2 * (self.S - 1 - s) for s in range(self.S)]

    def forward_weight(self, s):
        d, v = self.D[s], self.v[s] or 0.0
        if self.pred == "lwp_v" and d:
            return self.w[s] - (self.lr * d) * v
        if self.pred == "lwp_w" and d:
            return self.w[s] + d * (self.w[s] - self.prev[s])
        return self.w[s]

    def run(self, xs, steps):
        S, acts, fw, errs, losses = self.S, {}, {}, {}, []
        for t in range(steps):
            grads = [None] * S
            new_errs = {}
            for s in range(S):
                n = t - s
                if 0 <= n < len(xs):
                    x = xs[n] if s == 0 else acts[(n, s - 1)]
                    fw[(n, s)] = self.forward_weight(s)
                    acts[(n, s)] = fw[(n, s)] * x
                    acts[(n, s, "in")] = x
                n = t - 2 * (S - 1) + s
                if 0 <= n < len(xs):
                    e = 1.0 if s == S - 1 else errs[(n, s)]
                    if s == S - 1:
                        losses.append(acts[(n, s)])
                    grads[s] = e * acts[(n, s, "in")]
                    w_bwd = fw[(n, s)] if self.stash else self.w[s]
                    if s > 0:
                        new_errs[(n, s - 1)] = e * w_bwd
            errs.update(new_errs)
            for s in range(S):
                g = grads[s]
                if g is None:
                    continue
                self.prev[s] = self.w[s]
                self.v[s] = g if self.v[s] is None else self.m * self.v[s] + g
                a, b = (self.m ** self.D[s], (1 - self.m ** self.D[s]) / (1 - self.m)) if self.sc else (1, 0)
                self.w[s] = self.w[s] - self.lr * (a * self.v[s] + b * g)
        return losses


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"spike_compensation": True},
        {"prediction": "lwp_v"},
        {"prediction": "lwp_w"},
        {"spike_compensation": True, "prediction": "lwp_v"},
        {"weight_stash": True},
    ],
    ids=["pb", "sc", "lwp_v", "lwp_w", "sc+lwp_v", "stash"],
)
def test_matches_scalar_reference(kwargs):
    w0 = [0.9, -0.7, 1.1, 0.8]
    xs = [math.sin(n + 1.0) for n in range(10)]
    trainer = PipelinedTrainer(
        Chain(*w0), torch.ones(1), lr=0.05, momentum=0.75, loss_fn=output_loss, **kwargs
    )
    for x in xs:
        trainer.step(torch.tensor([x]), torch.zeros(1))
    trainer.drain()
    ref = ScalarPipeline(
        w0,
        0.05,
        0.75,
        sc=kwargs.get("spike_compensation", False),
        prediction=kwargs.get("prediction", "none"),
        stash=kwargs.get("weight_stash", False),
    )
    expected = ref.run(xs, trainer.steps)
    assert trainer.losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert weights(trainer) == pytest.approx(ref.w, rel=1e-5, abs=1e-6)


# -- S = 1 is SGD ----------------------------------------------------------------------------


def test_one_stage_is_sgd_bit_for_bit():
    torch.manual_seed(0)
    xs, ys = torch.rand(40, 1, 8, 8), torch.randint(0, 10, (40,))
    pipelined = DigitsCNN(width=8)
    reference = DigitsCNN(width=8)
    reference.load_state_dict(pipelined.state_dict())
    trainer = PipelinedTrainer(
        pipelined,
        xs[:1],
        stages=1,
        lr=0.01,
        momentum=0.9,
        spike_compensation=True,
        prediction="lwp_v",
    )
    assert trainer.delays == [0]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)
    for i in range(40):
        x, y = xs[i : i + 1], ys[i : i + 1]
        loss = trainer.step(x, y)
        optimizer.zero_grad()
        expected = F.cross_entropy(reference(x), y)
        expected.backward()
        optimizer.step()
        assert loss == expected.item()
    for p, q in zip(pipelined.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_lr_zero_pipeline_computes_the_model():
    """With frozen weights the pipelined losses are the model's, sample by sample."""
    torch.manual_seed(0)
    model = MLP(64, 32, 32, 32, 10)
    xs, ys = torch.rand(9, 1, 8, 8), torch.randint(0, 10, (9,))
    trainer = PipelinedTrainer(model, xs[:1], stages="layer", lr=0.0)
    assert trainer.num_stages == 4
    trainer.fit(xs, ys, seed=3)
    order = torch.randperm(9, generator=torch.Generator().manual_seed(3)).tolist()
    expected = [F.cross_entropy(model(xs[i : i + 1]), ys[i : i + 1]).item() for i in order]
    assert trainer.losses == pytest.approx(expected, rel=1e-6)


def test_several_inputs_reach_the_model_in_argument_order():
    """Dynamo orders input placeholders by first use: a model that reads its second
    argument first used to get its inputs swapped (silently, same shapes); an unused
    argument is dropped, and a sample of another shape is refused with the reason."""

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 4)

        def forward(self, x, unused, scale):
            s = scale * 2.0 + 1.0
            h = torch.relu(self.a(x)) * s
            pipe_split()
            return self.b(h)

    torch.manual_seed(0)
    model = TwoInputs()
    samples = [(torch.randn(1, 3), torch.zeros(1), torch.rand(1, 3)) for _ in range(4)]
    ys = torch.randint(0, 4, (4,))
    trainer = PipelinedTrainer(model, samples[0], lr=0.0)
    for sample, y in zip(samples, ys, strict=True):
        trainer.step(sample, y[None])
    trainer.drain()
    expected = [F.cross_entropy(model(*s), y[None]).item() for s, y in zip(samples, ys, strict=True)]
    assert trainer.losses == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="traced for inputs of shapes"):
        trainer.step((torch.randn(4, 3), torch.zeros(1), torch.rand(1, 3)), ys)


# -- the optimizer -----------------------------------------------------------------------


def test_spike_coefficients():
    assert spike_coefficients(0.9, 0) == (1.0, 0.0)
    a, b = spike_coefficients(0.9, 6)
    assert a == pytest.approx(0.9**6) and b == pytest.approx(sum(0.9**k for k in range(6)))
    assert spike_coefficients(0.0, 3) == (0.0, 1.0)
    assert spike_coefficients(1.0, 3) == (1.0, 3.0)
    # a delayed gradient moves the weights by lr*g/(1-m) in total, as an undelayed one does
    assert a + b + a * sum(0.9**k for k in range(1, 2000)) == pytest.approx(1 / (1 - 0.9))


def test_scale_hyperparameters():
    assert scale_hyperparameters(0.1, 0.9, 32, 1) == pytest.approx((0.1 / 32, 0.9 ** (1 / 32)))
    assert scale_hyperparameters(0.1, 0.9, 32, 32) == (0.1, 0.9)
    with pytest.raises(ValueError):
        scale_hyperparameters(0.1, 0.9, 0, 1)


def test_pipeline_sgd_without_delay_is_torch_sgd():
    torch.manual_seed(0)
    a = [torch.randn(5, requires_grad=True), torch.randn(3, 2, requires_grad=True)]
    b = [t.detach().clone().requires_grad_() for t in a]
    ours = PipelineSGD(a, lr=0.1, momentum=0.9, weight_decay=0.01)
    theirs = torch.optim.SGD(b, lr=0.1, momentum=0.9, weight_decay=0.01)
    for _ in range(5):
        grads = [torch.randn_like(t) for t in a]
        for p, q, g in zip(a, b, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)


def test_pipeline_sgd_validates_and_serves_prediction_inputs():
    p = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="prediction must be one of"):
        PipelineSGD([p], lr=0.1, prediction="lwp")
    with pytest.raises(ValueError, match="delay"):
        PipelineSGD([p], lr=0.1, delay=-1)
    opt = PipelineSGD([{"params": [p], "delay": 3}], lr=0.25, momentum=0.5, prediction="lwp_v")
    inputs = opt.prediction_inputs(p)
    assert inputs.delay == 3 and inputs.lr.item() == 0.25 and torch.equal(inputs.buffer, torch.zeros(3))
    p.grad = torch.full((3,), 2.0)
    opt.step()  # v = 2, w = 1 - 0.5 = 0.5
    assert torch.equal(opt.predicted_weight(p), torch.full((3,), 0.5 - 0.25 * 3 * 2.0))
    opt.param_groups[0]["lr"] = 0.5  # a schedule: the lr input follows
    assert opt.prediction_inputs(p).lr.item() == 0.5


def test_a_prediction_the_optimizer_keeps_no_buffer_for_is_refused():
    """A graph compiled for lwp_w reads w_(t-1), which only a group with
    prediction="lwp_w" keeps; lwp_v without momentum reads a velocity only
    prediction="lwp_v" keeps. Both used to "predict" w itself, silently."""
    p = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="prediction='lwp_w'"):
        PipelineSGD([p], lr=0.1, momentum=0.9).prediction_inputs(p, "lwp_w")
    with pytest.raises(ValueError, match="prediction='lwp_v'"):
        PipelineSGD([p], lr=0.1).prediction_inputs(p, "lwp_v")
    assert PipelineSGD([p], lr=0.1, momentum=0.9).prediction_inputs(p, "lwp_v").mode == "lwp_v"


def test_the_lr_input_stays_fp32_through_a_checkpoint():
    p = nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = PipelineSGD([{"params": [p], "delay": 2}], lr=0.1, momentum=0.9, prediction="lwp_v")
    p.grad = torch.ones(3, dtype=torch.float16)
    opt.step()
    assert opt.prediction_inputs(p).lr.dtype == torch.float32
    fresh = PipelineSGD([{"params": [p], "delay": 2}], lr=0.1, momentum=0.9, prediction="lwp_v")
    fresh.load_state_dict(opt.state_dict())
    assert fresh.prediction_inputs(p).lr.dtype == torch.float32


def test_predict_weight_needs_a_buffer_of_the_weights_dtype():
    w = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="buffer torch.float32"):
        torch.ops.lowprec.predict_weight(w, torch.ones(3), torch.tensor(0.1), 2, "lwp_v")


# -- errors ---------------------------------------------------------------------------------


def test_batchnorm_is_refused_with_advice():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 10))
    with pytest.raises(ValueError, match="GroupNorm"):
        PipelinedTrainer(model, torch.rand(1, 1, 8, 8), stages=2, lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"lr": float("nan")}, "lr"),
        ({"lr": float("inf")}, "lr"),
        ({"lr": "0.1"}, "lr"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"momentum": "0.9"}, "momentum"),
        ({"spike_compensation": "false"}, "spike_compensation"),
    ],
)
def test_bad_hyperparameters_are_refused_by_name(kwargs, named):
    p = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=f"^{named} must be"):
        PipelineSGD([p], **{"lr": 0.1, **kwargs})


def test_trainer_checks_its_loss_scale_and_compile_options_up_front():
    model, x = MLP(64, 16, 16, 10), torch.rand(1, 64)
    for scale in (0.0, float("nan")):
        with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
            PipelinedTrainer(model, x, stages=2, lr=0.1, loss_scale=scale)
    with pytest.raises(ValueError, match="unknown recipe 'fp9'"):
        PipelinedTrainer(model, x, stages=2, lr=0.1, compile={"recipe": "fp9"})
    with pytest.raises(ValueError, match="must not set 'pipeline'"):
        PipelinedTrainer(model, x, stages=2, lr=0.1, compile={"pipeline": {"stages": 0}})
    with pytest.raises(ValueError, match=r"batch dimension 1\), got batch sizes \[4\]"):
        PipelinedTrainer(model, torch.rand(4, 64), stages=2, lr=0.1)
    with pytest.raises(ValueError, match="weight_stash must be a bool"):
        PipelinedTrainer(model, x, stages=2, lr=0.1, weight_stash="yes")


def test_a_weight_read_by_two_stages_is_refused_by_its_name():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            h = torch.relu(self.a(x))
            pipe_split()
            return self.a(h)

    with pytest.raises(ValueError, match=r"^a.weight is read by stages \[0, 1\].* tie_word_embeddings=False"):
        PipelinedTrainer(Tied(), torch.rand(1, 4), lr=0.1)


def test_fit_checks_its_data_and_feeds_tuples():
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 4)

        def forward(self, x, z):
            h = torch.relu(self.a(x + z))
            pipe_split()
            return self.b(h)

    torch.manual_seed(0)
    model = TwoInputs()
    x, z, y = torch.randn(6, 3), torch.randn(6, 3), torch.randint(0, 4, (6,))
    trainer = PipelinedTrainer(model, (x[:1], z[:1]), lr=0.0)
    losses = trainer.fit((x, z), y, seed=1)
    order = torch.randperm(6, generator=torch.Generator().manual_seed(1)).tolist()
    expected = [F.cross_entropy(model(x[i : i + 1], z[i : i + 1]), y[i : i + 1]).item() for i in order]
    assert losses == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match=r"as many samples, got \[6, 5\] and 6"):
        trainer.fit((x, z[:5]), y)
    with pytest.raises(ValueError, match="epochs must be an int >= 0"):
        trainer.fit((x, z), y, epochs=-1)


def test_a_mode_change_after_tracing_is_refused():
    """The stage graphs keep the train()/eval() behaviour they were traced with: stepping
    an eval()-mode model used to go on applying dropout (or, traced in eval(), never)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3))
    trainer = PipelinedTrainer(model, torch.rand(1, 4), stages="layer", lr=0.1)
    trainer.step(torch.rand(1, 4), torch.tensor([1]))
    model.eval()
    with pytest.raises(RuntimeError, match=r"train\(\)/eval\(\) modes changed"):
        trainer.step(torch.rand(1, 4), torch.tensor([1]))
    model.train()
    trainer.step(torch.rand(1, 4), torch.tensor([2]))
    trainer.drain()
    assert len(trainer.losses) == 2


def _dropout_losses(seed: int | None, global_seed: int) -> tuple[list[float], PipelinedTrainer]:
    """A run of a three-stage MLP with dropout in two stages, torch's global generator
    seeded with ``global_seed`` after the model is built."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8),
        nn.Dropout(0.5),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.Dropout(0.5),
        nn.ReLU(),
        nn.Linear(8, 3),
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    torch.manual_seed(global_seed)
    trainer = PipelinedTrainer(model, x[:1], stages="layer", lr=0.1, seed=seed)
    return trainer.fit(x, y), trainer


def test_stages_draw_dropout_from_streams_of_their_own():
    """Each stage draws its dropout masks from its own stream (seeded from ``seed`` and the
    stage), not from torch's global generator, which the trainer leaves as it found it: so
    ranks, each with its own global generator, draw what the simulator draws."""
    first, trainer = _dropout_losses(seed=5, global_seed=5)
    x, y = torch.randn(2, 4), torch.tensor([0, 2])
    before = torch.get_rng_state()
    trainer.fit(x, y)
    assert torch.equal(torch.get_rng_state(), before)
    assert _dropout_losses(seed=5, global_seed=6)[0] == first
    assert _dropout_losses(seed=None, global_seed=5)[0] == first  # the default: torch.initial_seed()
    assert _dropout_losses(seed=6, global_seed=5)[0] != first
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        _dropout_losses(seed=-1, global_seed=5)


def test_stage_count_errors():
    with pytest.raises(ValueError, match="stages must be"):
        PipelinedTrainer(MLP(64, 16, 16, 10), torch.rand(1, 64), stages=True, lr=0.1)
    with pytest.raises(ValueError, match="only 3 layers"):
        PipelinedTrainer(MLP(64, 16, 16, 10), torch.rand(1, 64), stages=5, lr=0.1)
    with pytest.raises(ValueError, match="pipe_split"):
        PipelinedTrainer(Chain(1.0, 2.0), torch.ones(1), stages=3, lr=0.1, loss_fn=output_loss)


def test_buffers_and_frozen_parameters_ride_along():
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)
            self.register_buffer("shift", torch.arange(4.0))
            self.b.bias.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.a(x) + self.shift)
            pipe_split()
            return self.b(h)

    torch.manual_seed(0)
    model = WithBuffer()
    xs, ys = torch.randn(5, 4), torch.randint(0, 3, (5,))
    frozen = model.b.bias.detach().clone()
    trainer = PipelinedTrainer(model, xs[:1], lr=0.0)
    assert [len(s.params) for s in trainer.stages] == [2, 1]
    trainer.fit(xs, ys, seed=2)
    order = torch.randperm(5, generator=torch.Generator().manual_seed(2)).tolist()
    expected = [F.cross_entropy(model(xs[i : i + 1]), ys[i : i + 1]).item() for i in order]
    assert trainer.losses == pytest.approx(expected, rel=1e-6)
    trainer.optimizer.param_groups[0]["lr"] = 0.1
    trainer.fit(xs, ys)
    assert torch.equal(model.b.bias, frozen) and torch.equal(model.shift, torch.arange(4.0))


def test_static_loss_scale_is_undone_before_the_update():
    plain = chain_trainer([0.9, -0.7, 1.1], 7)
    scaled = chain_trainer([0.9, -0.7, 1.1], 7, loss_scale=1024.0)
    assert scaled.losses == plain.losses  # the loss is reported unscaled
    assert weights(scaled) == weights(plain)  # power-of-two scaling is exact


def test_a_model_without_markers_and_no_stage_count_warns_that_nothing_is_pipelined():
    with pytest.warns(UserWarning, match="no pipe_split\\(\\) markers: the pipeline has one stage"):
        trainer = PipelinedTrainer(MLP(4, 8, 3), torch.randn(1, 4), lr=0.1)
    assert trainer.num_stages == 1
