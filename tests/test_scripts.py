"""The prepared scripts name tests that exist: a moved test file would otherwise make a
lent GPU's one run end at pytest's "file or directory not found"."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
TEST_ID = re.compile(r"\btests/[\w/]+\.py(?:::\w+)?")


def test_gpu_check_names_existing_tests():
    ids = TEST_ID.findall((ROOT / "scripts" / "gpu_check.sh").read_text())
    assert ids, "scripts/gpu_check.sh names no tests"
    for test_id in ids:
        path, _, name = test_id.partition("::")
        assert (ROOT / path).is_file(), f"scripts/gpu_check.sh: {path} does not exist"
        if name:
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), (
                f"scripts/gpu_check.sh: {path} has no test {name}"
            )
