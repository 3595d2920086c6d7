"""Pipelined backpropagation (Kosson, Chiley et al. 2020), simulated in one process or
run on ``torch.distributed`` ranks.

* :mod:`~lpcompile.passes.stages`: stage boundaries (``pipe_split``
  markers or a balanced/one-per-layer partition), stage tags, the delay
  ``D_s = 2(S-1-s)``, stage GraphModules.
* :mod:`~lpcompile.runtime.pipeline.optim`: :class:`PipelineSGD` (per-stage delay,
  Spike Compensation, weight-prediction buffers) and the batch-size scaling rule.
* :mod:`~lpcompile.runtime.pipeline.schedule`: :class:`~lpcompile.runtime.pipeline.schedule.StageRunner`,
  one PB step of contiguous stages, shared by the simulator and the ranks.
* :mod:`~lpcompile.runtime.pipeline.scaling`: loss scaling per stage (a stage's scale,
  its overflow checks and skipped updates).
* :mod:`~lpcompile.runtime.pipeline.trainer`: :class:`PipelinedTrainer`, the
  single-process simulator of fine-grained PB, or (``distributed=True``) one rank's part.
* :mod:`~lpcompile.runtime.pipeline.distributed`: placement of stages on ranks, the
  point-to-point messages between them, :class:`LostRankError`.
"""

from lpcompile.passes.stages import (
    Partition,
    StageGraph,
    extract_stage,
    partition_graph,
    split_pipeline,
    stage_delays,
    tag_aten_graph,
)
from lpcompile.runtime.pipeline.distributed import LostRankError
from lpcompile.runtime.pipeline.optim import (
    PipelineSGD,
    PredictionInputs,
    scale_hyperparameters,
    spike_coefficients,
)
from lpcompile.runtime.pipeline.trainer import Event, PipelinedTrainer, capture_graph

__all__ = [
    "Event",
    "LostRankError",
    "Partition",
    "PipelineSGD",
    "PipelinedTrainer",
    "PredictionInputs",
    "StageGraph",
    "capture_graph",
    "extract_stage",
    "partition_graph",
    "scale_hyperparameters",
    "spike_coefficients",
    "split_pipeline",
    "stage_delays",
    "tag_aten_graph",
]
