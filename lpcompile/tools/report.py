"""Training telemetry, and ``lowprec report``: plots and a short page from it.

A training run records, per step, the loss, the step time and the loss scale
(:class:`RunTelemetry`), and per layer, when a per-layer scaler fills them in,
scales and underflow/overflow fractions. It writes one JSON file per run,
``DIR/telemetry/<run>.json``, when ``LOWPREC_DUMP=DIR`` is set (or to a path
it is given). :func:`write_report` turns the runs of a folder into PNG plots
(matplotlib, Agg, no display needed) and ``report.html`` / ``report.md``.

The file (``"format": "lowprec-telemetry/1"``)::

    {"format": ..., "name": "fp8-e5m2-sr", "meta": {...},
     "steps": {"step": [0, 1, ...], "loss": [...], "step_time": [...],
               "loss_scale": [...], "skipped": [...]},
     "layers": {"features.0": {"step": [...], "scale": [...],
                               "underflow": [...], "overflow": [...]}},
     "result": {...}}

Every per-step list is optional except ``step``; ``layers`` may be empty.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lpcompile.numerics.checks import check_count

TELEMETRY_FORMAT = "lowprec-telemetry/1"
STEP_FIELDS = ("loss", "step_time", "loss_scale", "skipped")
LAYER_FIELDS = ("scale", "underflow", "overflow")
FLAG_FIELDS = ("skipped",)  # series of flags: bools are numbers there, and only there
FINITE_FIELDS = ("step_time",)  # series that are measurements: no NaN or inf


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.") or "run"


def telemetry_path(name: str, path: str | os.PathLike | None = None) -> Path | None:
    """Where run ``name`` writes its telemetry: ``path``, else under ``LOWPREC_DUMP``, else nowhere."""
    if path is not None:
        return Path(path)
    from lpcompile.tools.dump import dump_dir

    root = dump_dir()
    return None if root is None else root / "telemetry" / f"{_slug(name)}.json"


@dataclass
class RunTelemetry:
    """Per-step and per-layer records of one training run."""

    name: str
    meta: dict[str, Any] = field(default_factory=dict)
    steps: dict[str, list[Any]] = field(default_factory=lambda: {"step": []})
    layers: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)

    def step(self, **values: Any) -> None:
        """Record one step: any of ``loss``, ``step_time`` (s), ``loss_scale``, ``skipped``
        (or other columns; ``step`` is the record's own index)."""
        if "step" in values:
            raise ValueError("RunTelemetry.step numbers the steps itself: 'step' is not a column")
        index = len(self.steps["step"])
        self.steps["step"].append(index)
        for key, value in values.items():
            column = self.steps.setdefault(key, [None] * index)
            column.extend([None] * (index - len(column)))
            column.append(_plain(value))

    def layer(self, name: str, step: int, **values: float | None) -> None:
        """Record a layer at ``step``: any of ``scale``, ``underflow``, ``overflow`` (fractions)."""
        check_count("step", step)
        record = self.layers.setdefault(name, {"step": []})
        index = len(record["step"])
        record["step"].append(step)
        for key, value in values.items():
            column = record.setdefault(key, [None] * index)
            column.extend([None] * (index - len(column)))
            column.append(_plain(value))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": TELEMETRY_FORMAT,
            "name": self.name,
            "meta": self.meta,
            "steps": self.steps,
            "layers": self.layers,
            "result": self.result,
        }

    def write(self, path: str | os.PathLike, keep_existing: bool = False) -> Path:
        """Write the JSON file at ``path`` whole (readers see no partial file) and return
        its path. ``keep_existing``: where ``path`` exists (another run of that name, in any
        process), write ``<stem>-2.json``, ``-3``, … instead of replacing it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}")
        part.write_text(json.dumps(self.to_json(), default=str) + "\n")
        if not keep_existing:
            os.replace(part, path)
            return path
        target, n = path, 1
        try:
            while True:
                try:
                    os.link(part, target)  # fails where the name is taken, even by a racing run
                    return target
                except FileExistsError:
                    n += 1
                    target = path.with_name(f"{path.stem}-{n}{path.suffix}")
        finally:
            part.unlink()


def _plain(value: Any) -> Any:
    """A NumPy scalar or one-element tensor as a Python number (JSON would write it as a string)."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value


def load_runs(root: str | os.PathLike) -> list[dict[str, Any]]:
    """The telemetry files in ``root``, ``root/telemetry`` (or ``root`` itself, a file), by name."""
    root = Path(root)
    paths = [root] if root.is_file() else [*root.glob("*.json"), *root.glob("telemetry/*.json")]
    runs = []
    for path in sorted(paths):
        try:
            data = json.loads(path.read_text())
        except (ValueError, OSError) as error:
            warnings.warn(f"{path}: not readable as JSON ({error}); file skipped", stacklevel=2)
            continue
        if isinstance(data, dict) and data.get("format") == TELEMETRY_FORMAT:
            data["path"] = str(path)
            # a file written by hand or cut short may lack sections: treat them as empty
            data.setdefault("name", path.stem)
            data.setdefault("layers", {})
            data.setdefault("steps", {})
            try:
                _check_run(data, path)
            except ValueError as error:
                warnings.warn(f"{error}; file skipped", stacklevel=2)
                continue
            data["steps"].setdefault("step", [])
            runs.append(data)
    return runs


def _numbers(values: Any, nulls: bool = True, flags: bool = False, finite: bool = False) -> bool:
    """A list of numbers a float holds, or nulls; bools only where ``flags`` (``skipped``
    holds flags, a loss never does), and only finite values where ``finite``."""
    if not isinstance(values, list):
        return False
    for v in values:
        if v is None and nulls:
            continue
        if not isinstance(v, int | float) or (isinstance(v, bool) and not flags):
            return False
        try:
            value = float(v)
        except OverflowError:  # an int beyond float's range
            return False
        if finite and not math.isfinite(value):
            return False
    return True


def _check_run(data: dict[str, Any], path: Path) -> None:
    """Raise ``ValueError`` naming ``path`` where the sections the report reads do not
    have the file's shape."""
    layers = data["layers"]
    if not isinstance(layers, dict):
        raise ValueError(f"{path}: 'layers' must map layer names to series, got {type(layers).__name__}")
    if not isinstance(data["name"], str) or not isinstance(data.get("result", {}), dict):
        raise ValueError(f"{path}: 'name' must be a string and 'result' a dict")
    series = {"steps": (data["steps"], STEP_FIELDS)}
    series.update({f"layers[{name!r}]": (layer, LAYER_FIELDS) for name, layer in layers.items()})
    for where, (lists, fields) in series.items():
        if not isinstance(lists, dict):
            raise ValueError(f"{path}: {where} must map names to lists, got {type(lists).__name__}")
        if where != "steps" and "step" not in lists:
            raise ValueError(f"{path}: {where} has no 'step' list")
        if "step" in lists and not _numbers(lists["step"], nulls=False):
            raise ValueError(f"{path}: {where}['step'] must be a list of numbers")
        for key in fields:  # the series the report reads; others are the writer's own
            flags, finite = key in FLAG_FIELDS, key in FINITE_FIELDS
            if key in lists and not _numbers(lists[key], flags=flags, finite=finite):
                what = "finite numbers" if finite else "numbers" if not flags else "numbers or flags"
                raise ValueError(f"{path}: {where}[{key!r}] must be a list of {what} (or null)")
        steps = len(lists.get("step", []))
        if longer := [key for key in fields if len(lists.get(key, [])) > steps]:
            raise ValueError(f"{path}: {where} has {longer} longer than its 'step' list ({steps})")


# ----------------------------------------------------------------------------- plots


def _figure(width: float = 7.0, height: float = 4.0) -> Any:
    from matplotlib.figure import Figure  # the object API: no pyplot, no global backend

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _series(values: list[Any]) -> tuple[list[int], list[float]]:
    points = [(i, float(v)) for i, v in enumerate(values) if v is not None and math.isfinite(float(v))]
    return [p[0] for p in points], [p[1] for p in points]


def _plot_steps(
    runs: list[dict[str, Any]], key: str, ylabel: str, path: Path, scale: float = 1.0, log: bool = False
) -> Path | None:
    fig = _figure()
    ax = fig.add_subplot()
    drawn = False
    for run in runs:
        steps = run["steps"]
        if key not in steps:
            continue
        xs, ys = _series(steps[key])
        if not xs:
            continue
        step = steps["step"]
        ax.plot([step[i] for i in xs], [y * scale for y in ys], label=run["name"], linewidth=1.2)
        drawn = True
    if not drawn:
        return None
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log", base=2 if key == "loss_scale" else 10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path)
    return path


def _plot_layer_scales(runs: list[dict[str, Any]], path: Path) -> Path | None:
    with_scales = [r for r in runs if any("scale" in layer for layer in r["layers"].values())]
    if not with_scales:
        return None
    fig = _figure(7.0, 3.2 * len(with_scales))
    for i, run in enumerate(with_scales, 1):
        ax = fig.add_subplot(len(with_scales), 1, i)
        for name, layer in run["layers"].items():
            xs, ys = _series(layer.get("scale", []))
            if xs:
                ax.step([layer["step"][j] for j in xs], ys, where="post", label=name, linewidth=1.2)
        ax.set_yscale("log", base=2)
        ax.set_title(f"{run['name']}: per-layer loss scale", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("scale")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.savefig(path)
    return path


def _plot_layer_heatmap(runs: list[dict[str, Any]], key: str, path: Path) -> Path | None:
    with_key = [r for r in runs if any(key in layer for layer in r["layers"].values())]
    if not with_key:
        return None
    import numpy as np

    fig = _figure(7.0, 0.6 + 2.6 * len(with_key))
    for i, run in enumerate(with_key, 1):
        names = [n for n, layer in run["layers"].items() if key in layer]
        steps = sorted({s for n in names for s in run["layers"][n]["step"]})
        column = {s: j for j, s in enumerate(steps)}
        grid = np.full((len(names), len(steps)), np.nan)
        for row, name in enumerate(names):
            layer = run["layers"][name]
            for s, v in zip(layer["step"], layer[key], strict=False):
                if v is not None:
                    grid[row, column[s]] = float(v)
        ax = fig.add_subplot(len(with_key), 1, i)
        image = ax.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap="magma",
            vmin=0.0,
            vmax=max(float(np.nanmax(grid)) if np.isfinite(grid).any() else 0.0, 1e-6),
        )
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ticks = np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int)
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks], fontsize=7)
        ax.set_xlabel("step")
        ax.set_title(f"{run['name']}: {key} fraction per layer", fontsize=10)
        fig.colorbar(image, ax=ax, label=f"{key} fraction")
    fig.savefig(path)
    return path


# ----------------------------------------------------------------------------- page


def _summary_row(run: dict[str, Any]) -> dict[str, str]:
    steps = run["steps"]
    losses = [v for v in steps.get("loss", []) if v is not None]
    times = [v for v in steps.get("step_time", []) if v is not None]
    skipped = sum(1 for v in steps.get("skipped", []) if v)
    result = run.get("result") or {}
    accuracy = result.get("test_accuracy")
    # the run's own final loss (mean over its last epoch, as `lowprec demo` prints), else the last step's
    final = result.get("final_loss", losses[-1] if losses else None)
    return {
        "run": run["name"],
        "steps": str(len(steps["step"])),
        "final loss": f"{final:.4f}" if isinstance(final, int | float) else "-",
        "median step ms": f"{statistics.median(times[1:] or times) * 1e3:.2f}" if times else "-",
        "skipped": str(skipped),
        "layers": str(len(run["layers"])),
        "test acc %": f"{accuracy:.2f}" if isinstance(accuracy, int | float) else "-",
    }


def write_report(root: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Plot the runs recorded under ``root`` into ``out`` (default ``root/report``); the HTML page."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    runs = load_runs(root)
    if not runs:
        raise FileNotFoundError(f"no telemetry ({TELEMETRY_FORMAT} JSON) in {root} or {root / 'telemetry'}")
    out = Path(out) if out is not None else (root if root.is_dir() else root.parent) / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = [
        ("Loss", _plot_steps(runs, "loss", "training loss", out / "loss.png")),
        ("Step time", _plot_steps(runs, "step_time", "step time (ms)", out / "step_time.png", 1e3, log=True)),
        ("Loss scale", _plot_steps(runs, "loss_scale", "loss scale", out / "loss_scale.png", log=True)),
        ("Per-layer loss scale", _plot_layer_scales(runs, out / "layer_scale.png")),
        ("Per-layer underflow", _plot_layer_heatmap(runs, "underflow", out / "underflow.png")),
        ("Per-layer overflow", _plot_layer_heatmap(runs, "overflow", out / "overflow.png")),
    ]
    plots = [(title, path) for title, path in plots if path is not None]
    rows = [_summary_row(r) for r in runs]
    missing = (
        []
        if any(r["layers"] for r in runs)
        else [
            "No per-layer telemetry in these runs (per-layer scales and underflow/overflow fractions are "
            "recorded by adaptive loss scaling)."
        ]
    )
    columns = list(rows[0])

    md = ["# lowprec report", "", f"{len(runs)} run(s) from `{root}`.", ""]
    md += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(row[c] for c in columns) + " |" for row in rows]
    md += [""] + [f"{note}\n" for note in missing]
    for title, path in plots:
        md += [f"## {title}", "", f"![{title}]({path.name})", ""]
    (out / "report.md").write_text("\n".join(md))

    page = [
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>lowprec report</title>',
        "<style>body{font:14px/1.4 system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse}"
        "th,td{border:1px solid #ccc;padding:2px 8px}img{max-width:100%}</style></head><body>",
        f"<h1>lowprec report</h1><p>{len(runs)} run(s) from <code>{html.escape(str(root))}</code>.</p>",
        "<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in columns) + "</tr>",
        *("<tr>" + "".join(f"<td>{html.escape(row[c])}</td>" for c in columns) + "</tr>" for row in rows),
        "</table>",
        *(f"<p>{html.escape(note)}</p>" for note in missing),
        *(f'<h2>{html.escape(t)}</h2><img src="{p.name}" alt="{html.escape(t)}">' for t, p in plots),
        "</body></html>",
    ]
    path = out / "report.html"
    path.write_text("\n".join(page) + "\n")
    return path
