"""FP8 training under FSDP2: a small GPT-style byte-level language model on the sources of
Python's standard library, with lowprec's ``fp8-e5m2-als`` recipe (E5M2 products,
stochastic rounding of errors and weight gradients, per-layer adaptive loss scaling).

Run from the repository root, one process per rank (gloo on CPUs, NCCL on GPUs)::

    torchrun --nproc_per_node=2 -m examples.fsdp_gpt [--steps N] [--save DIR] [--resume DIR]

Each block and the root are sharded with ``fully_shard``, then the model is compiled
whole (docs/distributed.md). Each rank trains on its own part of the training text; the
loss printed per step (cross-entropy in nats) and the validation bits per character are
means over the ranks. A step is skipped while the adaptive loss scales calibrate (the
first) or when a gradient overflowed on some rank.
``--save DIR`` writes a ``torch.distributed.checkpoint`` after the last step and
``--resume DIR`` continues from one: the batches of a step follow from (seed, rank,
step), and lowprec's random streams and loss scales travel in the scaler's state.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import lpcompile
from examples.data import load_stdlib_source
from examples.models import TinyGPT


def windows(text: torch.Tensor, starts: torch.Tensor, context: int, device: torch.device):
    """Inputs and next-byte targets of the windows of ``context + 1`` bytes at ``starts``."""
    rows = torch.stack([text[s : s + context + 1] for s in starts.tolist()]).long().to(device)
    return rows[:, :-1], rows[:, 1:]


def random_windows(text: torch.Tensor, count: int, context: int, seed: int, device: torch.device):
    starts = torch.randint(len(text) - context - 1, (count,), generator=torch.Generator().manual_seed(seed))
    return windows(text, starts, context, device)


def rank_mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)  # a sum: gloo has no AVG
    return value.item() / dist.get_world_size()


def save(folder: str, model, opt, scaler: lpcompile.LossScaler, step: int) -> None:
    """docs/distributed.md's recipe: model and optimizer through ``get_state_dict``, the
    scaler's state (SR call counts, adaptive scales) as one blob."""
    blob = io.BytesIO()
    torch.save(scaler.state_dict(), blob)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state, "scaler": blob, "step": torch.tensor(step)}
    dcp.save(state, checkpoint_id=folder)


def resume(folder: str, model, opt, scaler: lpcompile.LossScaler) -> int:
    """Load a checkpoint written by :func:`save`; the number of steps it had trained."""
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state, "scaler": io.BytesIO(), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    state["scaler"].seek(0)
    scaler.load_state_dict(torch.load(state["scaler"]))
    return int(state["step"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=16, help="windows per rank and step")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=4, help="validation batches per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", metavar="DIR", help="write a DCP checkpoint after the last step")
    parser.add_argument("--resume", metavar="DIR", help="continue from a checkpoint written by --save")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    data = load_stdlib_source()
    shard = data.train.chunk(world)[rank]  # each rank reads its own part of the training text
    say(
        f"{len(data.train_files)} files ({len(data.train):,} bytes) to train on, {world} ranks,"
        f" {len(data.validation_files)} files ({len(data.validation):,} bytes) to validate"
    )

    torch.manual_seed(args.seed)  # the same initial weights on every rank: FSDP2 keeps each rank's shard
    model = TinyGPT(width=args.width, depth=args.depth, context=args.context).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    run = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-als"})
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = lpcompile.LossScaler("adaptive")  # agrees over the ranks: skips and scales alike
    start = resume(args.resume, model, opt, scaler) if args.resume else 0
    if args.resume:
        say(f"resumed from {args.resume} after step {start}")

    began = time.perf_counter()
    for step in range(start, start + args.steps):
        # the batch follows from (seed, rank, step); lowprec folds the rank into its SR seed
        x, y = random_windows(shard, args.batch, args.context, hash((args.seed, rank, step)), device)
        opt.zero_grad()
        loss = F.cross_entropy(run(x).flatten(0, 1), y.flatten())
        skipped = scaler.skipped_steps
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        mean = rank_mean(loss)
        say(f"step {step + 1:4d}  loss {mean:.4f}" + ("  skipped" if scaler.skipped_steps > skipped else ""))
    seconds = time.perf_counter() - began

    # validation: evenly spaced windows, each rank its share, nats summed over the ranks
    count = args.eval_batches * args.batch * world
    starts = torch.linspace(0, len(data.validation) - args.context - 2, count).long()[rank::world]
    nats = torch.zeros((), device=device)
    with torch.no_grad():
        for chunk in starts.split(args.batch):
            x, y = windows(data.validation, chunk, args.context, device)
            nats += F.cross_entropy(run(x).flatten(0, 1), y.flatten(), reduction="sum")
    bits = rank_mean(nats) * world / (count * args.context) / math.log(2)  # all ranks' nats / all bytes
    say(
        f"validation: {bits:.3f} bits/char over {count * args.context:,} bytes;"
        f" {args.steps} steps in {seconds:.0f} s (compile included), {scaler.skipped_steps} skipped in all"
    )

    rows = lpcompile.coverage(model)  # per product of the compiled graphs (training and validation)
    rounded = [r for r in rows if r.quantized]
    formats = sorted({f for r in rounded for f in r.quantized.values()})
    graphs = len({r.graph_id for r in rows})
    say(
        f"lowprec coverage: {len(rounded)} of {len(rows)} products in {graphs} graphs rounded"
        f" ({', '.join(formats)}), {sum(1 for r in rows if r.kept)} kept in higher precision"
    )

    if args.save:
        save(args.save, model, opt, scaler, start + args.steps)
        say(f"saved to {args.save}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The run is complete, its process group destroyed; skip the interpreter's teardown, in
    # which a C++ thread of a run resumed with torch.distributed.checkpoint on gloo, still
    # joinable, aborted a finished rank ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
