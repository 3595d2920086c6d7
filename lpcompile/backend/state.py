"""The one registry of what lowprec keeps for the models it compiled.

Everything is keyed weakly by a parameter tensor: a model is named by its first
parameter, and a stand-in tensor (a pipeline's weight slot) is registered as an
alias of the parameter it stands for, so its state is the model's. An entry dies
with its parameter. The registry also holds the compiled-graph records (the
newest :data:`MAX_RECORDS`) and the compile observers (``lowprec dump``).
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lpcompile.backend.adaptive import AdaptiveScaleState, LayerTelemetry
from lpcompile.backend.distributed import unsharded_parameters
from lpcompile.passes.driver import PredictionInput
from lpcompile.passes.dynamo.loss_scale import AdaptiveLayout

# Compiled-graph records kept (the newest): each holds graphs and pass records.
MAX_RECORDS = 64


class CompileObserver(Protocol):
    """Sees what the backend compiles (e.g. :mod:`lpcompile.tools.dump`)."""

    def active(self) -> bool:
        """Whether it observes now; an inactive observer costs nothing."""

    def graph_compiled(self, record: Any, gm: torch.fx.GraphModule, tag: str) -> None:
        """``gm``, the Dynamo graph after the passes, of ``record`` was compiled."""

    def inductor_graph(self, record: Any, kind: str, gm: torch.fx.GraphModule) -> None:
        """Inductor is about to compile ``gm``, an AOT graph of ``record`` after the passes."""


@dataclass
class Entry:
    """What lowprec keeps for one parameter; the model-wide fields live on its first."""

    # call counts behind the seeds, per (random stream, settings, grad mode)
    steps: collections.Counter = field(default_factory=collections.Counter)
    adaptive: dict[int, AdaptiveScaleState] = field(default_factory=dict)  # graph id -> state
    optimizer: weakref.ref | None = None  # the optimizer serving this weight's predictions
    graphs: set[int] = field(default_factory=set)  # ids of the graphs compiled for this model


class Registry:
    """Per-model state, compiled-graph records and compile observers of this process."""

    def __init__(self) -> None:
        self._entries = WeakIdKeyDictionary()  # parameter -> Entry
        self._aliases = WeakIdKeyDictionary()  # stand-in -> the parameter it stands for
        # the key of graphs that take no parameter (functional code): they count per
        # stream and settings in the process
        self.no_model = torch.empty(0)
        self._deferred: list[dict[str, Any]] = []  # saved adaptive states awaiting their graphs
        self.records: collections.deque = collections.deque(maxlen=MAX_RECORDS)
        self.graph_count = 0  # graphs compiled by this process
        self.observers: list[CompileObserver] = []

    # ------------------------------------------------------------------ keys
    def key(self, tensor: torch.Tensor) -> torch.Tensor:
        """The parameter that stands for ``tensor`` in the registry (itself, or what it aliases)."""
        return self._aliases.get(tensor, tensor)

    def alias(self, stand_in: torch.Tensor, param: torch.Tensor) -> None:
        """Let ``stand_in`` share ``param``'s state (a copy the model's graphs read instead)."""
        self._aliases[stand_in] = self.key(param)

    def entry(self, tensor: torch.Tensor) -> Entry:
        key = self.key(tensor)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = Entry()
        return entry

    # ------------------------------------------------------------------ seeds
    def next_step(self, key: torch.Tensor, counter: tuple) -> int:
        """The call number of this call of ``key``'s graphs with this (stream, settings, grad mode)."""
        steps = self.entry(key).steps
        steps[counter] += 1
        return steps[counter] - 1

    # ------------------------------------------------------------------ adaptive loss scaling
    def adaptive_state(
        self, key: torch.Tensor, graph_id: int, layout: AdaptiveLayout, args: tuple
    ) -> AdaptiveScaleState:
        """The adaptive-scaling state of ``key``'s model in graph ``graph_id``; a new one is
        loaded from a deferred saved state with its layers, or starts from the scales of
        another graph of the same model (a recompile, its ``eval()`` forward)."""
        entry = self.entry(key)
        state = entry.adaptive.get(graph_id)
        if state is not None:
            return state
        weights = [None if i is None else args[i] for i in layout.weight_inputs]
        owners = [None if w is None else self.key(w) for w in weights]
        device = next((w.device for w in weights if w is not None), torch.device("cpu"))
        state = entry.adaptive[graph_id] = AdaptiveScaleState(layout, weights, owners, device)
        saved = next((s for s in self._deferred if list(s["layers"]) == state.layers), None)
        if saved is not None:
            self._deferred.remove(saved)
            state.load_state_dict(saved)
        elif siblings := [s for s in self.adaptive_states() if state.same_layers(s)]:
            # the most trained of the model's graphs: calibrated, then the most calls
            state.start_from(max(siblings, key=lambda s: (not s.calibrating, s.calls)))
        return state

    def adaptive_states(
        self, model: torch.nn.Module | None = None, graph_id: int | None = None
    ) -> list[AdaptiveScaleState]:
        """The adaptive-scaling states of every model alive (of ``model``'s, of graph
        ``graph_id``'s, if given), oldest graph first."""
        wanted = None if model is None else model_tensor_ids(model)
        found = [
            (graph, state)
            for key, entry in list(self._entries.items())
            if wanted is None or id(key) in wanted
            for graph, state in entry.adaptive.items()
            if graph_id is None or graph == graph_id
        ]
        return [state for _, state in sorted(found, key=lambda pair: pair[0])]

    def defer_states(self, saved: list[dict[str, Any]]) -> None:
        """Hold saved states until the graphs they belong to compile (replacing any held)."""
        self._deferred[:] = saved

    def pending_states(self) -> list[dict[str, Any]]:
        """The saved states no graph has taken yet."""
        return list(self._deferred)

    # ------------------------------------------------------------------ weight prediction
    def serve_predictions(self, params: Iterable[torch.Tensor], optimizer: Any) -> None:
        """``optimizer.prediction_inputs(param, mode)`` feeds the predictions of ``params``."""
        for param in params:
            self.entry(param).optimizer = weakref.ref(optimizer)

    def prediction_input(self, param: torch.Tensor, spec: PredictionInput) -> torch.Tensor:
        """The ``spec.field`` a ``lowprec::predict_weight`` node reads for ``param``.

        Without an optimizer (none yet, or one that is gone) the buffer is such that
        the prediction is ``param`` itself: zeros for ``lwp_v``, ``param`` for ``lwp_w``.
        """
        entry = self._entries.get(self.key(param))
        optimizer = None if entry is None or entry.optimizer is None else entry.optimizer()
        if optimizer is not None:
            return getattr(optimizer.prediction_inputs(self.key(param), spec.mode), spec.field)
        if spec.field == "lr":
            return torch.zeros((), dtype=torch.float32, device=param.device)
        return torch.zeros_like(param) if spec.mode == "lwp_v" else param.detach()

    # ------------------------------------------------------------------ records and observers
    def new_graph_id(self) -> int:
        """The next graph's id: graphs are numbered 0, 1, ... in compile order."""
        self.graph_count += 1
        return self.graph_count - 1

    def records_since(self, count: int) -> list[Any]:
        """The records of the graphs compiled after the first ``count`` (those still kept)."""
        return [r for r in self.records if r.graph_id >= count]

    def observe(self, observer: CompileObserver) -> None:
        """Add a compile observer (once)."""
        if observer not in self.observers:
            self.observers.append(observer)

    def active_observers(self) -> list[CompileObserver]:
        return [o for o in self.observers if o.active()]


    def model_records(self, model: torch.nn.Module) -> list[Any]:
        """The kept records of the graphs compiled for ``model`` (any of its parameters
        named one), in compile order."""
        wanted = model_tensor_ids(model)
        ids = {g for key, entry in list(self._entries.items()) if id(key) in wanted for g in entry.graphs}
        return [record for record in self.records if record.graph_id in ids]


REGISTRY = Registry()


def model_tensor_ids(model: torch.nn.Module) -> set[int]:
    """The ids of the tensors that may name ``model`` in the registry: its parameters, and
    the unsharded parameters FSDP2 swaps in for its sharded ones."""
    return {id(p) for p in model.parameters()} | {id(p) for p in unsharded_parameters(model)}


@dataclass(frozen=True)
class LayerCoverage:
    """What became of one product of a compiled model: its rounded roles, or why not."""

    layer: str
    graph_id: int
    quantized: dict[str, str]  # role -> "format rounding overflow", e.g. {"weight": "e5m2 nearest saturate"}
    kept: str | None = None  # why it stays in higher precision (then ``quantized`` is empty)
    op: str | None = None


def coverage(model: torch.nn.Module) -> list[LayerCoverage]:
    """Per product of ``model``'s compiled graphs: which roles were rounded, with which
    format and rounding, or why the product stays in higher precision."""
    rows = []
    for record in REGISTRY.model_records(model):
        roles: dict[str, dict[str, str]] = {}
        for site in record.sites.values():
            roles.setdefault(site.layer, {})[site.role] = f"{site.fmt} {site.rounding} {site.overflow}"
        rows += [LayerCoverage(layer, record.graph_id, quantized) for layer, quantized in roles.items()]
        rows += [LayerCoverage(k.layer, record.graph_id, {}, k.reason, k.op) for k in record.kept]
    return rows


def stats(model: torch.nn.Module) -> list[LayerTelemetry]:
    """Per layer of ``model`` (graph order): scale α, cumulative scale, the last
    refresh's underflow fraction, overflows since, and the history of refreshes."""
    return [t for state in REGISTRY.adaptive_states(model) for t in state.telemetry]
