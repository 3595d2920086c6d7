"""One training run for the resume tests, in a process of its own.

``python resume_run.py CASE DIR full``: train :data:`STEPS` steps, saving an ordinary
checkpoint (``torch.save`` of the state dicts) after :data:`SAVE_AT`; write the final
weights to ``DIR/full.pt``. ``... rest``: a fresh process loads that checkpoint, trains
the remaining steps and writes ``DIR/rest.pt``. ``... rest-old``: the same, from the
checkpoint with lowprec's stream state taken out (as saved before it was kept).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import lpcompile

STEPS, SAVE_AT = 6, 3
PIPELINE_SAMPLES = 8


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).to(
        dtype
    )


def _batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 8, generator=g).to(dtype), torch.randint(0, 4, (16,), generator=g)


def _compiled(model: nn.Module, recipe: str) -> nn.Module:
    return torch.compile(model, backend="lowprec", options={"recipe": recipe, "executor": "eager"})


def _scaler_case(recipe: str, mode: str, master: bool):
    """Model, compiled model, optimizer and scaler of a plain training loop."""
    dtype = torch.float16 if master else torch.float32
    model = _mlp(dtype)
    run = _compiled(model, recipe)
    if master:
        opt = lpcompile.MasterWeightOptimizer(
            model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9, rounding="stochastic", seed=3
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = lpcompile.LossScaler(mode, **({} if mode == "adaptive" else {"init_scale": 2.0**8}))
    return model, run, opt, scaler, dtype


CASES = {
    # name: (recipe, scaler mode, 16-bit master weights)
    "nearest": ("fp8-e5m2", "dynamic", False),
    "stochastic": ("fp8-e5m2-sr", "dynamic", False),
    "adaptive": ("fp8-e5m2-als", "adaptive", False),
    "master": ("fp8-e5m2-sr", "dynamic", True),
}


def train_loop(case: str, folder: Path, phase: str) -> None:
    model, run, opt, scaler, dtype = _scaler_case(*CASES[case])
    start = 0
    if phase != "full":
        ckpt = torch.load(folder / f"ckpt{'-old' if phase == 'rest-old' else ''}.pt")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start = SAVE_AT
    for step in range(start, STEPS):
        x, y = _batch(step, dtype)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(run(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if phase == "full" and step + 1 == SAVE_AT:
            ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()}
            torch.save(ckpt, folder / "ckpt.pt")
            for part in ("optimizer", "scaler"):
                ckpt[part] = {k: v for k, v in ckpt[part].items() if k != "streams"}
            torch.save(ckpt, folder / "ckpt-old.pt")
    torch.save(model.state_dict(), folder / f"{phase}.pt")


def train_pipeline(folder: Path, phase: str) -> None:
    """PB+LWP with stages compiled in FP8 with stochastic rounding; saved after a drain."""
    model = _mlp()
    trainer = lpcompile.PipelinedTrainer(
        model,
        torch.randn(1, 8),
        stages=3,
        lr=0.05,
        momentum=0.9,
        prediction="lwp_v",
        compile={"recipe": "fp8-e5m2-sr", "executor": "eager"},
    )
    x, y = _batch(0)
    half = PIPELINE_SAMPLES // 2
    if phase == "full":
        trainer.fit(x[:half], y[:half])
        torch.save({"model": model.state_dict(), "trainer": trainer.state_dict()}, folder / "ckpt.pt")
    else:
        ckpt = torch.load(folder / "ckpt.pt")
        model.load_state_dict(ckpt["model"])
        trainer.load_state_dict(ckpt["trainer"])
    trainer.fit(x[half:PIPELINE_SAMPLES], y[half:PIPELINE_SAMPLES])
    torch.save(model.state_dict(), folder / f"{phase}.pt")


if __name__ == "__main__":
    case, folder, phase = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if case == "pipeline":
        train_pipeline(folder, phase)
    else:
        train_loop(case, folder, phase)
