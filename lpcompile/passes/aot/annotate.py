"""Labels on the ATen graphs' lowprec nodes: which site (layer, role, format) each came from."""

from __future__ import annotations

import torch.fx

from lpcompile.passes.driver import CompileContext
from lpcompile.passes.graph import LOWPREC_OPS


def annotate_lowprec_nodes(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Label each lowprec node of an ATen graph with the site it came from."""
    for node in gm.graph.nodes:
        if node.target in LOWPREC_OPS:
            offset = node.args[5]
            site = ctx.sites.get(offset)
            if site is None:
                continue
            meta = site.meta()
            # A quantize_grad site rounds in the backward; its forward node is a copy.
            meta["phase"] = "backward" if LOWPREC_OPS[node.target] != site.op else "forward"
            node.meta["lowprec"] = meta
