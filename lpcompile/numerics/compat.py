"""Torch names that moved between the versions lpcompile runs on (torch 2.11 and later)."""

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # before torch 2.12: the same contract under its old name
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint

__all__ = ["optimization_hint"]
