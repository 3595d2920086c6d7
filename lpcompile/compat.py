"""Torch names that moved between the versions lpcompile supports (``torch>=2.6``)."""

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # before torch 2.12: the same contract under its old name
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint

__all__ = ["optimization_hint"]
