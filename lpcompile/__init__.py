"""lowprec: a torch.compile backend for low-precision and pipelined training research."""

# pipe_split: the ecosystem's pipeline stage-boundary marker, re-exported
from torch.distributed.pipelining import pipe_split

from lpcompile.config import LowPrecConfig, recipes
from lpcompile.formats import FloatFormat, parse_format
from lpcompile.ops import quantize, refresh_inductor_decompositions
from lpcompile.ops_pipeline import predict_weight
from lpcompile.scaling import LossScaler
from lpcompile.telemetry import stats

__all__ = [
    "FloatFormat",
    "LossScaler",
    "LowPrecConfig",
    "parse_format",
    "pipe_split",
    "predict_weight",
    "quantize",
    "recipes",
    "stats",
]

# A torch.compile before this import may have fixed Inductor's table without lowprec's ops.
refresh_inductor_decompositions()
