"""Per-layer telemetry of adaptive loss scaling, found from a model's parameters."""

from __future__ import annotations

import torch

from lpcompile.adaptive import AdaptiveScaleState, LayerTelemetry
from lpcompile.backend import COMPILED_GRAPHS


def adaptive_states(model: torch.nn.Module | None = None) -> list[AdaptiveScaleState]:
    """The adaptive-scaling states of the compiled graphs (of ``model``'s, if given)."""
    wanted = None if model is None else {id(p) for p in model.parameters()}
    return [
        state
        for record in COMPILED_GRAPHS
        if record.adaptive is not None
        for key, state in list(record.adaptive.items())
        if wanted is None or id(key) in wanted
    ]


def stats(model: torch.nn.Module) -> list[LayerTelemetry]:
    """Per layer of ``model`` (graph order): scale α, cumulative scale, the last
    refresh's underflow fraction, overflows since, and the history of refreshes."""
    return [t for state in adaptive_states(model) for t in state.telemetry]
