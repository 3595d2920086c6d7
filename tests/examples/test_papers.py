"""The paper scripts' shared machinery: runs in worker processes give the results of runs here."""

import pytest

from benchmarks.papers.kosson import Job, run_job
from examples.experiments import map_runs


@pytest.mark.slow
def test_kosson_runs_in_a_pool_of_workers_match_runs_in_this_process_bit_for_bit():
    jobs = [Job("shallow", "b32", row, seed, 1) for row, seed in (("SGD, batch B", 0), ("PB", 0), ("PB", 1))]
    here = list(map_runs(run_job, jobs, workers=1))
    pooled = list(map_runs(run_job, jobs, workers=2))
    assert [r.delays for r in pooled] == [[0], [6, 4, 2, 0], [6, 4, 2, 0]]
    for a, b in zip(here, pooled, strict=True):
        assert (a.variant, a.seed, a.batch_size) == (b.variant, b.seed, b.batch_size)
        assert a.losses == b.losses
        assert a.test_accuracy == b.test_accuracy
