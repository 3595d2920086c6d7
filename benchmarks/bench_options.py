"""A/B of lowprec options on one model's training step, in one process.

Each variant is the recipe's options with overrides from the command line
(``--variant conv=aten --variant wrapper=python``); "base (again)", a second
copy of the base, is an A/A control: how far two identical steps drift apart
on this machine in the same rounds. Only a ratio well outside that spread
means something.

Every variant must compile on its own. Dynamo reuses a compiled graph for a
new model instance, even from another ``torch.compile`` call, whenever the
backend options are equal; so each variant gets a seed of its own (which
changes the random bits, not the work), and the script checks that every
variant compiled. An A/B that changes module state between two compiles with
equal options times one graph twice.
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.bench_train_step import CASES, step_fn
from benchmarks.common import interleaved_times, write_results
from lpcompile.backend import REGISTRY

MODELS = dict(zip(("mlp", "cnn", "cnn32"), CASES, strict=True))
BLOCK = 10


def parse_variant(text: str) -> dict[str, object]:
    """``"key=value"`` (value as JSON where it parses, else a string) -> ``{key: value}``."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--variant: expected KEY=VALUE, got {text!r}")
    try:
        return {key: json.loads(value)}
    except json.JSONDecodeError:
        return {key: value}


def compiled_steps(case: str, base: dict, variants: dict[str, dict]) -> dict:
    """One step function per variant, each compiled (by its first call) under its own seed."""
    model_fn, x, y = CASES[case]
    steps = {}
    for i, (name, overrides) in enumerate(variants.items()):
        before = REGISTRY.graph_count
        steps[name] = step_fn(model_fn, x, y, {**base, "seed": 1000 + i, **overrides})
        steps[name]()
        if REGISTRY.graph_count == before:
            raise RuntimeError(f"variant {name!r} did not compile: it would time another variant's graph")
    return steps


def round_ratios(times: dict[str, list[float]], base: str, block: int) -> dict[str, list[float]]:
    """Per round, each variant's median step over the base's (timed in blocks taken in turn)."""
    def per_round(ts: list[float]) -> list[float]:
        return [statistics.median(ts[i : i + block]) for i in range(0, len(ts), block)]

    medians = {name: per_round(ts) for name, ts in times.items()}
    return {name: [m / b for m, b in zip(ms, medians[base], strict=True)] for name, ms in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="cnn")
    parser.add_argument("--recipe", default="fp8-e5m2-sr")
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=24)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds: at least 2 (the table gives quartiles over rounds)")
    case = MODELS[args.model]
    base = {"recipe": args.recipe, "executor": "inductor"}
    variants = {"base": {}, **{text: parse_variant(text) for text in args.variant}, "base (again)": {}}
    steps = compiled_steps(case, base, variants)
    times = interleaved_times(steps, args.rounds, block=BLOCK)
    ratios = round_ratios(times, "base", BLOCK)
    rows = ["| variant | step ms | ÷ base: median | quartiles | min-max |", "|---|---|---|---|---|"]
    for name in variants:
        r = ratios[name]
        q1, q2, q3 = statistics.quantiles(r, n=4)
        line = (
            f"| {name} | {statistics.median(times[name]) * 1e3:.2f} | {q2:.3f} | {q1:.3f}-{q3:.3f} "
            f"| {min(r):.3f}-{max(r):.3f} |"
        )
        rows.append(line)
        print(line, flush=True)
    command = " ".join(
        ["python -m benchmarks.bench_options", f"--model {args.model}", f"--recipe {args.recipe}"]
        + [f"--variant '{text}'" for text in args.variant]
        + [f"--rounds {args.rounds}"]
    )
    body = (
        f"`{command}`\n\n{case}, options {json.dumps(base)} plus each variant's.\n\n"
        + "\n".join(rows)
        + f"\n\nEach round runs {BLOCK} steps of every variant in turn; a round's ratio is the"
        " variant's median step over the base's in that round. \"base (again)\" is the A/A"
        " control: a ratio inside its spread is no difference."
    )
    write_results(f"options_{args.model}", "lowprec options A/B (bench_options.py)", body)


if __name__ == "__main__":
    main()
