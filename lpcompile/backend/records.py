"""What the backend did to one Dynamo graph: the record ``lowprec dump`` and the
tests read (the registry keeps the newest ones)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx

from lpcompile.config import LowPrecConfig
from lpcompile.passes.driver import KeptProduct, PassRecord, Site


@dataclass
class CompiledGraph:
    """What the backend did to one Dynamo graph."""

    graph_id: int
    stream: int
    config: LowPrecConfig
    sites: dict[int, Site]
    records: list[PassRecord]
    kept: list[KeptProduct] = field(default_factory=list)  # products left in higher precision
    aten_graphs: dict[str, torch.fx.GraphModule] = field(default_factory=dict)
    partition: Any = None  # passes.stages.Partition of a graph split into pipeline stages
    fused: list = field(default_factory=list)  # codegen.KernelRecord of every generated kernel
    # Inductor settings lowprec chose for this graph (executor="inductor")
    inductor_options: dict[str, Any] = field(default_factory=dict)

    @property
    def kernels(self) -> dict[str, str]:
        """The generated kernels, name -> Triton source (what ``lowprec dump`` writes)."""
        return {k.name: k.source for k in self.fused}
