"""Passes over AOT autograd's joint graph inside Inductor (:data:`JOINT_PASSES`).

Inductor runs them through its ``joint_custom_post_pass`` hook, before the
partitioner splits forward from backward. An inference graph has no joint graph:
the backend runs this list over it before the AOT passes.
"""

from __future__ import annotations

import torch.fx

from lpcompile.passes.driver import CompileContext, Pass
from lpcompile.passes.joint.masks import masks_apply, recompute_bool_masks
from lpcompile.passes.joint.matmul import has_cpu_matmuls, use_bf16_matmuls, uses_bf16_kernel


def bf16_applies(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return uses_bf16_kernel(ctx.config, has_cpu_matmuls(gm))


JOINT_PASSES = (
    Pass(use_bf16_matmuls, bf16_applies),
    Pass(recompute_bool_masks, masks_apply),
)
