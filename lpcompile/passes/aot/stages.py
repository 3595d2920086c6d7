"""Stage tags on the AOT graphs of a graph split into pipeline stages."""

from __future__ import annotations

import torch.fx

from lpcompile.passes.driver import CompileContext
from lpcompile.passes.stages import tag_aten_graph


def tag_stages(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """``node.meta["stage"]`` on every node of an AOT forward or backward graph."""
    tag_aten_graph(gm, backward=gm.meta["lowprec_graph"].startswith("backward"))
