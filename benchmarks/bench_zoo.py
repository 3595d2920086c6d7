"""The model zoo (examples/zoo.py): step time, cold compile time, coverage and memory.

For each model and variant (fp32 eager, fp32 Inductor, lowprec ``fp8-e5m2-sr`` with
the Inductor executor and attention quantized), a fresh Python process with an empty
Inductor cache times the first training step (forward, backward, SGD: the cold
compile) and then the median of later steps. The lowprec process also reports the
products ``lpcompile.coverage`` lists as rounded and as kept; every process its peak
resident memory. The script runs unchanged on a GPU host (``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import write_results
from examples.zoo import ZOO

VARIANTS = {
    "eager": None,
    "inductor": "inductor",
    "lowprec": {"recipe": "fp8-e5m2-sr", "attention": "operands"},
}

CHILD = """
import json, resource, statistics, sys, time, warnings
import torch
import lpcompile
from examples.zoo import zoo_model

name, backend, device, steps = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
warnings.simplefilter("ignore")
torch._dynamo.config.allow_rnn = True  # as the lowprec backend sets it: fp32 Inductor compiles RNNs too
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
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

def step():
    out = run(**inputs)
    out = out.logits if hasattr(out, "logits") else out
    loss = out.float().square().mean()
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    sync()

start = time.perf_counter()
step()
first = time.perf_counter() - start
times = []
for _ in range(steps):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
rows = lpcompile.coverage(model) if isinstance(backend, dict) else []
usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
print(json.dumps({
    "first": first,
    # every step's time beyond the median: compiles that happen after the first step too
    "compile": first + sum(times) - (steps + 1) * statistics.median(times),
    "cpu": sum(u.ru_utime + u.ru_stime for u in usage),
    "step": statistics.median(times),
    "rounded": sum(1 for r in rows if r.quantized),
    "kept": sum(1 for r in rows if r.kept),
    "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def measure(name: str, backend: object, device: str, steps: int) -> dict:
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(root)}
        out = subprocess.run(
            [sys.executable, "-c", CHILD, name, json.dumps(backend), device, str(steps)],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
        )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1][:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows = [
        "| model | step ms: eager | inductor | lowprec | lowprec / inductor | cold compile s: inductor"
        " | lowprec | ratio | products rounded / kept | peak MB: inductor | lowprec |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in args.models:
        r = {
            variant: measure(name, backend, args.device, args.steps) for variant, backend in VARIANTS.items()
        }
        print(name, json.dumps(r), flush=True)
        if any("error" in v for v in r.values()):
            errors = "; ".join(f"{k}: {v['error']}" for k, v in r.items() if "error" in v)
            rows.append(f"| {name} | {errors} |" + " |" * 9)
            continue
        e, i, lp = r["eager"], r["inductor"], r["lowprec"]
        rows.append(
            f"| {name} | {e['step'] * 1e3:.2f} | {i['step'] * 1e3:.2f} | {lp['step'] * 1e3:.2f}"
            f" | {lp['step'] / i['step']:.2f} | {i['first']:.1f} | {lp['first']:.1f}"
            f" | {lp['first'] / i['first']:.2f}"
            f" | {lp['rounded']} / {lp['kept']} | {i['peak_mb']:.0f} | {lp['peak_mb']:.0f} |"
        )
    command = "python -m benchmarks.bench_zoo " + " ".join(sys.argv[1:])
    body = "\n".join(rows) + (
        f"\n\nCommand: `{command}` (device {args.device}). One process per model and variant, each with an"
        " empty Inductor cache: the cold compile is the first training step (forward, backward, SGD),"
        f" the step time the median of the {args.steps} steps after it. lowprec: `fp8-e5m2-sr`,"
        ' `attention="operands"`, Inductor executor. Products: rows of `lpcompile.coverage`'
        " (a layer's product rounded, or kept in higher precision). Peak MB: the process's peak"
        " resident memory, compile included. One run: this machine drifts by up to 60% between runs."
    )
    print(body)
    write_results("zoo", "Model zoo: step, compile, coverage, memory (bench_zoo.py)", body)


if __name__ == "__main__":
    main()
