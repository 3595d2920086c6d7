"""The backend: the entry point, the per-call runtime wrapper, the compiled-graph
records and the one registry of per-model state.

* :mod:`.compile`: :func:`lowprec`, options → passes → Inductor or FX.
* :mod:`.runtime`: what each call of a compiled graph adds to its inputs (seeds,
  adaptive scales, weight-prediction buffers).
* :mod:`.state`: :data:`REGISTRY`, keyed weakly by parameters; :func:`stats`.
* :mod:`.adaptive`: the per-layer adaptive loss-scale state a graph reads.
* :mod:`.records`, :mod:`.cache`: the compiled-graph record; Inductor's cache key.
"""

from lpcompile.backend.cache import SourceStamp, source_hash
from lpcompile.backend.compile import lowprec, uses_cpp_wrapper
from lpcompile.backend.records import CompiledGraph
from lpcompile.backend.runtime import step_seed
from lpcompile.backend.state import REGISTRY, coverage, stats

__all__ = [
    "REGISTRY",
    "CompiledGraph",
    "SourceStamp",
    "coverage",
    "lowprec",
    "source_hash",
    "stats",
    "step_seed",
    "uses_cpp_wrapper",
]
