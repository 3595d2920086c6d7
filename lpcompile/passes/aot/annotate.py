"""Labels on the ATen graphs' lowprec nodes: which site (layer, role, format) each came from."""

from __future__ import annotations

import torch.fx

from lpcompile.config import Role
from lpcompile.passes.driver import CompileContext
from lpcompile.passes.graph import LOWPREC_OPS

# Roles rounded in the backward: the gradients, whether by a quantize_grad site or by a
# quantize in a custom Function's backward body.
BACKWARD_ROLES = (Role.ERROR.value, Role.WEIGHT_GRAD.value)


def annotate_lowprec_nodes(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Label each lowprec node of an ATen graph with the site it came from."""
    for node in gm.graph.nodes:
        if node.target in LOWPREC_OPS:
            offset = node.args[5]
            site = ctx.sites.get(offset)
            if site is None:
                continue
            meta = site.meta()
            # A quantize_grad node is the identity, in the forward or recomputed with it; the
            # quantize a gradient's site becomes in the backward does its rounding.
            rounds_gradient = LOWPREC_OPS[node.target] == "quantize" and site.role in BACKWARD_ROLES
            meta["phase"] = "backward" if rounds_gradient else "forward"
            node.meta["lowprec"] = meta
