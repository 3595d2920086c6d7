"""Where a cold compile's time goes: one zoo model's first training step under cProfile,
with fp32 Inductor or lowprec (``fp8-e5m2-sr``), in this process with an empty Inductor
cache. Prints the functions that took longest, cumulatively, then lowprec's own, then
those with the most time of their own.

    python scripts/profile_compile.py gpt2 --backend lowprec --device cuda
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="a model of examples/zoo.py")
    parser.add_argument("--backend", choices=["inductor", "lowprec"], default="lowprec")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--top", type=int, default=40, help="functions listed")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()  # before Inductor reads it

    import torch

    from examples.zoo import output_tensor, zoo_model

    torch.manual_seed(0)
    model, inputs = zoo_model(args.model)
    model = model.to(args.device)
    inputs = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    options = {"options": {"recipe": "fp8-e5m2-sr"}} if args.backend == "lowprec" else {}
    run = torch.compile(model, backend=args.backend, **options)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    out = run(**inputs)
    out = output_tensor(out)
    out.float().square().mean().backward()
    if args.device != "cpu":
        torch.accelerator.synchronize()
    profile.disable()
    print(f"{args.model} {args.backend} on {args.device}: first step {time.perf_counter() - start:.1f} s")
    print(torch._dynamo.utils.compile_times(repr="str", aggregate=True))  # by compile phase
    stats = pstats.Stats(profile).sort_stats("cumulative")
    stats.print_stats(args.top)
    stats.print_stats("lpcompile", args.top)  # lowprec's own functions
    stats.sort_stats("tottime").print_stats(args.top)  # where the time itself is spent


if __name__ == "__main__":
    main()
