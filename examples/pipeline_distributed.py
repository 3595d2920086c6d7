"""Pipelined backpropagation on torch.distributed ranks: the digits ResNet, batch size 1.

Run from the repository root, one process per stage group::

    torchrun --nproc_per_node=4 -m examples.pipeline_distributed [--epochs 3] [--recipe fp8-e5m2] \
        [--loss-scale dynamic]

:class:`examples.models.DigitsResNet` (GroupNorm) is cut into four balanced stages
(its skip connections cross stage boundaries) and trained with PB + Spike Compensation
+ LWP^v, the batch-32 recipe (lr 0.016, momentum 0.9) scaled to batch 1, the learning
rate decaying linearly to zero. With 4 ranks each runs one stage (delays 6, 4, 2, 0);
with 2 ranks two stages each; with 1 rank all four. Every rank builds the same model
from the same seed and calls ``step`` with the same samples; at the end the whole
model is gathered onto every rank (``full_state_dict``) and rank 0 tests it.

``--loss-scale`` scales each stage's loss (a mode, ``dynamic``, ``enhanced`` or ``static``,
or a number; each rank prints its stages' final scales and skipped samples).
``--samples N`` trains on the first N training samples, ``--weights FILE`` saves the
trained weights (rank 0). ``--save DIR`` writes each rank's drained state to
``DIR/rank<r>.pt``; ``--resume DIR`` continues from there (same world size) for
``--epochs`` more epochs. ``--simulate`` runs the same training in one process with
the single-process simulator instead (``python -m examples.pipeline_distributed
--simulate``): the final weights are the same bits as the ranks'.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from examples.data import load_digits
from examples.models import DigitsResNet
from lpcompile.runtime.pipeline import PipelinedTrainer, scale_hyperparameters


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--recipe", default=None, help="a lowprec recipe for the stages, e.g. fp8-e5m2")
    parser.add_argument(
        "--loss-scale", default="1", help="per-stage loss scaling: dynamic, enhanced, static or a number"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a neighbour")
    parser.add_argument("--save", type=Path, default=None, help="save each rank's state here at the end")
    parser.add_argument("--resume", type=Path, default=None, help="resume from a --save folder")
    parser.add_argument("--simulate", action="store_true", help="one process: the simulator")
    parser.add_argument("--samples", type=int, default=None, help="train on the first N samples only")
    parser.add_argument("--weights", type=Path, default=None, help="rank 0 saves the trained weights here")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # batch 1: threads only add overhead
    data = load_digits()
    if args.samples is not None:
        data = dataclasses.replace(
            data, train_x=data.train_x[: args.samples], train_y=data.train_y[: args.samples]
        )
    torch.manual_seed(args.seed)
    model = DigitsResNet()
    lr, momentum = scale_hyperparameters(0.016, 0.9, batch_size=32, new_batch_size=1)
    trainer = PipelinedTrainer(
        model,
        data.train_x[:1],
        stages=args.stages,
        lr=lr,
        momentum=momentum,
        spike_compensation=True,
        prediction="lwp_v",
        compile=None if args.recipe is None else {"recipe": args.recipe},
        loss_scale=args.loss_scale if args.loss_scale.isalpha() else float(args.loss_scale),
        distributed=not args.simulate,
        timeout=args.timeout,
    )
    rank, world = trainer.rank, trainer.world_size
    if args.resume is not None:
        trainer.load_state_dict(torch.load(args.resume / f"rank{rank}.pt"))
    local = [stage.index for stage in trainer.stages]
    print(f"rank {rank} of {world}: stages {local}, delays {[trainer.delays[s] for s in local]}", flush=True)

    n = len(data.train_y)
    total = args.epochs * n
    first = trainer.samples
    order = torch.Generator().manual_seed(args.seed + first)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        for i in torch.randperm(n, generator=order).tolist():
            for group in trainer.optimizer.param_groups:
                group["lr"] = lr * (1.0 - (trainer.samples - first) / total)
            trainer.step(data.train_x[i : i + 1], data.train_y[i : i + 1])
        if trainer.losses:  # the rank of the last stage
            recent = trainer.losses[-n:]
            print(f"epoch {epoch + 1}: mean training loss {sum(recent) / len(recent):.4f}", flush=True)
    trainer.drain()
    seconds = time.perf_counter() - start
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
        torch.save(trainer.state_dict(), args.save / f"rank{rank}.pt")
    weights = trainer.full_state_dict()  # every rank's stages, on every rank
    timings = trainer.timings
    print(
        f"rank {rank}: {total / seconds:.1f} samples/s, {trainer.steps} steps; per step "
        f"{1e3 * timings['compute_s'] / timings['steps']:.2f} ms in its stages, "
        f"{1e3 * timings['transport_s'] / timings['steps']:.2f} ms in messages",
        flush=True,
    )
    if trainer.loss_scale_config is not None:
        scales, skipped = trainer.loss_scales, trainer.skipped_samples
        print(f"rank {rank}: loss scales {scales}, skipped samples {skipped}", flush=True)
    if rank == 0 and args.weights is not None:
        torch.save(weights, args.weights)
    if rank == 0:
        tested = DigitsResNet()
        tested.load_state_dict(weights)
        tested.eval()
        with torch.no_grad():
            accuracy = (tested(data.test_x).argmax(1) == data.test_y).float().mean().item()
        print(f"test accuracy {100 * accuracy:.1f}% after {trainer.samples} samples", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
