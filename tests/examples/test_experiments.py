"""The loss-scaling experiment's parts: the error-decay model and the table's arithmetic."""

import math

import pytest
import torch

from benchmarks.papers.zhao import table
from examples.experiments import ScalingRun, Scheme, by_variant, worst_underflow
from examples.models import DeepTanhMLP, ScaleBackward, UnnormalizedResNet
from examples.train import TrainResult


def test_scale_backward_is_the_identity_forward_and_scales_the_error():
    x = torch.randn(5, 7, requires_grad=True)
    y = ScaleBackward(2.0**-3)(x)
    assert torch.equal(y, x)
    g = torch.randn(5, 7)
    y.backward(g)
    assert torch.equal(x.grad, g * 2.0**-3)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="factor"):
            ScaleBackward(bad)


def test_error_decay_leaves_the_forward_and_shrinks_the_input_gradient_per_layer():
    torch.manual_seed(0)
    plain = DeepTanhMLP(depth=6, width=16, gain=2.0)
    torch.manual_seed(0)
    decayed = DeepTanhMLP(depth=6, width=16, gain=2.0, error_decay=0.5)
    assert sum(isinstance(m, ScaleBackward) for m in decayed) == 5  # one per hidden layer
    x = torch.randn(4, 64, requires_grad=True)
    grads = []
    for model in (plain, decayed):
        out = model(x)
        out.sum().backward()
        grads.append((out.detach(), x.grad.clone()))
        x.grad = None
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.equal(grads[1][1], grads[0][1] * 0.5**5)


def _run(name, seed, accuracy, underflow, skipped=0):
    result = TrainResult(name, accuracy, 0.5, 1e-3, 0.0, skipped)
    return ScalingRun(name, seed, result, underflow, [1.0] * len(underflow))


def test_the_table_takes_means_over_seeds_and_the_worst_underflow():
    runs = [
        _run("fp32", 0, 95.0, []),
        _run("fixed 2^8", 0, 80.0, [math.nan, 0.5]),
        _run("fp32", 1, 96.0, []),
        _run("fixed 2^8", 1, 90.0, [0.9, 0.2], skipped=2),
    ]
    groups = by_variant(runs)
    assert list(groups) == ["fp32", "fixed 2^8"]
    # a layer that got no non-zero error (NaN) counts as all underflowing
    assert worst_underflow(groups["fixed 2^8"]) == [1.0, 0.5]
    rows = table(runs, steps=10).splitlines()
    assert rows[2] == "| fp32 | 95.50 ± 0.71 | - | - | - | 0.0 |  |"
    # worst layer per seed: 100% and 90%; both layers' worst over the seeds exceed n_uf
    assert rows[3] == "| fixed 2^8 | 85.00 ± 7.07 | 95.00 ± 7.07% | 2 of 2 | 1.0 ± 1.4 of 10 | 0.0 |  |"


def test_schemes_pair_the_graph_setting_with_the_scaler_that_does_the_scaling():
    from examples.experiments import ADAPTIVE, GLOBAL, dynamic, fixed

    assert fixed(12) == Scheme("fixed 2^12", "static", {"init_scale": 2.0**12}, GLOBAL)
    assert dynamic(20).scaler_options == {"growth_interval": 20} and dynamic().graph == GLOBAL
    assert (ADAPTIVE.scaler, ADAPTIVE.graph) == ("adaptive", {})


def test_the_unnormalized_resnet_has_no_norms_and_starts_with_damped_branches():
    torch.manual_seed(0)
    model = UnnormalizedResNet(depth=4)
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    assert not any(isinstance(m, (torch.nn.GroupNorm, torch.nn.BatchNorm2d)) for m in model.modules())
    conv1, conv2 = model.blocks[0].conv1.weight, model.blocks[0].conv2.weight
    assert conv2.abs().max() <= conv1.abs().max() * 4**-0.5 * 1.01  # same uniform bound, halved
    assert all(torch.count_nonzero(block.conv2.bias) == 0 for block in model.blocks)


def test_the_jobs_are_fp32_then_each_schemes_seeds_and_pickle():
    import functools
    import pickle

    from examples.experiments import ADAPTIVE, FORMATS, fixed, loss_scaling_jobs

    model = functools.partial(DeepTanhMLP, width=16)
    jobs = loss_scaling_jobs([fixed(3), ADAPTIVE], model, FORMATS["e4m3"], seeds=(0, 1), interval=10)
    assert [(job.name, job.seed) for job in jobs] == [
        ("fp32", 0),
        ("fp32", 1),
        ("fixed 2^3", 0),
        ("fixed 2^3", 1),
        ("adaptive", 0),
        ("adaptive", 1),
    ]
    assert jobs[0].graph_options() == {}
    assert jobs[2].graph_options() == {
        **FORMATS["e4m3"],
        "executor": "eager",
        "loss_scale_interval": 10,
        "loss_scale_rule": "fixed",
    }

    def fields(job):
        return job.name, job.seed, job.graph_options(), repr(job.model)

    assert [fields(job) for job in pickle.loads(pickle.dumps(jobs))] == [fields(job) for job in jobs]
    assert [j.name for j in loss_scaling_jobs([ADAPTIVE], model, {}, fp32=False)] == ["adaptive"]


@pytest.mark.slow
def test_runs_in_worker_processes_give_the_numbers_of_runs_in_one():
    """Two one-thread workers and this process, one run after another: the same losses,
    accuracies, underflows and scales (only the seconds differ)."""
    import functools

    from examples.data import load_digits
    from examples.experiments import ADAPTIVE, FORMATS, fixed, loss_scaling_jobs, run_jobs

    model = functools.partial(DeepTanhMLP, depth=4, width=32)
    jobs = loss_scaling_jobs(
        [fixed(8), ADAPTIVE], model, FORMATS["e5m2"], seeds=(0, 1), epochs=1, batch_size=256, interval=2
    )

    def numbers(run):
        underflow = [None if math.isnan(u) else u for u in run.underflow]
        result = run.result
        return (
            run.name,
            run.seed,
            result.test_accuracy,
            result.losses,
            result.skipped_steps,
            underflow,
            run.scales,
        )

    data = load_digits()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = [numbers(run) for run in run_jobs(jobs, data, workers=1)]
    finally:
        torch.set_num_threads(threads)
    assert [numbers(run) for run in run_jobs(jobs, data, workers=2)] == here


def test_only_the_fp16_table_puts_the_authors_ssd_numbers_beside_its_rows():
    from benchmarks.papers.zhao import paper_column

    plain, ssd = paper_column(ssd=False), paper_column(ssd=True)
    assert list(plain) == ["adaptive"]
    assert set(ssd) == {"fp32", "fixed 2^0", "fixed 2^3", "fixed 2^7", "fixed 2^8", "adaptive"}
    assert ssd["fixed 2^3"] == "SSD512/VOC mAP: 78.83"
    assert ssd["adaptive"].startswith("SSD512/VOC mAP: 79.27") and ssd["adaptive"].endswith(plain["adaptive"])
    rows = table([_run("fp32", 0, 95.0, []), _run("fp32", 1, 96.0, [])], steps=10, paper=ssd).splitlines()
    assert rows[2].endswith("| SSD512/VOC mAP: 78.94 (FP32 baseline) |")
