"""The package's layout: imports run one way between its parts, it never imports the
examples, and ``import lpcompile`` loads neither Inductor nor anything heavy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "lpcompile"
# The parts in data-path order: a module may import its own part and the ones before it.
ORDER = ("numerics", "kernels", "config", "passes", "codegen", "backend", "runtime", "tools")


def _part(module: str) -> str | None:
    names = module.split(".")
    if names[0] != "lpcompile" or len(names) < 2:
        return None
    return names[1]


def _imports(path: Path) -> list[str]:
    """Every lpcompile (or examples) module ``path`` imports, at the top or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in found if name.split(".")[0] in ("lpcompile", "examples")]


def _run(code: str) -> list[str]:
    """What ``code`` prints in a fresh interpreter, split into words."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_imports_run_one_way_between_parts():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if own not in ORDER:
            continue  # the package root names the public API of every part
        for name in _imports(path):
            if name.startswith("examples"):
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name} (examples are not the package)")
            part = _part(name)
            if part in ORDER and ORDER.index(part) > ORDER.index(own):
                wrong.append(f"{path.relative_to(PACKAGE)} ({own}) imports {name} ({part})")
    assert not wrong, "\n".join(wrong)


def test_a_misplaced_import_would_be_found(tmp_path, monkeypatch):
    """The check above reads function-level imports too."""
    module = tmp_path / "numerics" / "x.py"
    module.parent.mkdir()
    module.write_text("def f():\n    from lpcompile.backend import REGISTRY\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    try:
        test_imports_run_one_way_between_parts()
    except AssertionError as error:
        assert "numerics/x.py (numerics) imports lpcompile.backend" in str(error)
    else:
        raise AssertionError("the misplaced import was not found")


def test_import_lpcompile_loads_no_inductor_and_no_extras():
    """Beyond what ``import torch`` loads (torch.hub takes tqdm where it is installed)."""
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import lpcompile\n"
        "heavy = ('torch._inductor', 'sklearn', 'tqdm', 'matplotlib', 'torch.distributed.pipelining',"
        " 'lpcompile.backend', 'examples')\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith(heavy)))\n"
    )
    assert _run(code) == ["[]"]


def test_public_names_resolve_lazily():
    code = (
        "import sys, lpcompile\n"
        "assert 'lpcompile.runtime.scaler' not in sys.modules\n"
        "print(sorted(n for n in lpcompile.__all__ if getattr(lpcompile, n) is None))\n"
        "print('lpcompile.runtime.scaler' in sys.modules)\n"
    )
    assert _run(code) == ["[]", "True"]


def test_inductor_gets_lowprec_lowerings_when_it_loads():
    """A plain torch.compile of code calling lpcompile.quantize still fuses it: the
    lowerings come in as Inductor is imported, not at ``import lpcompile``."""
    code = (
        "import sys, lpcompile\n"
        "assert 'lpcompile.numerics.lowering' not in sys.modules\n"
        "import torch._inductor.compile_fx\n"
        "from torch._inductor.decomposition import decompositions\n"
        "import torch\n"
        "print('lpcompile.numerics.lowering' in sys.modules,"
        " torch.ops.lowprec.quantize.default in decompositions)\n"
    )
    assert _run(code) == ["True", "True"]
