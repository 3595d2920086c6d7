"""Passes over AOT autograd's joint graph inside Inductor (:data:`JOINT_PASSES`).

Inductor runs them through its ``joint_custom_post_pass`` hook, before the
partitioner splits forward from backward; the eager executor (and ``codegen="triton"``)
in its partition function. An inference graph has no joint graph: the backend runs this
list over it before the AOT passes. The bf16 matmuls and the boolean masks are
Inductor's alone.
"""

from __future__ import annotations

import torch.fx

from lpcompile.passes.driver import CompileContext, Pass
from lpcompile.passes.joint.masks import masks_apply, recompute_bool_masks
from lpcompile.passes.joint.matmul import has_cpu_matmuls, use_bf16_matmuls, uses_bf16_kernel
from lpcompile.passes.joint.rowwise import round_operands_per_matmul, rounds_per_matmul


def on_inductor(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return ctx.config.executor == "inductor" and ctx.config.codegen == "inductor"


def bf16_applies(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return on_inductor(gm, ctx, kind) and uses_bf16_kernel(ctx.config, has_cpu_matmuls(gm))


def inductor_masks_apply(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return on_inductor(gm, ctx, kind) and masks_apply(gm, ctx, kind)


JOINT_PASSES = (
    Pass(round_operands_per_matmul, rounds_per_matmul),
    Pass(use_bf16_matmuls, bf16_applies),
    Pass(recompute_bool_masks, inductor_masks_apply),
)
