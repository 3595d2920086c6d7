"""``LOWPREC_DUMP=DIR``: what the backend did to each graph, as files and pictures.

With the environment variable set (or through ``lowprec dump SCRIPT.py``),
:class:`DumpObserver` watches the backend compile each Dynamo graph (a compile
observer in the registry; importing this module adds it), and writes
``DIR/<run>/<model>_<n>/`` for it. ``<run>`` is the session's run folder,
``<start>-<host>-<pid>`` (``<start>`` the UTC time, ``YYYYmmddTHHMMSS.ffffffZ``), so
runs sort by start time and processes sharing ``DIR`` never write into one folder;
``n`` counts the graphs the session dumped, in compile order; ``<model>`` is the
root module's class, or ``graph``::

    DIR/
      index.html                 the runs, oldest first, with links to their graphs
      <start>-<host>-<pid>/
        index.html               tables of graphs and passes, one SVG per graph
        Sequential_0/
          manifest.json          passes, timing, every lowprec node, kernels, stages
          dynamo/00_captured.py  the Dynamo graph as captured
          dynamo/01_<pass>.py    the graph after each pass, in order
          dynamo/01_<pass>.diff  what that pass changed (unified diff)
          dynamo/graph.dot|.svg  the graph after all passes (text where dot is missing)
          forward/ backward/ inference/   the same for the AOT autograd graphs
          kernels/               the generated Triton kernels (codegen="triton"), else a README

Nothing in ``DIR`` is ever removed: earlier runs stay. A graph folder is written
in a hidden folder beside it and renamed into place, and an ``index.html`` is
written to a hidden file and renamed over the old one, so a reader sees whole
files. The root ``index.html`` is written again from the folder listing by each
writer, until the listing stays as written (:func:`write_root_index`): concurrent
writers lose no run.

Every ``.py`` holds ``GraphModule.code`` inside a ``GraphModule`` class: it
compiles, and ``GraphModule().forward(*inputs)`` runs it with the inputs that
``manifest.json`` lists under ``graphs.<graph>.inputs``. Names are the FX node
names, so two runs of the same program give the same files.

The backward graph is compiled lazily, at the first ``backward()``: the
folder is written again whenever a graph it shows appears (:func:`flush`,
called at exit, by ``lowprec dump`` and at the end of
:func:`examples.train.train_digits`).

A graph's generated kernels are read from ``record.kernels`` (``{name: source}``);
stages from ``node.meta["stage"]`` and ``node.meta["stage_boundary"]``; a pass may
set ``node.meta["lowprec"]["kind"]`` to one of :data:`KINDS`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import difflib
import html
import json
import os
import re
import shutil
import socket
import subprocess
import warnings
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.fx

from lpcompile.backend.state import REGISTRY
from lpcompile.config import PER_MATMUL, ROLES
from lpcompile.passes.stages import BOUNDARY

ENV = "LOWPREC_DUMP"
FORMAT = "lowprec-dump/1"

# kind -> (fill colour, legend text). The order is the legend's and the summary's.
KINDS: dict[str, tuple[str, str]] = {
    "quantize": ("#8ecae6", "quantize, round to nearest"),
    "sr": ("#ffb703", "quantize, stochastic rounding"),
    "loss_scale": ("#90be6d", "loss scale / unscale"),
    "stage_boundary": ("#f28482", "pipeline stage boundary"),
    "weight_prediction": ("#cdb4db", "weight prediction"),
    "fused_kernel": ("#7bdff2", "fused kernel (codegen)"),
    "other": ("#d9d9d9", "other lowprec operator"),
}
# lowprec operator name -> kind (quantize ops with stochastic rounding become "sr")
OP_KINDS = {
    "quantize": "quantize",
    "quantize_grad": "quantize",
    "scale_grad": "loss_scale",
    "predict_weight": "weight_prediction",
}
GRAPH_ORDER = ("dynamo", "joint", "forward", "backward", "inference")
KERNEL_NOTES = {
    "inductor": (
        "No lowprec kernels: this graph was compiled with codegen='inductor', so Inductor fused the "
        "operators into kernels of its own (TORCH_COMPILE_DEBUG=1 writes them). "
        "With codegen='triton' the generated Triton kernels are written here."
    ),
    "eager": (
        "No kernels: executor='eager' runs the AOT graphs op by op as plain FX, lowprec operators "
        "included. With codegen='triton' the generated Triton kernels are written here."
    ),
    "triton": (
        "No kernels: codegen='triton' found no lowprec operators to fuse in this graph, which runs "
        "as plain FX (as with executor='eager')."
    ),
}
DECOMPOSED_NOTE = (
    "Inductor's ATen graph, as its inner compiler receives it: each lowprec::quantize is one node "
    "(Inductor lowers it), marked here; the other lowprec operators are already decomposed into "
    "ATen operations (quantize_grad and scale_grad into the identity, a tiled quantize or one "
    "with a given scale around an unscaled one), so they are not; see the dynamo graph."
)
PY_HEADER = """\
# lowprec dump: {title}
# GraphModule.code of the FX graph. Run: GraphModule().forward(*inputs), the inputs as
# manifest.json lists them under graphs["{graph}"]["inputs"].
import torch
from torch import device  # noqa: F401
from math import inf, nan  # noqa: F401
import lpcompile  # noqa: F401  (defines the torch.ops.lowprec operators)


class GraphModule(torch.nn.Module):
"""


# ----------------------------------------------------------------------------- graph views


@dataclass
class NodeView:
    """What the dump shows of one FX node."""

    name: str
    op: str
    target: str
    inputs: list[str]
    kind: str | None
    info: dict[str, Any]
    shape: str


@dataclass
class GraphView:
    """A snapshot of one graph: its code, its nodes and its inputs."""

    code: str
    nodes: list[NodeView]
    inputs: list[dict[str, Any]]
    decomposed: bool = False


def lowprec_op(node: torch.fx.Node) -> str | None:
    """The name of the ``lowprec::`` operator ``node`` calls, if any."""
    target = node.target
    if node.op == "call_function" and getattr(target, "namespace", None) == "lowprec":
        return str(target).split(".")[1]
    return None


def node_kind(node: torch.fx.Node) -> str | None:
    """The colour class of a node the lowprec passes made, or ``None``."""
    meta = node.meta.get("lowprec")
    meta = meta if isinstance(meta, dict) else None
    if meta is not None and meta.get("kind") in KINDS:
        return meta["kind"]
    if node.meta.get(BOUNDARY):
        return "stage_boundary"
    op = lowprec_op(node)
    if op is None:
        return "other" if meta is not None and node.op == "call_function" else None
    kind = OP_KINDS.get(op, "other")
    if kind == "quantize" and node_info(node).get("rounding") == "stochastic":
        kind = "sr"
    return kind


def node_info(node: torch.fx.Node) -> dict[str, Any]:
    """Role, layer, format, rounding, ... of a lowprec node (its meta, else its arguments)."""
    meta = node.meta.get("lowprec")
    info = dict(meta) if isinstance(meta, dict) else {}
    if "fmt" in info:
        info["format"] = info.pop("fmt")
    op = lowprec_op(node)
    if op in ("quantize", "quantize_grad") and len(node.args) >= 6:
        for key, index in (("format", 1), ("rounding", 2), ("overflow", 3), ("offset", 5)):
            info.setdefault(key, node.args[index])
    if op is not None:
        info.setdefault("op", op)
    stage = node.meta.get("stage")
    info["stage"] = stage if isinstance(stage, int | str) or stage is None else str(stage)
    return info


def _value(node: torch.fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


def _shape(value: Any) -> tuple[list[Any] | None, str | None]:
    if isinstance(value, torch.Tensor):
        dims = [d if isinstance(d, int) else str(d) for d in value.shape]
        return dims, str(value.dtype).removeprefix("torch.")
    return None, None


def _shape_text(value: Any) -> str:
    dims, dtype = _shape(value)
    return "" if dims is None else f"{dtype}[{', '.join(map(str, dims))}]"


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    if node.op in ("placeholder", "output", "get_attr", "call_method", "call_module"):
        return str(target)
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    return f"{module}.{name}" if module and module != "builtins" and module != "_operator" else name


def _source(node: torch.fx.Node) -> str | None:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None) if grapharg is not None else None
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else str(name)


def graph_view(gm: torch.fx.GraphModule, decomposed: bool = False) -> GraphView:
    """A snapshot of ``gm`` (safe to keep while the graph changes afterwards)."""
    nodes, inputs = [], []
    for node in gm.graph.nodes:
        kind = node_kind(node)
        nodes.append(
            NodeView(
                name=node.name,
                op=node.op,
                target=_target_name(node),
                inputs=[n.name for n in node.all_input_nodes],
                kind=kind,
                info=node_info(node) if kind is not None else {},
                shape=_shape_text(_value(node)),
            )
        )
        if node.op == "placeholder":
            dims, dtype = _shape(_value(node))
            inputs.append({"name": str(node.target), "shape": dims, "dtype": dtype, "source": _source(node)})
    return GraphView(code=gm.code, nodes=nodes, inputs=inputs, decomposed=decomposed)


def model_name(gm: torch.fx.GraphModule) -> str:
    """The class name of the root module that made ``gm``: ``"graph"`` for a function,
    ``"model"`` for a module whose class Dynamo does not record (its own ``forward``
    code only lists the submodules it calls)."""
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            path, cls = next(iter(stack.values()))
            if not re.fullmatch(r"L\['[^']*'\]", str(path)):
                return "model"  # a submodule's entry: naming the dump after it would mislead
            name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
            return _safe(name) or "graph"
    return "graph"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.")


def _graph_order(kind: str) -> tuple[int, str]:
    base = kind.split("[", 1)[0]
    return (GRAPH_ORDER.index(base) if base in GRAPH_ORDER else len(GRAPH_ORDER), kind)


# ----------------------------------------------------------------------------- session


@dataclass
class _Entry:
    record: Any
    folder: str
    model: str
    dynamo: dict[str, torch.fx.GraphModule] = field(default_factory=dict)
    written: tuple | None = None


@dataclass
class _Session:
    root: Path
    run: Path  # root/<start>-<host>-<pid>, created with its first graph
    pid: int  # the process that writes it: a forked child starts a session of its own
    entries: list[_Entry] = field(default_factory=list)
    inductor: dict[int, dict[str, GraphView]] = field(default_factory=dict)  # id(record) -> graphs

    def entry(self, record: Any, gm: torch.fx.GraphModule) -> _Entry:
        for entry in self.entries:
            if entry.record is record:
                return entry
        model = model_name(gm)
        entry = _Entry(record, f"{model}_{len(self.entries)}", model)
        self.entries.append(entry)
        return entry


_session: _Session | None = None
_warned_dot = False
_atexit_registered = False


def dump_dir() -> Path | None:
    """The dump folder ``LOWPREC_DUMP`` names, or ``None`` when dumping is off."""
    value = os.environ.get(ENV, "").strip()
    return Path(value) if value else None


def _current() -> _Session | None:
    """This process's dump session for the folder ``LOWPREC_DUMP`` names now."""
    root = dump_dir()
    if root is None:
        return None
    if _session is None or _session.root != root.absolute() or _session.pid != os.getpid():
        start_session()
    return _session


def start_session() -> Path | None:
    """Start a new dump session: the graphs compiled from now on go to a new run folder
    under ``LOWPREC_DUMP``, which is returned (``None`` when dumping is off). The folder
    is created with its first graph: a session that compiles nothing writes nothing."""
    global _session, _atexit_registered
    root = dump_dir()
    if root is None:
        return None
    flush()
    root = root.absolute()
    _session = _Session(root, root / _run_name(), os.getpid())
    if not _atexit_registered:
        atexit.register(_flush_at_exit)
        _atexit_registered = True
    return _session.run


def _run_name() -> str:
    """``<start>-<host>-<pid>``: unique among live processes, and in start order by name."""
    start = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    return f"{start}-{_safe(socket.gethostname()) or 'host'}-{os.getpid()}"


class DumpObserver:
    """The backend's compile observer that writes the dump while ``LOWPREC_DUMP`` is set."""

    def active(self) -> bool:
        return dump_dir() is not None

    def graph_compiled(self, record: Any, gm: torch.fx.GraphModule, tag: str) -> None:
        """``gm`` (after the graph passes) of ``record`` was compiled. ``tag`` names a
        variant of the same Dynamo graph (its graphs are shown as ``dynamo<tag>`` etc.)."""
        session = _current()
        if session is None:
            return
        entry = session.entry(record, gm)
        entry.dynamo["dynamo" + tag] = gm
        _write_safely(session, entry)

    def inductor_graph(self, record: Any, kind: str, gm: torch.fx.GraphModule) -> None:
        """Snapshot an AOT graph Inductor is about to compile."""
        session = _current()
        if session is None:
            return
        session.inductor.setdefault(id(record), {})[kind] = graph_view(gm, decomposed=True)
        for entry in session.entries:
            if entry.record is record:  # a backward compiled after the dump was written
                _write_safely(session, entry)


OBSERVER = DumpObserver()


def observe() -> None:
    """Have the backend report its compiles to the dump (it writes while ``LOWPREC_DUMP`` is set)."""
    REGISTRY.observe(OBSERVER)


def flush() -> None:
    """Write again the graph folders whose graphs changed (e.g. a backward appeared)."""
    session = _session
    if session is None or session.pid != os.getpid():  # a forked child's parent writes its own
        return
    for entry in session.entries:
        if entry.written != _signature(session, entry):
            _write_safely(session, entry)


def _flush_at_exit() -> None:
    with contextlib.suppress(Exception):
        flush()


def _signature(session: _Session, entry: _Entry) -> tuple:
    record = entry.record
    return (
        tuple(sorted(entry.dynamo)),
        tuple(sorted(getattr(record, "aten_graphs", {}))),
        tuple(sorted(session.inductor.get(id(record), {}))),
        len(getattr(record, "records", [])),
        len(kernel_sources(record)),
    )


def _write_safely(session: _Session, entry: _Entry) -> None:
    try:
        write_graph(session, entry)
        write_index(session.run)
        write_root_index(session.root)
    except Exception as error:  # a debugging aid must not stop training
        where = session.run / entry.folder
        warnings.warn(f"lowprec dump: writing {where} failed: {error!r}", RuntimeWarning, stacklevel=2)


# ----------------------------------------------------------------------------- writing


def kernel_sources(record: Any) -> dict[str, str]:
    """The generated kernels of a compiled graph (codegen="triton"), name -> source."""
    return dict(getattr(record, "kernels", None) or {})


def _views(session: _Session, entry: _Entry) -> dict[str, GraphView]:
    views = {kind: graph_view(gm) for kind, gm in entry.dynamo.items()}
    views.update({kind: graph_view(gm) for kind, gm in getattr(entry.record, "aten_graphs", {}).items()})
    views.update(session.inductor.get(id(entry.record), {}))
    return views


def _link_inputs(views: dict[str, GraphView]) -> None:
    """Name, for each AOT forward input, the Dynamo input it is (same position)."""
    for kind, view in views.items():
        base, tag = (kind.split("[", 1) + [""])[:2]
        dynamo = views.get("dynamo" + ("[" + tag if tag else ""))
        if base in ("forward", "inference") and dynamo and len(dynamo.inputs) == len(view.inputs):
            for mine, theirs in zip(view.inputs, dynamo.inputs, strict=True):
                mine["dynamo_input"] = theirs["name"]
                mine["source"] = theirs["source"]


def _py(title: str, graph: str, code: str) -> str:
    body = "\n".join(("    " + line) if line.strip() else "" for line in code.strip("\n").splitlines())
    return PY_HEADER.format(title=title, graph=graph) + body.rstrip() + "\n"


def _diff(before: str, after: str, old: str, new: str) -> str:
    lines = difflib.unified_diff(
        before.strip("\n").splitlines(keepends=False),
        after.strip("\n").splitlines(keepends=False),
        fromfile=old,
        tofile=new,
        lineterm="",
    )
    text = "\n".join(line.rstrip() for line in lines)
    return text + "\n" if text else ""


def _config(record: Any) -> Any:
    config = getattr(record, "config", None)
    if dataclasses.is_dataclass(config):
        return json.loads(json.dumps(dataclasses.asdict(config), default=str))
    return None


def write_graph(session: _Session, entry: _Entry) -> Path:
    """Write ``entry``'s folder from scratch, in a hidden folder renamed into place; return it."""
    record = entry.record
    signature = _signature(session, entry)
    views = _views(session, entry)
    _link_inputs(views)
    records = list(getattr(record, "records", []))
    kinds = sorted(set(views) | {r.graph for r in records}, key=_graph_order)
    final = session.run / entry.folder
    folder = session.run / f".{entry.folder}.new"
    shutil.rmtree(folder, ignore_errors=True)  # left by a write that failed
    folder.mkdir(parents=True)

    graphs: dict[str, Any] = {}
    passes: list[dict[str, Any]] = []
    files: dict[int, tuple[str, str]] = {}  # id(pass record) -> (.py, .diff)
    for kind in kinds:
        sub = _safe(kind.replace("[", "_").replace("]", "")) or "graph"
        (folder / sub).mkdir()
        mine = [r for r in records if r.graph == kind]
        view = views.get(kind)
        code = mine[0].code_before if mine else view.code
        captured = f"{sub}/00_captured.py"
        (folder / captured).write_text(_py(f"{entry.folder}, {kind} graph as captured", kind, code))
        previous = captured
        for i, r in enumerate(mine, 1):
            stem = f"{sub}/{i:02d}_{_safe(r.name)}"
            title = f"{entry.folder}, {kind} graph after pass {i} of {len(mine)}: {r.name}"
            (folder / f"{stem}.py").write_text(_py(title, kind, r.code_after))
            (folder / f"{stem}.diff").write_text(_diff(code, r.code_after, previous, f"{stem}.py"))
            files[id(r)] = (f"{stem}.py", f"{stem}.diff")
            code, previous = r.code_after, f"{stem}.py"
        info: dict[str, Any] = {"folder": sub, "captured": captured, "final": previous}
        if view is not None:
            marked = Counter(n.kind for n in view.nodes if n.kind is not None)
            info.update(
                nodes=len(view.nodes),
                lowprec_nodes={k: marked[k] for k in KINDS if marked[k]},
                decomposed=view.decomposed,
                inputs=view.inputs,
            )
            if view.decomposed:
                info["note"] = DECOMPOSED_NOTE
            info.update(_render(view, folder / sub, f"{entry.folder}-{sub}"))
        graphs[kind] = info

    for order, r in enumerate(records, 1):
        py, diff = files.get(id(r), (None, None))
        passes.append(
            {
                "order": order,
                "name": r.name,
                "graph": r.graph,
                "seconds": r.seconds,
                "nodes_added": r.nodes_added,
                "nodes_removed": r.nodes_removed,
                "file": py,
                "diff": diff,
            }
        )

    inserted = [
        {"graph": kind, "node": n.name, "kind": n.kind, **n.info}
        for kind in kinds
        if kind in views
        for n in views[kind].nodes
        if n.kind is not None
    ]
    kernels = kernel_sources(record)
    (folder / "kernels").mkdir()
    for name, source in sorted(kernels.items()):
        (folder / "kernels" / f"{_safe(name)}.py").write_text(source)
    config = _config(record) or {}
    triton = config.get("codegen") == "triton"  # its AOT graphs run as FX, whatever `executor` says
    executor = "eager" if triton else config.get("executor")
    note = KERNEL_NOTES["triton" if triton else "eager" if executor == "eager" else "inductor"]
    if not kernels:
        (folder / "kernels" / "README.md").write_text(f"# Kernels of {entry.folder}\n\nNone. {note}\n")
    stages = _stages(views)
    manifest = {
        "format": FORMAT,
        "name": entry.folder,
        "model": entry.model,
        "graph_id": getattr(record, "graph_id", None),
        "torch_version": torch.__version__,
        "executor": executor,
        "config": config or None,
        "pass_order": [f"{r.graph}:{r.name}" for r in records],
        "passes": passes,
        "passes_seconds": sum(r.seconds for r in records),
        "graphs": graphs,
        "inserted": inserted,
        "kept": [dataclasses.asdict(k) for k in getattr(record, "kept", [])],
        "rounded": _rounded(record),
        "kernels": {
            "count": len(kernels),
            "files": [f"kernels/{_safe(name)}.py" for name in sorted(kernels)],
            "note": None if kernels else note,
        },
        "stages": stages,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if final.exists():  # between the two renames readers see no folder, never half of one
        old = final.with_name(f".{entry.folder}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        folder.rename(final)
        shutil.rmtree(old)
    else:
        folder.rename(final)
    entry.written = signature
    return final


def _stages(views: dict[str, GraphView]) -> dict[str, Any] | None:
    """The stage partition as the nodes' ``meta["stage"]`` tell it; ``None`` without one."""
    counts: dict[str, Counter] = {}
    boundaries: list[dict[str, str]] = []
    for kind, view in views.items():
        for node in view.nodes:
            if node.info.get("stage") is not None:
                counts.setdefault(kind, Counter())[str(node.info["stage"])] += 1
            if node.kind == "stage_boundary":
                boundaries.append({"graph": kind, "node": node.name})
    if not counts and not boundaries:
        return None
    stages = sorted({s for c in counts.values() for s in c})
    return {
        "count": len(stages),
        "marked_nodes": {kind: dict(sorted(c.items())) for kind, c in counts.items()},
        "boundaries": boundaries,
    }


# ----------------------------------------------------------------------------- rendering


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _label(node: NodeView) -> str:
    lines = [node.name, node.target if node.op != "placeholder" else "input"]
    if node.shape:
        lines.append(node.shape)
    if node.kind is not None:
        info = node.info
        parts = [info.get("role"), info.get("layer"), info.get("format"), info.get("rounding")]
        parts.append(info.get("scaling"))
        lines.append(" · ".join(str(p) for p in parts if p not in (None, "", "none")))
    return "\\n".join(_dot_escape(line) for line in lines if line)


def to_dot(view: GraphView, prefix: str) -> str:
    """Graphviz source of a graph: one box per node, lowprec nodes coloured by kind."""
    out = [
        "digraph G {",
        '  graph [rankdir=TB, fontname="Helvetica", bgcolor="white", nodesep=0.25, ranksep=0.3];',
        '  node [shape=box, style="rounded,filled", fillcolor="#ffffff", color="#555555", '
        'fontname="Helvetica", fontsize=9, height=0.3];',
        '  edge [color="#888888", arrowsize=0.5];',
    ]
    for node in view.nodes:
        attrs = {"id": f"{prefix}-{node.name}", "label": _label(node)}
        if node.kind is not None:
            attrs.update({"class": f"lp_{node.kind}", "fillcolor": KINDS[node.kind][0], "penwidth": "1.6"})
        elif node.op == "placeholder":
            attrs.update({"shape": "ellipse", "fillcolor": "#f4f4f4"})
        elif node.op == "output":
            attrs.update({"shape": "ellipse", "fillcolor": "#e8e8e8"})
        body = ", ".join(f'{k}="{v if k == "label" else _dot_escape(v)}"' for k, v in attrs.items())
        out.append(f'  "{node.name}" [{body}];')
    for node in view.nodes:
        for source in dict.fromkeys(node.inputs):
            out.append(f'  "{source}" -> "{node.name}";')
    out.append("}")
    return "\n".join(out) + "\n"


def to_text(view: GraphView) -> str:
    """The graph as text (the fallback where Graphviz is missing)."""
    width = max((len(n.name) for n in view.nodes), default=0)
    lines = []
    for node in view.nodes:
        mark = f"  [{node.kind}]" if node.kind else ""
        lines.append(f"{node.name:<{width}}  {node.op:<13} {node.target}({', '.join(node.inputs)}){mark}")
    return "\n".join(lines) + "\n"


def _warn_no_dot(reason: str) -> None:
    global _warned_dot
    if not _warned_dot:
        _warned_dot = True
        warnings.warn(
            f"lowprec dump: {reason}; graphs are drawn as text (graph.txt) instead of SVG. "
            "Install Graphviz (Debian: apt-get install graphviz) for the pictures.",
            RuntimeWarning,
            stacklevel=3,
        )


def render_svg(dot_source: str) -> str | None:
    """SVG from Graphviz ``dot``; ``None`` (after one warning per process) where it cannot."""
    dot = shutil.which("dot")
    if dot is None:
        _warn_no_dot("Graphviz 'dot' is not on PATH")
        return None
    try:
        done = subprocess.run([dot, "-Tsvg"], input=dot_source, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        _warn_no_dot(f"Graphviz 'dot' failed ({error})")
        return None
    if done.returncode != 0:
        _warn_no_dot(f"Graphviz 'dot' failed: {done.stderr.strip()[:200]}")
        return None
    return done.stdout


def _render(view: GraphView, folder: Path, prefix: str) -> dict[str, Any]:
    source = to_dot(view, prefix)
    (folder / "graph.dot").write_text(source)
    svg = render_svg(source)
    rel = folder.name
    if svg is None:
        (folder / "graph.txt").write_text(to_text(view))
        return {"dot": f"{rel}/graph.dot", "svg": None, "text": f"{rel}/graph.txt"}
    (folder / "graph.svg").write_text(svg)
    return {"dot": f"{rel}/graph.dot", "svg": f"{rel}/graph.svg"}


# ----------------------------------------------------------------------------- index and summary


def _folders(folder: Path) -> list[Path]:
    """The folders in ``folder``, but the hidden ones (graph folders being written or removed)."""
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if not p.name.startswith(".") and p.is_dir()]


def _graph_folders(folder: Path) -> list[Path]:
    return [p for p in _folders(folder) if (p / "manifest.json").is_file()]


def runs(root: Path | str) -> list[Path]:
    """The run folders in ``root`` (those holding graph folders), oldest first."""
    return sorted((p for p in _folders(Path(root)) if _graph_folders(p)), key=lambda p: p.name)


def load_manifests(folder: Path | str) -> list[dict[str, Any]]:
    """The manifests of the graph folders in ``folder`` (a run folder), in dump order."""
    found = []
    for graph in _graph_folders(Path(folder)):
        with contextlib.suppress(ValueError, OSError):
            manifest = json.loads((graph / "manifest.json").read_text())
            if manifest.get("format") == FORMAT:
                found.append(manifest)
    return sorted(found, key=lambda m: _dump_order(m["name"]))


def _dump_order(name: str) -> tuple[int, str]:
    """``<model>_<n>`` by ``n``: compile order."""
    number = name.rsplit("_", 1)[-1]
    return (int(number) if number.isdigit() else 1 << 30, name)


def _inserted_counts(manifest: dict[str, Any], graph: str = "dynamo") -> dict[str, Counter]:
    """Per layer, the kinds of the lowprec nodes in one of the graphs."""
    table: dict[str, Counter] = {}
    for node in manifest["inserted"]:
        if node["graph"] == graph:
            table.setdefault(str(node.get("layer") or "-"), Counter())[node["kind"]] += 1
    return table


def _rounded(record: Any) -> dict[str, dict[str, str]]:
    """Per layer of the graph (checkpoint bodies, branches and Function bodies included), how
    each of its roles is rounded (:meth:`~lpcompile.passes.driver.Site.spec`)."""
    rounded: dict[str, dict[str, str]] = {}
    for site in getattr(record, "sites", {}).values():
        rounded.setdefault(site.layer, {})[site.option] = site.spec()
    return rounded


def _rounded_groups(manifest: dict[str, Any]) -> dict[str, list[str]]:
    """The manifest's layers grouped by how their roles are rounded."""
    groups: dict[str, list[str]] = {}
    for layer, found in (manifest.get("rounded") or {}).items():
        spec = ", ".join(f"{role} {found[role]}" for role in (*ROLES, *PER_MATMUL) if role in found)
        groups.setdefault(spec, []).append(layer)
    return groups


CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.swatch { display: inline-block; width: 1em; height: 1em; border: 1px solid #555; vertical-align: middle; }
.legend span.item { margin-right: 1.2em; }
figure { margin: 0.5em 0 2em; border: 1px solid #ddd; padding: 0.5em; }
figure svg { max-width: 100%; height: auto; }
pre.graph-text { font-size: 12px; }
"""

RENDER_CHECK = """
(function () {
  const out = [];
  document.querySelectorAll("figure.graph").forEach(function (fig) {
    const svg = fig.querySelector("svg");
    const box = svg ? svg.getBBox() : {width: 0, height: 0};
    out.push({dump: fig.dataset.dump, graph: fig.dataset.graph, expected: Number(fig.dataset.nodes),
              nodes: fig.querySelectorAll(".node").length,
              width: Math.round(box.width), height: Math.round(box.height)});
  });
  document.getElementById("render-check").textContent = JSON.stringify(out);
})();
"""


def _cell(value: Any, numeric: bool = False) -> str:
    return f'<td class="n">{value}</td>' if numeric else f"<td>{html.escape(str(value))}</td>"


def _link(root: Path, folder: str, rel: str | None) -> str:
    if not rel:
        return ""
    name = html.escape(rel.rsplit("/", 1)[-1])
    return f'<a href="{html.escape(folder)}/{html.escape(rel)}">{name}</a>'


def _write_whole(path: Path, text: str) -> None:
    """Write ``path`` through a hidden file renamed over it: readers see the old file or the new."""
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text(text)
    os.replace(part, path)


def write_index(root: Path | str) -> Path:
    """Write ``root/index.html`` for a run folder: every dumped graph, its passes and its pictures."""
    root = Path(root)
    manifests = load_manifests(root)
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8"><title>lowprec dump</title>',
        f"<style>{CSS}</style></head><body>",
        "<h1>lowprec dump</h1>",
        f"<p>{len(manifests)} compiled graph(s) · torch {html.escape(torch.__version__)} · "
        'written by <code>lpcompile.tools.dump</code> · <a href="../index.html">all runs</a></p>',
        '<h2>Graphs</h2><table id="graphs"><tr><th>graph</th><th>model</th><th>id</th><th>recipe</th>'
        "<th>executor</th><th>passes</th><th>lowprec nodes (dynamo graph)</th><th>kernels</th>"
        "<th>stages</th></tr>",
    ]
    for m in manifests:
        counts = Counter(n["kind"] for n in m["inserted"] if n["graph"] == "dynamo")
        config = m.get("config") or {}
        stages = m["stages"]["count"] if m.get("stages") else "none"
        parts.append(
            f'<tr><td><a href="#{html.escape(m["name"])}">{html.escape(m["name"])}</a></td>'
            + _cell(m["model"])
            + _cell(m["graph_id"], True)
            + _cell(config.get("recipe", ""))
            + _cell(m.get("executor") or "")
            + _cell(len(m["passes"]), True)
            + _cell(", ".join(f"{counts[k]} {k}" for k in KINDS if counts[k]) or "none")
            + _cell(m["kernels"]["count"], True)
            + _cell(stages)
            + "</tr>"
        )
    parts.append("</table>")
    parts.append(
        '<h2>Passes</h2><table id="passes"><tr><th>graph</th><th>#</th><th>pass</th><th>on</th>'
        "<th>ms</th><th>+nodes</th><th>−nodes</th><th>after</th><th>diff</th></tr>"
    )
    for m in manifests:
        for p in m["passes"]:
            parts.append(
                "<tr>"
                + _cell(m["name"])
                + _cell(p["order"], True)
                + _cell(p["name"])
                + _cell(p["graph"])
                + _cell(f"{p['seconds'] * 1e3:.2f}", True)
                + _cell(p["nodes_added"], True)
                + _cell(p["nodes_removed"], True)
                + f"<td>{_link(root, m['name'], p['file'])}</td><td>{_link(root, m['name'], p['diff'])}</td>"
                + "</tr>"
            )
    parts.append("</table>")
    parts.append(
        '<p class="legend">'
        + "".join(
            f'<span class="item"><span class="swatch" style="background:{colour}"></span> '
            f"{html.escape(kind)}: {html.escape(text)}</span>"
            for kind, (colour, text) in KINDS.items()
        )
        + "</p>"
    )
    for m in manifests:
        parts.append(f'<section id="{html.escape(m["name"])}"><h2>{html.escape(m["name"])}</h2>')
        kernels = m["kernels"]
        parts.append(
            f"<p>model {html.escape(m['model'])} · kernels: {kernels['count']}"
            + (f" ({html.escape(kernels['note'])})" if kernels.get("note") else "")
            + f" · stages: {'none (no pipeline partition)' if not m.get('stages') else m['stages']['count']}"
            + f' · <a href="{html.escape(m["name"])}/manifest.json">manifest.json</a></p>'
        )
        for kind, info in m["graphs"].items():
            if "nodes" not in info:
                continue
            marked = ", ".join(f"{n} {k}" for k, n in info["lowprec_nodes"].items()) or "no lowprec nodes"
            caption = f"{kind} graph after all passes: {info['nodes']} nodes ({marked})"
            if info.get("note"):
                caption += f". {info['note']}"
            parts.append(
                f'<figure class="graph" data-dump="{html.escape(m["name"])}" '
                f'data-graph="{html.escape(kind)}" data-nodes="{info["nodes"]}">'
                f"<figcaption>{html.escape(caption)} · "
                f"{_link(root, m['name'], info['final'])}</figcaption>"
            )
            if info.get("svg"):
                svg = (root / m["name"] / info["svg"]).read_text()
                parts.append(svg[svg.find("<svg") :])
            else:
                text = (root / m["name"] / info["text"]).read_text().splitlines()
                parts.append(
                    '<pre class="graph-text">'
                    + "\n".join(f'<span class="node">{html.escape(line)}</span>' for line in text)
                    + "</pre>"
                )
            parts.append("</figure>")
        parts.append("</section>")
    parts.append(f'<p id="render-check"></p><script>{RENDER_CHECK}</script></body></html>')
    path = root / "index.html"
    root.mkdir(parents=True, exist_ok=True)
    _write_whole(path, "\n".join(parts) + "\n")
    return path


def _root_page(root: Path) -> str:
    rows = []
    for run in runs(root):
        page = f"{html.escape(run.name)}/index.html"
        graphs = sorted((html.escape(g.name) for g in _graph_folders(run)), key=_dump_order)
        links = ", ".join(f'<a href="{page}#{g}">{g}</a>' for g in graphs)
        run_link = f'<a href="{page}">{html.escape(run.name)}</a>'
        rows.append(f"<tr><td>{run_link}</td>{_cell(len(graphs), True)}<td>{links}</td></tr>")
    return "\n".join(
        [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8"><title>lowprec dump runs</title>',
            f"<style>{CSS}</style></head><body>",
            "<h1>lowprec dump runs</h1>",
            f"<p>{len(rows)} run(s), named &lt;start (UTC)&gt;-&lt;host&gt;-&lt;pid&gt;, oldest first</p>",
            '<table id="runs"><tr><th>run</th><th>graphs</th><th></th></tr>',
            *rows,
            "</table></body></html>",
            "",
        ]
    )


def write_root_index(root: Path | str) -> Path:
    """Write ``root/index.html``: the runs in ``root`` and their graphs.

    Written from the folder listing, then written again until the listing stays as
    written: a writer that changes the listing always writes the page afterwards, so
    the last page written shows every run, however many processes write at once."""
    root = Path(root)
    path = root / "index.html"
    page = _root_page(root)
    while True:
        _write_whole(path, page)
        again = _root_page(root)
        if again == page:
            return path
        page = again


def summary(root: Path | str) -> str:
    """Per graph: lowprec nodes by kind and layer, passes, kernels and stages, as text."""
    manifests = load_manifests(root)
    if not manifests:
        return f"no lowprec dump in {root}\n"
    kinds = list(KINDS)
    lines = []
    for m in manifests:
        config = m.get("config") or {}
        lines.append(
            f"{m['name']}  (graph {m['graph_id']}, recipe {config.get('recipe', '?')}, "
            f"executor {m.get('executor') or '?'})"
        )
        table = _inserted_counts(m)
        header = ["layer", *kinds, "total"]
        rows = [[layer, *(str(c[k]) for k in kinds), str(sum(c.values()))] for layer, c in table.items()]
        totals = Counter()
        for c in table.values():
            totals.update(c)
        rows.append(["total", *(str(totals[k]) for k in kinds), str(sum(totals.values()))])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
            lines.append("  " + "  ".join(cells))
        per_graph = ", ".join(
            f"{kind} {sum(info.get('lowprec_nodes', {}).values())}/{info['nodes']}"
            for kind, info in m["graphs"].items()
            if "nodes" in info
        )
        lines.append(f"  lowprec nodes / all nodes: {per_graph}")
        for spec, layers in _rounded_groups(m).items():
            lines.append(f"  rounded ({spec}): {', '.join(layers)}")
        done = [f"{p['graph']}:{p['name']} +{p['nodes_added']}/-{p['nodes_removed']}" for p in m["passes"]]
        lines.append("  passes: " + (", ".join(done) or "none"))
        kernels = m["kernels"]["count"]
        if (m.get("config") or {}).get("codegen") == "triton":
            why = "codegen='triton': no lowprec operators to fuse"
        elif m.get("executor") == "eager":
            why = "executor='eager': none"
        else:
            why = "codegen='inductor': Inductor's own"
        note = "" if kernels else f" ({why})"
        lines.append(f"  kernels: {kernels}{note}")
        stages = m.get("stages")
        lines.append(f"  stages: {stages['count'] if stages else 'none (no pipeline partition)'}")
        kept = [f"{k['layer']} ({k['op']}: {k['reason']})" for k in m.get("kept", [])]
        lines.append("  left in higher precision: " + (", ".join(kept) or "none"))
        lines.append("")
    return "\n".join(lines)


observe()  # importing the dump (the CLI, LOWPREC_DUMP at import lpcompile) turns it on
