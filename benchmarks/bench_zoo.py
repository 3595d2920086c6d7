"""The model zoo (examples/zoo.py): step time, cold compile time, coverage and memory.

For each model and variant (fp32 eager, fp32 Inductor, lowprec ``fp8-e5m2-sr`` with
the Inductor executor and attention quantized), a fresh Python process with an empty
Inductor cache times the first training step (forward, backward, SGD: the cold
compile) and then the median of later steps. The lowprec process also reports the
products ``lpcompile.coverage`` lists as rounded and as kept; every process its peak
resident memory. ``--interleaved`` compiles fp32 Inductor and lowprec in one process
instead and alternates their steps, so that both see the same drift of the machine
(step times only). ``--recipe`` measures another lowprec recipe (``fp8-tensorwise``, ...).
The script runs unchanged on a GPU host (``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import write_results
from examples.zoo import ZOO


def variants(recipe: str) -> dict[str, object]:
    """The measured variants' backends: fp32 eager, fp32 Inductor, lowprec with ``recipe``."""
    return {"eager": None, "inductor": "inductor", "lowprec": {"recipe": recipe, "attention": "operands"}}


CHILD = """
import json, resource, statistics, sys, time, warnings
import torch
import lpcompile
from examples.zoo import output_tensor, zoo_model

name, backends, device, steps = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
warnings.simplefilter("ignore")
torch._dynamo.config.allow_rnn = True  # as the lowprec backend sets it: fp32 Inductor compiles RNNs too
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

def training_step(backend):
    torch.manual_seed(0)
    model, inputs = zoo_model(name)
    model = model.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    if backend is None:
        run = model
    elif backend == "inductor":
        run = torch.compile(model)
    else:
        run = torch.compile(model, backend="lowprec", options=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    config = lpcompile.LowPrecConfig.from_options(backend) if isinstance(backend, dict) else None
    adaptive = config is not None and config.loss_scale == "adaptive"
    scaler = lpcompile.LossScaler("adaptive" if adaptive else "static", enabled=adaptive)

    def step():
        out = run(**inputs)
        out = output_tensor(out)
        loss = out.float().square().mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        sync()

    return model, step

models, runs, firsts = [], [], []
for backend in backends:  # each compiled and run once (its cold compile) before the next
    model, step = training_step(backend)
    start = time.perf_counter()
    step()
    firsts.append(time.perf_counter() - start)
    models.append(model)
    runs.append(step)
times = [[] for _ in runs]
for _ in range(steps):  # several backends: their steps alternate
    for step, taken in zip(runs, times):
        start = time.perf_counter()
        step()
        taken.append(time.perf_counter() - start)
usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
results = []
for backend, model, first, taken in zip(backends, models, firsts, times):
    rows = lpcompile.coverage(model) if isinstance(backend, dict) else []
    results.append({
        "first": first,
        # every step's time beyond the median: compiles that happen after the first step too
        "compile": first + sum(taken) - (steps + 1) * statistics.median(taken),
        "cpu": sum(u.ru_utime + u.ru_stime for u in usage),  # the process's
        "step": statistics.median(taken),
        "rounded": sum(1 for r in rows if r.quantized),
        "kept": sum(1 for r in rows if r.kept),
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # the process's
    })
print(json.dumps(results))
"""


def measure(name: str, backends: list, device: str, steps: int) -> list[dict]:
    """One process: each backend's first step (cold compile), then their steps alternating."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(root)}
        out = subprocess.run(
            [sys.executable, "-c", CHILD, name, json.dumps(backends), device, str(steps)],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
        )
    if out.returncode != 0:
        return [{"error": out.stderr.strip().splitlines()[-1][:120]}] * len(backends)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(values: list[float], digits: int) -> str:
    """The median of repeated measurements, with their range when there are several."""
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def row(name: str, repeats: list[dict[str, dict]]) -> str:
    """One model's line of the table from its repeats."""
    errors = [f"{k}: {v['error']}" for r in repeats for k, v in r.items() if "error" in v]
    if errors:
        return f"| {name} | {errors[0]} |" + " |" * 9

    def each(variant: str, key: str, scale: float = 1.0) -> list[float]:
        return [r[variant][key] * scale for r in repeats]

    step_ratio = [r["lowprec"]["step"] / r["inductor"]["step"] for r in repeats]
    compile_ratio = [r["lowprec"]["first"] / r["inductor"]["first"] for r in repeats]
    lp = repeats[0]["lowprec"]
    return (
        f"| {name} | {spread(each('eager', 'step', 1e3), 2)} | {spread(each('inductor', 'step', 1e3), 2)}"
        f" | {spread(each('lowprec', 'step', 1e3), 2)} | {spread(step_ratio, 2)}"
        f" | {spread(each('inductor', 'first'), 1)} | {spread(each('lowprec', 'first'), 1)}"
        f" | {spread(compile_ratio, 2)} | {lp['rounded']} / {lp['kept']}"
        f" | {max(each('inductor', 'peak_mb')):.0f} | {max(each('lowprec', 'peak_mb')):.0f} |"
    )


def interleaved_row(name: str, repeats: list[dict[str, dict]]) -> str:
    """One model's line of the --interleaved table from its repeats."""
    errors = [f"{k}: {v['error']}" for r in repeats for k, v in r.items() if "error" in v]
    if errors:
        return f"| {name} | {errors[0]} |" + " |" * 2
    ratio = [r["lowprec"]["step"] / r["inductor"]["step"] for r in repeats]
    inductor, lowprec = ([r[v]["step"] * 1e3 for r in repeats] for v in ("inductor", "lowprec"))
    return f"| {name} | {spread(inductor, 2)} | {spread(lowprec, 2)} | {spread(ratio, 2)} |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1, help="processes per model and variant")
    parser.add_argument("--name", help="results file: benchmarks/results/<name>.md")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--recipe", default="fp8-e5m2-sr", help="lowprec's recipe")
    parser.add_argument(
        "--interleaved", action="store_true", help="fp32 Inductor and lowprec in one process, alternating"
    )
    args = parser.parse_args()
    if args.interleaved:
        interleaved(args)
        return
    backends = variants(args.recipe)
    # a repeat measures the three variants back to back: its ratios compare neighbours in time
    tabulate(
        args,
        "| model | step ms: eager | inductor | lowprec | lowprec / inductor | cold compile s: inductor"
        " | lowprec | ratio | products rounded / kept | peak MB: inductor | lowprec |",
        lambda name: {v: measure(name, [b], args.device, args.steps)[0] for v, b in backends.items()},
        row,
        "One process per model and variant, each with an empty Inductor cache: the cold compile is the"
        " first training step (forward, backward, SGD), the step time the median of the"
        f" {args.steps} steps after it. With --repeats, each cell is the median over the repeats"
        f" (their range in brackets), a ratio taken within each repeat. lowprec: `{args.recipe}`,"
        ' `attention="operands"`, Inductor executor. Products: rows of `lpcompile.coverage`'
        " (a layer's product rounded, or kept in higher precision). Peak MB: the process's peak"
        " resident memory, compile included. This machine drifts by up to 60% between runs.",
        ("zoo", "Model zoo: step, compile, coverage, memory (bench_zoo.py)"),
    )


def interleaved(args: argparse.Namespace) -> None:
    """Step times of fp32 Inductor and lowprec measured in one process, steps alternating."""
    names = ("inductor", "lowprec")
    backends = [variants(args.recipe)[v] for v in names]
    tabulate(
        args,
        "| model | step ms: inductor | lowprec | lowprec / inductor |",
        lambda name: dict(zip(names, measure(name, backends, args.device, args.steps), strict=True)),
        interleaved_row,
        "One process per model with an empty Inductor cache compiles fp32 Inductor's training step"
        " (forward, backward, SGD) and then lowprec's, and alternates their steps"
        f" {args.steps} times: each cell is the median step, and both variants see the same drift"
        " of the machine. With --repeats, the median over the processes (their range in brackets),"
        f' a ratio taken within each. lowprec: `{args.recipe}`, `attention="operands"`, Inductor executor.',
        ("zoo_interleaved", "Model zoo: step times in one process (bench_zoo.py --interleaved)"),
    )


def tabulate(
    args: argparse.Namespace,
    header: str,
    repeat: Callable[[str], dict[str, dict]],
    row_of: Callable[[str, list[dict[str, dict]]], str],
    note: str,
    results: tuple[str, str],
) -> None:
    """Measure each model ``args.repeats`` times, print and write the table of their rows."""
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for name in args.models:
        repeats = [repeat(name) for _ in range(args.repeats)]
        print(name, json.dumps(repeats), flush=True)
        rows.append(row_of(name, repeats))
    command = "python -m benchmarks.bench_zoo " + " ".join(sys.argv[1:])
    body = "\n".join(rows) + f"\n\nCommand: `{command}` (device {args.device}). {note}"
    print(body)
    default_name, title = results
    write_results(args.name or default_name, title, body)


if __name__ == "__main__":
    main()
