"""What differs between the torch versions lpcompile runs on: 2.13 and later (the one it
requires and is tested on), and 2.11, the lent GPU's, where ``scripts/gpu_check.sh`` runs
the kernel and adaptive-scaling checks."""

import torch
from torch.torch_version import TorchVersion

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # before torch 2.12: the same contract under its old name
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint

# Inductor lowers a torch.cond with a plain size among its operands (AOT autograd lifts a
# size of the error into adaptive scaling's statistics branches) from torch 2.13 on; 2.11
# asserts that every operand is a graph node (2.12 not tried).
INDUCTOR_COND_TAKES_SIZES = TorchVersion(torch.__version__) >= (2, 13)

__all__ = ["INDUCTOR_COND_TAKES_SIZES", "optimization_hint"]
