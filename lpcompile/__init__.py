"""lowprec: a torch.compile backend for low-precision and pipelined training research.

``torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr"})`` finds
the backend through its entry point. This module only names the public API; each
name is imported on first use, so ``import lpcompile`` stays cheap.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from lpcompile.numerics import register_when_inductor_loads

# The lowprec:: operators (torch.library only: cheap); torch.ops.lowprec.* exist from here on.
for _module in ("quantize", "scale_grad", "predict"):
    importlib.import_module(f"lpcompile.numerics.{_module}")
del _module

# public name -> the module that defines it
_EXPORTS = {
    "FloatFormat": "lpcompile.numerics.formats",
    "parse_format": "lpcompile.numerics.formats",
    "quantize": "lpcompile.numerics.quantize",
    "predict_weight": "lpcompile.numerics.predict",
    "LowPrecConfig": "lpcompile.config",
    "recipes": "lpcompile.config",
    "stats": "lpcompile.backend.state",
    "coverage": "lpcompile.backend.state",
    "saturation": "lpcompile.backend.state",
    "LossScaler": "lpcompile.runtime.scaler",
    "MasterWeightOptimizer": "lpcompile.runtime.optim",
    "PipelineSGD": "lpcompile.runtime.pipeline",
    "PipelinedTrainer": "lpcompile.runtime.pipeline",
    # the ecosystem's pipeline stage-boundary marker
    "pipe_split": "torch.distributed.pipelining",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lpcompile' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# Inductor compiles the lowprec operators with lowprec's decompositions, whoever calls it.
register_when_inductor_loads()
# LOWPREC_DUMP=DIR: the dump observes every compile of this process.
if os.environ.get("LOWPREC_DUMP", "").strip():
    importlib.import_module("lpcompile.tools.dump").observe()
