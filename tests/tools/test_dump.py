"""Tests of ``LOWPREC_DUMP`` / ``lowprec dump``: files, manifest, runnable graphs, HTML.

The golden dump comes from a fresh process (graph ids, hence random-stream
offsets, start at 0 there) that compiles a fixed tiny MLP with the eager
executor. After a deliberate change to the passes, regenerate the golden
files with ``LOWPREC_UPDATE_GOLDEN=1 pytest tests/tools/test_dump.py`` and review
the diff.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from lpcompile.backend import REGISTRY, step_seed
from lpcompile.config import LowPrecConfig
from lpcompile.kernels.cpu import gemm
from lpcompile.passes.driver import CompileContext
from lpcompile.tools import dump
from lpcompile.tools.cli import main

GOLDEN = Path(__file__).parent / "golden" / "dump_mlp"
UPDATE = bool(os.environ.get("LOWPREC_UPDATE_GOLDEN"))
VOLATILE = {"seconds", "passes_seconds", "torch_version"}  # left out of the golden manifest
# The whole LowPrecConfig is in the manifest; the golden file keeps the fields this dump depends on,
# so that a new option with a default does not change it.
CONFIG_KEYS = ("recipe", "weight", "activation", "error", "weight_grad", "seed", "executor")

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr", "executor": "eager"})
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    y = compiled(x)
    y.sum().backward()
    torch.save({"x": x, "y": y.detach(), "state": model.state_dict()}, sys.argv[1])
    """
)


def tiny_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def only_run(root: Path) -> Path:
    """The one run folder in the dump folder ``root``."""
    found = dump.runs(root)
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory) -> tuple[Path, dict]:
    """``LOWPREC_DUMP=DIR python script.py`` in a fresh process: its run folder and what the run saw."""
    work = tmp_path_factory.mktemp("golden")
    script = work / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, dump.ENV: str(work / "dump")}
    done = subprocess.run(
        [sys.executable, str(script), str(work / "expected.pt")],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = only_run(work / "dump")
    if UPDATE:
        update_golden(run)
    return run, torch.load(work / "expected.pt")


def dump_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def normalized(manifest: dict) -> dict:
    """The manifest without timings and versions, and only the config fields that matter here."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in VOLATILE}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    manifest = {**manifest, "config": {k: manifest["config"][k] for k in CONFIG_KEYS}}
    # Where the picture is depends on Graphviz being there: checked in test_manifest_matches_golden.
    graphs = {
        name: {k: v for k, v in graph.items() if k not in ("svg", "text")}
        for name, graph in manifest["graphs"].items()
    }
    return strip({**manifest, "graphs": graphs})


def expected_files() -> list[str]:
    """The golden file list; with text pictures where Graphviz is missing."""
    files = (GOLDEN / "files.txt").read_text().split()
    if shutil.which("dot") is None:
        files = sorted(f.replace("graph.svg", "graph.txt") for f in files)
    return files


def golden_text_files(root: Path) -> list[str]:
    return [f for f in dump_files(root) if f.endswith((".py", ".diff"))]


def update_golden(root: Path) -> None:
    """Rewrite the golden files from the dump in ``root`` (``LOWPREC_UPDATE_GOLDEN=1``)."""
    shutil.rmtree(GOLDEN, ignore_errors=True)
    GOLDEN.mkdir(parents=True)
    (GOLDEN / "files.txt").write_text("\n".join(dump_files(root)) + "\n")
    manifest = json.loads((root / "Sequential_0" / "manifest.json").read_text())
    (GOLDEN / "manifest.json").write_text(json.dumps(normalized(manifest), indent=2) + "\n")
    for name in golden_text_files(root):
        (GOLDEN / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / name, GOLDEN / name)


def test_file_list_matches_golden(golden_run):
    root, _ = golden_run
    assert dump_files(root) == expected_files()
    assert sorted(p.name for p in root.parent.iterdir()) == sorted(["index.html", root.name])


def test_the_run_folder_is_named_after_the_start_time_host_and_pid(golden_run):
    root, _ = golden_run
    start, rest = root.name.split("-", 1)
    host, pid = rest.rsplit("-", 1)
    assert re.fullmatch(r"\d{8}T\d{6}\.\d{6}Z", start) and host and pid.isdigit(), root.name
    index = (root.parent / "index.html").read_text()
    assert f'<a href="{root.name}/index.html">{root.name}</a>' in index
    assert f'<a href="{root.name}/index.html#Sequential_0">Sequential_0</a>' in index


def test_manifest_matches_golden(golden_run):
    root, _ = golden_run
    manifest = json.loads((root / "Sequential_0" / "manifest.json").read_text())
    assert manifest["torch_version"] == torch.__version__
    assert all(p["seconds"] >= 0 for p in manifest["passes"])
    assert normalized(manifest) == json.loads((GOLDEN / "manifest.json").read_text())
    for graph, info in manifest["graphs"].items():
        picture = f"{graph}/graph.svg" if shutil.which("dot") else f"{graph}/graph.txt"
        assert (info["svg"] or info["text"]) == picture


def test_graph_text_per_pass_matches_golden(golden_run):
    root, _ = golden_run
    names = golden_text_files(root)
    assert names == [f for f in expected_files() if f.endswith((".py", ".diff"))]
    for name in names:
        assert (root / name).read_text() == (GOLDEN / name).read_text(), f"{name} differs from golden"


def test_manifest_records_every_inserted_node(golden_run):
    """Independent of the golden file: what the quantize pass promises for a 2-layer MLP."""
    root, _ = golden_run
    manifest = json.loads((root / "Sequential_0" / "manifest.json").read_text())
    assert manifest["model"] == "Sequential" and manifest["graph_id"] == 0
    assert manifest["stages"] is None
    assert manifest["kernels"]["count"] == 0 and (root / "Sequential_0" / "kernels" / "README.md").is_file()
    assert [p["name"] for p in manifest["passes"]][-2:] == ["annotate_lowprec_nodes"] * 2
    inserted = [n for n in manifest["inserted"] if n["graph"] == "dynamo"]
    assert len(inserted) == 8  # per layer: activation, weight grad, weight, error
    insert_pass = next(p for p in manifest["passes"] if p["name"] == "insert_quantize")
    assert insert_pass["nodes_added"] == 8 + 1  # and the seed input
    for node in inserted:
        assert {"role", "layer", "format", "rounding", "stage"} <= set(node)
        assert node["format"] == "e5m2" and node["stage"] is None
        assert node["kind"] == ("sr" if node["rounding"] == "stochastic" else "quantize")
    by_role = sorted((n["layer"], n["role"]) for n in inserted)
    roles = ("activation", "weight", "weight_grad", "error")
    assert by_role == sorted((layer, role) for layer in "02" for role in roles)
    backward = [n for n in manifest["inserted"] if n["graph"] == "backward"]
    assert len(backward) == 4 and all(n["kind"] == "sr" and n["phase"] == "backward" for n in backward)


def test_every_dumped_python_file_compiles(golden_run):
    root, _ = golden_run
    files = list(root.rglob("*.py"))
    assert len(files) >= 6
    for path in files:
        compile(path.read_text(), str(path), "exec")


def _inputs(manifest: dict, graph: str, run: dict) -> list:
    model = tiny_mlp()
    model.load_state_dict(run["state"])
    scope = {"L": {"fn": model, "args": (run["x"],)}}
    values = []
    for spec in manifest["graphs"][graph]["inputs"]:
        if spec.get("source"):
            values.append(eval(spec["source"], scope))
        else:
            assert spec.get("dynamo_input", spec["name"]) == "lowprec_seed", spec
            values.append(step_seed(manifest["config"]["seed"], 0))  # the first call's seed
    return values


@pytest.mark.parametrize("graph", ["dynamo", "forward"])
def test_graph_after_all_passes_reproduces_the_compiled_output(golden_run, graph):
    root, run = golden_run
    manifest = json.loads((root / "Sequential_0" / "manifest.json").read_text())
    final = root / "Sequential_0" / manifest["graphs"][graph]["final"]
    assert final.name != "00_captured.py", "no pass ran on this graph"
    scope: dict = {}
    exec(compile(final.read_text(), str(final), "exec"), scope)
    outputs = scope["GraphModule"]().forward(*_inputs(manifest, graph, run))
    assert torch.equal(outputs[0], run["y"])
    plain = tiny_mlp()
    plain.load_state_dict(run["state"])
    assert not torch.equal(run["y"], plain(run["x"]).detach()), "the compiled output was not quantized"


def test_summary_lists_nodes_by_kind_and_layer(golden_run, capsys):
    root, _ = golden_run
    assert main(["dump", "--summary", "-o", str(root)]) == 0
    assert capsys.readouterr().out == dump.summary(root)
    assert main(["dump", "--summary", "-o", str(root.parent)]) == 0  # the dump folder: its newest run
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"{root}  (the newest of 1 run(s) in {root.parent})"
    assert lines[1].startswith("Sequential_0") and "fp8-e5m2-sr" in lines[1]
    header = lines[2].split()
    assert header[:3] == ["layer", "quantize", "sr"] and header[-1] == "total"
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:6]}
    assert rows["0"][:2] == ["2", "2"] and rows["2"][:2] == ["2", "2"] and rows["total"][-1] == "8"
    assert "kernels: 0" in out and "stages: none" in out
    spec = "weight e5m2 nearest saturate, activation e5m2 nearest saturate, error e5m2 stochastic inf"
    assert f"  rounded ({spec}, weight_grad e5m2 stochastic inf): 0, 2" in lines


def test_summary_of_a_folder_without_a_dump_fails(tmp_path, capsys):
    for root in (tmp_path, tmp_path / "missing"):
        assert main(["dump", "--summary", "-o", str(root)]) == 2
        assert f"no lowprec dump in {root}" in capsys.readouterr().err


# ----------------------------------------------------------------------------- browser


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium on PATH (Debian package chromium; .ci/run installs it)")


def _browse(index: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        *flags,
        index.as_uri(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture
def rendered_dump(golden_run) -> tuple[Path, dict]:
    if shutil.which("dot") is None:
        pytest.skip("no Graphviz dot on PATH (Debian package graphviz; .ci/run installs it)")
    root, _ = golden_run
    return root, json.loads((root / "Sequential_0" / "manifest.json").read_text())


def test_index_html_renders_every_graph_svg(rendered_dump, tmp_path):
    root, manifest = rendered_dump
    done = _browse(root / "index.html", tmp_path, "--dump-dom")
    check = done.stdout.split('<p id="render-check">', 1)[1].split("</p>", 1)[0]
    figures = json.loads(check)
    graphs = manifest["graphs"].items()
    expected = {(manifest["name"], graph): info["nodes"] for graph, info in graphs if "nodes" in info}
    assert {(f["dump"], f["graph"]): f["nodes"] for f in figures} == expected
    for figure in figures:
        assert figure["nodes"] == figure["expected"] > 0
        assert figure["width"] > 50 and figure["height"] > 50, figure
    marked = done.stdout.count('class="node lp_sr"') + done.stdout.count('class="node lp_quantize"')
    assert marked == len(manifest["inserted"])


def test_screenshot_shows_the_coloured_graph(rendered_dump, tmp_path):
    from PIL import Image

    root, _ = rendered_dump
    shot = tmp_path / "shot.png"
    flags = (f"--screenshot={shot}", "--window-size=1280,1400", "--hide-scrollbars")
    _browse(root / "index.html", tmp_path, *flags)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 1400)
    colours = image.getcolors(maxcolors=1 << 20)
    assert len(colours) > 20, "blank screenshot"

    def pixels(hex_colour: str) -> int:
        rgb = tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
        return sum(n for n, c in colours if max(abs(a - b) for a, b in zip(c, rgb, strict=True)) <= 3)

    # The dynamo graph's SR and quantize boxes are on screen, filled with their colours.
    assert pixels(dump.KINDS["sr"][0]) > 2000
    assert pixels(dump.KINDS["quantize"][0]) > 2000


# ----------------------------------------------------------------------------- in-process


@pytest.fixture
def dump_to(tmp_path, monkeypatch):
    """Dump into ``tmp_path/dump`` from this process; the run folder, and a fresh Dynamo."""
    monkeypatch.setenv(dump.ENV, str(tmp_path / "dump"))
    torch._dynamo.reset()
    yield dump.start_session()
    dump.flush()
    torch._dynamo.reset()


def test_backward_is_dumped_once_compiled_and_dot_missing_degrades_to_text(dump_to, monkeypatch):
    monkeypatch.setenv("PATH", str(dump_to.parent / "empty"))  # no dot
    monkeypatch.setattr(dump, "_warned_dot", False)
    model = tiny_mlp()
    compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2", "executor": "eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = compiled(torch.randn(2, 6))
        folder = dump_to / "Sequential_0"
        assert (folder / "forward").is_dir() and not (folder / "backward").exists()  # not compiled yet
        y.sum().backward()
        dump.flush()
    assert (folder / "backward" / "01_annotate_lowprec_nodes.py").is_file()
    ours = [w for w in caught if "lowprec dump" in str(w.message)]
    assert len(ours) == 1 and "Graphviz" in str(ours[0].message), [str(w.message) for w in caught]
    manifest = json.loads((folder / "manifest.json").read_text())
    for graph in ("dynamo", "forward", "backward"):
        info = manifest["graphs"][graph]
        assert info["svg"] is None and (folder / info["text"]).is_file() and (folder / info["dot"]).is_file()
    index = (dump_to / "index.html").read_text()
    assert index.count('<pre class="graph-text">') == 3 and "<svg" not in index


def test_a_triton_codegen_graph_is_labelled_with_the_executor_that_ran_it(dump_to):
    """codegen="triton" runs its AOT graphs as FX: the manifest said executor "inductor",
    and a graph without kernels was said to be Inductor's."""
    options = {"recipe": "fp8-e5m2-sr", "codegen": "triton", "exclude": "*"}  # nothing to fuse
    torch.compile(tiny_mlp(), backend="lowprec", options=options)(torch.randn(2, 6)).sum().backward()
    dump.flush()
    folder = dump_to / "Sequential_0"
    assert json.loads((folder / "manifest.json").read_text())["executor"] == "eager"
    readme = (folder / "kernels" / "README.md").read_text()
    assert "codegen='triton' found no lowprec operators" in readme and "Inductor fused" not in readme
    assert "kernels: 0 (codegen='triton': no lowprec operators to fuse)" in dump.summary(dump_to)


def test_a_function_graph_is_named_graph_and_the_cli_runs_scripts(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(dump.ENV, raising=False)
    script = tmp_path / "fn.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import torch

            def f(x, w):
                return torch.relu(x @ w)

            g = torch.compile(f, backend="lowprec", options={"recipe": "fp8-e5m2", "executor": "eager"})
            g(torch.randn(3, 4), torch.randn(4, 2))
            assert sys.argv[1:] == ["--flag", "7"], sys.argv
            sys.exit(3)
            """
        )
    )
    torch._dynamo.reset()
    code = main(["dump", "-o", str(tmp_path / "out"), str(script), "--flag", "7"])
    torch._dynamo.reset()
    assert code == 3
    assert os.environ.get(dump.ENV) is None  # restored
    assert "1 graph(s)" in capsys.readouterr().out
    manifest = json.loads((only_run(tmp_path / "out") / "graph_0" / "manifest.json").read_text())
    assert manifest["model"] == "graph"
    assert {n["layer"] for n in manifest["inserted"] if n["graph"] == "dynamo"} == {"matmul"}


def test_nothing_is_written_without_lowprec_dump(tmp_path, monkeypatch):
    monkeypatch.delenv(dump.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    gm = torch.fx.symbolic_trace(nn.Linear(2, 2))
    assert dump.OBSERVER in REGISTRY.observers and dump.OBSERVER not in REGISTRY.active_observers()
    dump.OBSERVER.graph_compiled(types.SimpleNamespace(records=[], aten_graphs={}), gm, "")
    dump.OBSERVER.inductor_graph(types.SimpleNamespace(records=[], aten_graphs={}), "forward", gm)
    assert list(tmp_path.iterdir()) == []


def test_inductor_graphs_are_recorded_by_the_observer(dump_to, monkeypatch):
    """The backend's ``inner_compile`` shows the observer each AOT graph, with a stand-in for
    Inductor (a real one takes minutes here), and turns AOT's cache off (a hit would skip it)."""
    import torch._inductor.compile_fx

    from lpcompile.backend.compile import _inductor_compiler

    record = types.SimpleNamespace(graph_id=7, config=None, records=[], aten_graphs={})
    seen = []

    def fake_inner(gm, example_inputs, **kwargs):
        seen.append((kwargs, torch._functorch.config.enable_autograd_cache))
        return "compiled"

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", fake_inner)
    ctx = CompileContext(config=LowPrecConfig(), graph_id=7, stream=0)
    wrapper = _inductor_compiler(ctx, record, "", REGISTRY.active_observers())
    forward = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
    assert wrapper(forward, [], is_inference=False) == "compiled"
    dump.OBSERVER.graph_compiled(record, torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1), "")
    backward = torch.fx.symbolic_trace(lambda g: g * 2)
    wrapper(backward, [], is_backward=True)  # lazily, after the dump was written: written again
    assert [kwargs for kwargs, _ in seen] == [{"is_inference": False}, {"is_backward": True}]
    manifest = json.loads((dump_to / "graph_0" / "manifest.json").read_text())
    assert list(manifest["graphs"]) == ["dynamo", "forward", "backward"]
    for graph in ("forward", "backward"):
        assert manifest["graphs"][graph]["decomposed"] is True
        assert "decomposed" in manifest["graphs"][graph]["note"]
    assert "mul" in (dump_to / "graph_0" / "backward" / "00_captured.py").read_text()


@pytest.mark.slow
def test_inductor_dump_end_to_end(dump_to):
    model = tiny_mlp()
    compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2"})
    compiled(torch.randn(2, 6)).sum().backward()
    dump.flush()
    manifest = json.loads((dump_to / "Sequential_0" / "manifest.json").read_text())
    assert manifest["executor"] == "inductor"
    assert manifest["graphs"]["forward"]["decomposed"] and manifest["graphs"]["backward"]["decomposed"]
    assert len([n for n in manifest["inserted"] if n["graph"] == "dynamo"]) == 8
    # Inductor lowers quantize itself: the inputs' quantizes in the forward, the errors' and
    # weight gradients' (quantize_grad's backward) in the backward.
    assert manifest["graphs"]["forward"]["lowprec_nodes"] == {"quantize": 4}
    assert manifest["graphs"]["backward"]["lowprec_nodes"] == {"quantize": 4}
    # The joint graph AOT partitions, before and after the pass that steers the partitioner;
    # use_bf16_matmuls runs before it only where lowprec's bf16 matmul kernel can (AVX512-BF16).
    index = 2 if gemm.unavailable() is None else 1
    assert manifest["graphs"]["joint"]["final"] == f"joint/{index:02d}_recompute_bool_masks.py"
    assert (dump_to / "Sequential_0" / "joint" / "00_captured.py").exists()


def test_the_cli_prints_a_scripts_exit_message(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(dump.ENV, raising=False)
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit('no data here')\n")
    assert main(["dump", "-o", str(tmp_path / "out"), str(script)]) == 1
    assert "no data here" in capsys.readouterr().err


def test_a_custom_modules_dump_is_not_named_after_a_submodule(tmp_path, monkeypatch):
    """Dynamo records no class for a custom module's own forward, only the submodules
    it calls: the folder used to be named after the first of those (``Linear_0``)."""

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(3, 3)

        def forward(self, x):
            return torch.tanh(self.l(x))

    seen = []

    def backend(gm, example_inputs):
        seen.append(dump.model_name(gm))
        return gm

    torch._dynamo.reset()
    for model in (Custom(), nn.Sequential(nn.Linear(3, 3))):
        torch.compile(model, backend=backend)(torch.randn(2, 3))
    torch._dynamo.reset()
    assert seen == ["model", "Sequential"]


def test_the_cli_keeps_earlier_runs(tmp_path, monkeypatch, capsys):
    """Earlier runs were removed at the start of a dump, whichever process was still writing
    them. A run that compiles nothing writes nothing."""
    monkeypatch.delenv(dump.ENV, raising=False)
    old = tmp_path / "out" / "20000101T000000.000000Z-elsewhere-1" / "Sequential_0"
    old.mkdir(parents=True)
    (old / "manifest.json").write_text(json.dumps({"format": dump.FORMAT, "model": "Sequential"}))
    script = tmp_path / "noop.py"
    script.write_text("print('compiles nothing')\n")
    assert main(["dump", "-o", str(tmp_path / "out"), str(script)]) == 0
    assert "0 graph(s)" in capsys.readouterr().out
    assert dump.runs(tmp_path / "out") == [old.parent] and (old / "manifest.json").is_file()


def test_summary_says_which_products_stay_in_higher_precision_and_why(dump_to):
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    options = {"recipe": "fp8-e5m2", "executor": "eager", "exclude": ["2"]}
    torch.compile(model, backend="lowprec", options=options)(torch.randn(2, 6)).sum().backward()
    dump.flush()
    assert "left in higher precision: 2 (linear: exclude)" in dump.summary(dump_to)


class CheckpointedPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=False)
        return self.c(self.b(h))


def test_summary_says_how_each_layer_is_rounded_checkpoint_bodies_included(dump_to):
    options = {"recipe": "fp8-tensorwise", "executor": "eager", "exclude": ["c"], "weight_grad": "e5m2"}
    model = CheckpointedPair()
    torch.compile(model, backend="lowprec", options=options)(torch.randn(2, 6)).sum().backward()
    dump.flush()
    summary = dump.summary(dump_to)
    scaled = "e4m3 nearest saturate tensorwise"
    spec = f"weight {scaled}, activation {scaled}, error e5m2 nearest inf tensorwise"
    # a format name for a role the recipe leaves off: nearest, saturating, unscaled
    line = f"  rounded ({spec}, weight_grad e5m2 nearest saturate): "
    (layers,) = [row.removeprefix(line) for row in summary.splitlines() if row.startswith(line)]
    assert sorted(layers.split(", ")) == ["a", "b"]  # a: in the checkpoint body
    assert "left in higher precision: c (linear: exclude)" in summary


@pytest.mark.parametrize("where", ["a-file", "a-file/sub"])
def test_the_cli_refuses_a_dump_folder_it_cannot_write(tmp_path, capsys, where):
    """``-o FILE`` (or a folder under a file) used to run the script and exit 0 with
    "0 graph(s)"; now nothing runs, the exit is 2 and the message names the path."""
    (tmp_path / "a-file").write_text("not a folder")
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('the script ran')\n")
    assert main(["dump", "-o", str(tmp_path / where), str(script)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the dump folder {tmp_path / where}" in err and "the script ran" not in err


def test_a_failed_write_names_the_folder(dump_to, monkeypatch):
    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(dump, "write_graph", fail)
    model = nn.Linear(2, 2)
    with pytest.warns(RuntimeWarning, match=f"writing {dump_to}/Linear_0 failed: OSError"):
        torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2", "executor": "eager"})(
            torch.randn(1, 2)
        )


def test_a_forked_child_dumps_into_a_run_folder_of_its_own(dump_to, monkeypatch):
    """A child forked after its parent started dumping inherits the parent's session:
    it wrote its graphs into the parent's run folder, under the parent's folder names."""
    options = {"recipe": "fp8-e5m2", "executor": "eager"}
    torch.compile(nn.Linear(2, 2), backend="lowprec", options=options)(torch.randn(1, 2))
    monkeypatch.setattr(dump._session, "pid", -1)  # what a forked child sees: its parent's session
    parent = dump_files(dump_to)
    torch.compile(nn.Linear(3, 3), backend="lowprec", options=options)(torch.randn(1, 3))
    dump.flush()
    assert dump_files(dump_to) == parent
    [child] = [run for run in dump.runs(dump_to.parent) if run != dump_to]
    assert child.name.endswith(f"-{os.getpid()}") and (child / "Linear_0" / "manifest.json").is_file()


def test_the_root_index_keeps_a_run_that_appears_while_it_is_written(tmp_path, monkeypatch):
    """Another process's run that appears after this writer listed the folder (and whose own
    page this writer then overwrites) is on the page in the end."""

    def add_run(name: str) -> None:
        (tmp_path / name / "graph_0").mkdir(parents=True)
        (tmp_path / name / "graph_0" / "manifest.json").write_text("{}")

    add_run("a")
    write = dump._write_whole

    def racing(path: Path, text: str) -> None:
        write(path, text)
        if not (tmp_path / "b").exists():
            add_run("b")

    monkeypatch.setattr(dump, "_write_whole", racing)
    index = dump.write_root_index(tmp_path).read_text()
    assert '<a href="a/index.html">a</a>' in index and '<a href="b/index.html">b</a>' in index


# ----------------------------------------------------------------------------- concurrent writers

WRITER = textwrap.dedent(
    """
    import os
    import sys
    import time
    from pathlib import Path

    import torch
    from torch import nn

    import lpcompile.backend  # imported before the start signal: the writers compile at the same time

    width, ready, go = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    ready.touch()
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            sys.exit("no start signal")
        time.sleep(0.01)
    for depth in (1, 2, 3):  # three Dynamo graphs, each with a forward and a backward
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        options = {"recipe": "fp8-e5m2", "executor": "eager"}
        torch.compile(model, backend="lowprec", options=options)(torch.randn(3, width)).sum().backward()
    print(os.getpid())
    """
)


def test_two_processes_dumping_into_one_folder_keep_all_their_graphs_apart(tmp_path):
    """Two processes sharing ``LOWPREC_DUMP`` lost one process's graphs (each new dump
    removed the folder's graph folders) and mixed their files in one graph folder."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root, go = tmp_path / "dump", tmp_path / "go"
    env = {**os.environ, dump.ENV: str(root)}
    writers = {}
    for width in (5, 7):  # each writer's layers have their own width
        command = [sys.executable, str(script), str(width), str(tmp_path / f"ready{width}"), str(go)]
        writers[width] = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # to import torch and lpcompile
        for width, writer in writers.items():
            while not (tmp_path / f"ready{width}").exists():
                assert writer.poll() is None, f"writer {width} exited early"
                assert time.monotonic() < deadline, f"writer {width} did not start"
                time.sleep(0.1)
        go.touch()
        pids = {}
        for width, writer in writers.items():
            out, _ = writer.communicate(timeout=300)
            assert writer.returncode == 0, f"writer {width} failed"
            pids[width] = int(out.split()[-1])
    finally:
        for writer in writers.values():
            if writer.poll() is None:
                writer.kill()
                writer.wait(timeout=30)

    found: dict[int, list[Path]] = {5: [], 7: []}
    for path in root.rglob("manifest.json"):
        inputs = json.loads(path.read_text())["graphs"]["dynamo"]["inputs"]
        widths = {d for spec in inputs for d in spec["shape"] or []} & {5, 7}
        assert len(widths) == 1, f"{path.parent} holds graphs of both writers"
        found[widths.pop()].append(path.parent)
    assert {width: len(folders) for width, folders in found.items()} == {5: 3, 7: 3}, "graphs lost"
    for width, folders in found.items():
        runs = {folder.parent for folder in folders}
        assert len(runs) == 1 and runs != {root}, f"writer {width}'s graphs are not in one run folder: {runs}"
        assert str(pids[width]) in runs.pop().name.split("-"), "the run folder does not name the process"
    assert {f.parent for f in found[5]}.isdisjoint(f.parent for f in found[7])
    index = (root / "index.html").read_text()
    assert all(f'href="{folders[0].parent.name}/index.html"' in index for folders in found.values())
