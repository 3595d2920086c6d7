"""Pipelined backpropagation on torch.distributed ranks (gloo, CPU, ranks spawned here).

The ranks run what the simulator runs, so their results are compared bit for bit with
the simulator's in this process: same model, seed, sample order and stage split, one
thread per process. Faults: a rank killed (or stopped) mid-run ends the run on every
rank within the timeout, each naming the lost rank. A drained run saved per rank and
resumed in fresh processes equals the uninterrupted run.

Two ranks in the fast tier (each launch a few seconds: the ranks fork from a server
that imported torch and lpcompile once); four ranks, Inductor-compiled FP8 stages,
adaptive loss scaling and hangs in the slow tier.
"""

from __future__ import annotations

import pytest
import torch
from pipeline_ranks import CASES, launch, reports, resumable, train
from torch.distributed.pipelining import pipe_split

from lpcompile.runtime.pipeline import PipelinedTrainer
from lpcompile.runtime.pipeline.distributed import Layout, check_world_size
from lpcompile.runtime.pipeline.schedule import TensorMeta, conform, message_meta

pytestmark = pytest.mark.usefixtures("single_thread")  # as each rank: the same bits

FAST = [
    "pb",
    "sc-lwpv",
    "fp8-sr",
    "fp8-sr-dynamic",
    "fp8-als-overflow",
    "fp8-als-calibrate",
    "fp8-sr-dropout",
]
SLOW = [case for case in CASES if case not in FAST]


def _simulated(cases: list[str]) -> dict[str, dict]:
    return {case: train(case, distributed=False) for case in cases}


def _check_ranks_ran(folder, world: int) -> None:
    found = reports(folder, world)
    failed = [(rank, r and r.get("traceback")) for rank, r in enumerate(found) if not (r and r["ok"])]
    assert not failed, failed


def _assert_same_run(case: str, world: int, folder, simulated: dict) -> None:
    expected = simulated[case]
    for rank in range(world):
        got = torch.load(folder / f"{case}-rank{rank}.pt")
        assert list(got["state"]) == list(expected["state"])
        differ = [k for k, v in expected["state"].items() if not torch.equal(v, got["state"][k])]
        assert not differ, f"{case}, rank {rank} of {world}: {differ} differ from the simulator's"
        assert got["steps"] == expected["steps"]
    last = torch.load(folder / f"{case}-rank{world - 1}.pt")
    assert last["losses"] == expected["losses"] and len(last["losses"]) == 24
    # every stage graph was called as often as in the simulator: the same call counts,
    # under the same model digests, spread over the ranks
    runs = [torch.load(folder / f"{case}-rank{r}.pt") for r in range(world)]
    assert sorted(s for run in runs for s in run["streams"]) == sorted(expected["streams"])
    # each rank holds its stages' loss scales: together, the simulator's
    # and its stages' layers' adaptive scales
    for key in ("loss_scales", "skipped", "calibration", "adaptive"):
        assert {k: v for run in runs for k, v in run[key].items()} == expected[key]
    if case.endswith("dynamic"):  # the scales moved apart: each stage overflowed on its own
        assert len(set(expected["loss_scales"].values())) > 1 and all(expected["skipped"].values())
    if case.endswith("overflow"):  # checked and skipped without per-stage scales, scales lowered
        assert set(expected["loss_scales"].values()) == {1.0} and any(expected["skipped"].values())
        assert all(scale < 2**20 for scale, _, _ in expected["adaptive"].values())
    if case.endswith("calibrate"):  # skipped while the scales rose, in more than one stage
        assert sum(count > 0 for count in expected["calibration"].values()) > 1
        assert expected["calibration"] == expected["skipped"]
    if "sr" in case:
        assert len(expected["streams"]) == 4  # one model per stage: each counts its own calls


def _run_cases(tmp_path, world: int, cases: list[str]) -> None:
    codes = launch("rank_train", world, tmp_path, cases, deadline=600)
    _check_ranks_ran(tmp_path, world)
    assert codes == [0] * world
    simulated = _simulated(cases)
    for case in cases:
        _assert_same_run(case, world, tmp_path, simulated)


def test_two_ranks_equal_the_simulator_bit_for_bit(tmp_path):
    """Plain PB, PB+SC+LWP^v, PB+SC+LWP^v with FP8 (E5M2, stochastic rounding) stages,
    FP8 stages with dynamic loss scales, with per-layer adaptive scales that start where the
    errors overflow or underflow, and with dropout in every stage: four stages on two ranks (two
    contiguous stages each)."""
    _run_cases(tmp_path, 2, FAST)


@pytest.mark.slow
def test_four_ranks_equal_the_simulator_bit_for_bit(tmp_path):
    """One stage per rank; also LWP^w with weight stashing, Inductor-compiled FP8 stages
    with stochastic rounding (and with dropout), with tensorwise, rowwise and MX scaling, and
    FP8 with per-layer adaptive loss scaling."""
    _run_cases(tmp_path, 4, FAST + SLOW)


@pytest.mark.slow
def test_two_ranks_with_inductor_and_adaptive_scaling_equal_the_simulator(tmp_path):
    _run_cases(tmp_path, 2, SLOW)


# -- faults ---------------------------------------------------------------------------------


def _fault(tmp_path, world: int, victim: int, how: str, timeout: float) -> None:
    deadline = 90.0
    codes = launch("rank_fault", world, tmp_path, victim, how, timeout, deadline=deadline, victim=victim)
    assert all(code is not None for r, code in enumerate(codes) if r != victim), codes
    fault = float((tmp_path / "fault-time").read_text())
    found = reports(tmp_path, world)
    for rank, report in enumerate(found):
        if rank == victim:
            assert report is None  # it never got to report
            continue
        assert report is not None and not report["ok"], (rank, report)
        assert report["type"] == "LostRankError", report["traceback"]
        assert report["lost"] == victim, report["message"]
        assert f"rank {victim} (stage" in report["message"]
        assert report["time"] - fault < timeout + 3.0, (rank, report["time"] - fault)


def test_a_killed_rank_ends_the_run_on_every_rank(tmp_path):
    _fault(tmp_path, 2, victim=1, how="kill", timeout=30.0)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 2])
def test_a_killed_rank_of_four_is_named_by_every_rank(tmp_path, victim):
    _fault(tmp_path, 4, victim=victim, how="kill", timeout=30.0)


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_within_the_timeout(tmp_path):
    """Rank 2 stops (SIGSTOP): ranks 1 and 3 time out waiting for it; rank 0, which waits
    for rank 1, follows the recorded waits to rank 2."""
    _fault(tmp_path, 4, victim=2, how="stop", timeout=4.0)


class IdleSecondStage(torch.nn.Module):
    """Four stages, the second without parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        pipe_split()
        h = torch.tanh(h)
        pipe_split()
        h = self.b(h)
        pipe_split()
        return self.c(h)


def test_a_world_size_that_does_not_fit_is_refused_before_any_work(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: joining would fail, not refuse
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    message = r"3 ranks cannot run a pipeline of 4 stages: .* must divide 4 \(use 1, 2, 4 ranks"
    with pytest.raises(ValueError, match=message):
        PipelinedTrainer(model, torch.randn(1, 4), stages=4, lr=0.1, distributed=True)
    # stages known only from the graph: refused after the (local) capture, still before joining
    with pytest.raises(ValueError, match=r"3 ranks cannot run a pipeline of 2 stages"):
        PipelinedTrainer(model, torch.randn(1, 4), stages="layer", lr=0.1, distributed=True)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match=r"8 ranks cannot run a pipeline of 4 stages"):
        PipelinedTrainer(model, torch.randn(1, 4), stages=4, lr=0.1, distributed=True)
    assert check_world_size(2, 4) == 2 and check_world_size(4, 4) == 1
    # a rank whose stages hold no trained parameter: every rank failed building its optimizer
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"ranks \[1\] would run stages \[\[1\]\], which hold no trained"):
        PipelinedTrainer(IdleSecondStage(), torch.randn(1, 4), lr=0.1, distributed=True, setup_timeout=5.0)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="torchrun's environment \\(missing MASTER_PORT\\)"):
        PipelinedTrainer(model, torch.randn(1, 4), stages=2, lr=0.1, distributed=True)


# -- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_drain_save_and_resume_in_fresh_processes_equals_the_uninterrupted_run(tmp_path, world):
    """The uninterrupted run (drained at the same point) is the simulator's, which the
    ranks equal bit for bit (tested above). A bad state dict changes nothing: a rank's
    weights loaded before the adaptive states were checked."""
    case = "fp8-sr-dropout"  # stochastic rounding and dropout: call counts and streams resume
    for phase in ("first", "rest", "rest-old", "rest-unseeded"):
        assert launch("rank_resume", world, tmp_path, case, phase, deadline=300) == [0] * world, phase
        _check_ranks_ran(tmp_path, world)
    full = resumable(case, "full", False, tmp_path)
    for rank in range(world):
        rest = torch.load(tmp_path / f"rest-rank{rank}.pt")
        differ = [k for k, v in full.items() if not torch.equal(v, rest[k])]
        assert not differ, f"rank {rank}: {differ}"
    # resumed without the call counts, stochastic rounding draws other bits, and with the
    # random streams at their start, dropout: the check can fail
    for phase in ("rest-old", "rest-unseeded"):
        other = torch.load(tmp_path / f"{phase}-rank{world - 1}.pt")
        assert not all(torch.equal(v, other[k]) for k, v in full.items()), phase


# -- the example --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_digits_resnet_example_on_ranks_equals_its_simulation(tmp_path, world):
    """examples/pipeline_distributed.py: the ResNet's skip connections cross stage (and
    rank) boundaries, two values per message; a short run with per-stage loss scales,
    compared with --simulate."""
    from examples.pipeline_distributed import main

    argv = ["--epochs", "1", "--samples", "60", "--loss-scale", "dynamic"]
    assert (
        launch("rank_example", world, tmp_path, [*argv, "--weights", str(tmp_path / "ranks.pt")])
        == [0] * world
    )
    _check_ranks_ran(tmp_path, world)
    assert main([*argv, "--simulate", "--weights", str(tmp_path / "simulated.pt")]) == 0
    ranks, simulated = torch.load(tmp_path / "ranks.pt"), torch.load(tmp_path / "simulated.pt")
    assert list(ranks) == list(simulated)
    assert [k for k, v in simulated.items() if not torch.equal(v, ranks[k])] == []


# -- messages ----------------------------------------------------------------------------------


def test_messages_keep_their_layout_and_say_which_gradients_are_missing():
    channels_last = torch.randn(1, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    values = [channels_last, torch.arange(6).reshape(2, 3), torch.randn(7).double(), torch.randn(3, 4).t()]
    metas = [message_meta(v) for v in values]
    assert metas[0].stride == channels_last.stride() and metas[3].stride == (1, 4)
    forward = Layout.of(metas, mask=False)
    assert all(o % 64 == 0 for o in forward.offsets)
    out = forward.unpack(forward.pack(values, torch.device("cpu")))
    for got, sent in zip(out, values, strict=True):
        assert torch.equal(got, sent) and got.stride() == sent.stride() and got.dtype == sent.dtype
    backward = Layout.of(metas, mask=True)
    assert backward.offsets[1] is None  # an integer tensor has no gradient: no room for one
    grads = [channels_last * 2, None, None, values[3] + 1]
    buffer = backward.pack(grads, torch.device("cpu"), scale=2.0**-130)  # the scale they were computed at
    out = backward.unpack(buffer)
    assert out[1] is None and out[2] is None
    assert torch.equal(out[0], grads[0]) and torch.equal(out[3], grads[3])
    assert backward.scale(buffer) == 2.0**-130
    integers = Layout.of([message_meta(values[1])], mask=True)  # an error message with no room
    empty = torch.empty(0, dtype=torch.uint8)
    assert integers.nbytes == 0 and integers.unpack(empty) == [None] and integers.scale(empty) == 1.0
    # a value in another layout is copied into the message's
    meta = TensorMeta((2, 3), (1, 2), torch.float32)
    moved = conform(torch.randn(2, 3), meta)
    assert moved.stride() == (1, 2)
    broadcast = message_meta(torch.randn(3, 1).expand(3, 4))
    assert broadcast.stride == (4, 1)  # not dense: sent contiguous
