"""lowprec: a torch.compile backend for low-precision and pipelined training research."""

# pipe_split: the ecosystem's pipeline stage-boundary marker, re-exported
from torch.distributed.pipelining import pipe_split

from lpcompile.formats import FloatFormat, parse_format
from lpcompile.ops import quantize
from lpcompile.ops_pipeline import predict_weight

__all__ = ["FloatFormat", "parse_format", "pipe_split", "predict_weight", "quantize"]
