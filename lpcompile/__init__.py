"""lowprec: a torch.compile backend for low-precision and pipelined training research."""

from lpcompile.formats import FloatFormat, parse_format
from lpcompile.ops import quantize

__all__ = ["FloatFormat", "parse_format", "quantize"]
