"""The FSDP2 example (examples/fsdp_gpt.py) under torchrun with two gloo ranks: it trains,
validates, reports every product rounded, and a run resumed from its DCP checkpoint
prints the losses of the uninterrupted run."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--eval-batches", "1"]


def _torchrun(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*command, "-m", "examples.fsdp_gpt", *args, *QUICK],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _losses(out: str) -> dict[int, str]:
    return dict((int(step), loss) for step, loss in re.findall(r"^step\s+(\d+)\s+loss (\S+)", out, re.M))


@pytest.mark.slow
def test_the_fsdp2_example_trains_rounds_every_product_and_resumes(tmp_path):
    full = _torchrun("--steps", "3")
    losses = _losses(full)
    assert sorted(losses) == [1, 2, 3], full
    assert all(math.isfinite(float(v)) for v in losses.values()), full
    bits = float(re.search(r"validation: (\S+) bits/char", full).group(1))
    assert 0 < bits < 8.5, full  # 8 bits/char is a uniform guess over bytes
    rounded, products, kept = map(
        int, re.search(r"coverage: (\d+) of (\d+) products .* (\d+) kept", full).groups()
    )
    assert rounded == products > 0 and kept == 0, full

    checkpoint = str(tmp_path / "checkpoint")
    first = _torchrun("--steps", "2", "--save", checkpoint)
    rest = _torchrun("--steps", "1", "--resume", checkpoint)
    assert "resumed from" in rest, rest
    assert {**_losses(first), **_losses(rest)} == losses, first + rest
