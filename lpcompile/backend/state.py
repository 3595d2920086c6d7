"""The one registry of what lowprec keeps for the models it compiled.

Everything is keyed weakly by a parameter tensor: a model is named by its first
parameter, and a stand-in tensor (a pipeline's weight slot) is registered as an
alias of the parameter it stands for, so its state is the model's. An entry dies
with its parameter. The registry also holds the compiled-graph records (the
newest :data:`MAX_RECORDS`) and the compile observers (``lowprec dump``).

What decides bits travels in checkpoints: :meth:`Registry.streams_state` (the
call counts that seed stochastic rounding) and the adaptive states go into the
state dicts of ``LossScaler``, ``MasterWeightOptimizer`` and ``PipelinedTrainer``.
Saved counts find their model by its graphs' random streams (hashes of their
layers), and among models with the same streams by a digest of the first
parameter's values, which a resumed model has again once its weights are loaded.
A key whose owner saves its counts itself (:meth:`Registry.owned_key`: a pipeline
stage without parameters, which no weights tell from a stale copy) stays out of that.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import math
import numbers
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.weak import WeakIdKeyDictionary

from lpcompile.backend.adaptive import AdaptiveScaleState, LayerTelemetry, check_saved_state
from lpcompile.backend.distributed import unsharded_parameters
from lpcompile.backend.watch import CoverageWatches, instance_of, module_name, running_holder, unwrapped
from lpcompile.numerics.scale_grad import count_probe
from lpcompile.passes.driver import PredictionInput, Site
from lpcompile.passes.dynamo.loss_scale import AdaptiveLayout
from lpcompile.passes.graph import qualified_name

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


# What a call count is kept under: (the graph's random stream, ``repr`` of its
# LowPrecConfig, grad mode). Plain values, so that it saves and loads.
StepCounter = tuple[int, str, bool]


def fingerprint(param: torch.Tensor) -> str:
    """A digest of ``param``'s values (of its shape and dtype while it holds no storage, as
    FSDP2's unsharded parameters between steps): tells apart saved models whose graphs
    share random streams (two copies of one network)."""
    if param.untyped_storage().size() == 0 and param.numel():
        return f"{tuple(param.shape)} {param.dtype}"
    # a copy: ``Tensor.numpy()`` marks the storage it shares as not resizable, and FSDP2
    # frees an unsharded parameter by resizing its storage to 0 (on the CPU, ``.to`` copies
    # nothing, and a scaler's state saved after an eval forward left the root unshardable)
    data = param.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def check_streams_state(saved: Any) -> None:
    """Raise ``ValueError`` unless ``saved`` is a :meth:`Registry.streams_state`."""
    if not isinstance(saved, list):
        raise ValueError(f"the saved random-stream state must be a list, got {type(saved).__name__}")
    for model in saved:
        if not (isinstance(model, dict) and isinstance(model.get("model"), str)):
            raise ValueError(f"a saved random-stream entry needs a 'model' digest, got {model!r}")
        if not isinstance(model.get("steps"), list):
            raise ValueError(f"a saved random-stream entry needs a list of 'steps', got {model!r}")
        for row in model["steps"]:
            ok = isinstance(row, (list, tuple)) and len(row) == 4
            if ok:
                stream, config, grad, count = row
                ok = (
                    isinstance(stream, numbers.Integral)
                    and isinstance(config, str)
                    and isinstance(grad, bool)
                    and isinstance(count, numbers.Integral)
                    and not isinstance(count, bool)
                    and count >= 0
                )
            if not ok:
                raise ValueError(
                    f"a saved call count must be [stream, config, grad mode, count >= 0], got {row!r}"
                )


def _counts(rows: list[list[Any]]) -> dict[StepCounter, int]:
    """Saved call-count rows (checked by :func:`check_streams_state`) as counts by counter."""
    return {(int(s), c, g): int(n) for s, c, g, n in rows}


@dataclass(frozen=True)
class Place:
    """The module whose frame ran a graph for a model's parameter, found at its first call."""

    path: str  # its FQN in the outermost module running then ("": that module itself)
    module: weakref.ref | None  # the module (None: not found, or no module ran it)
    relative: str | None  # the parameter's FQN from that module (None: no parameter)


@dataclass
class Entry:
    """What lowprec keeps for one parameter; the model-wide fields live on its first."""

    # call counts behind the seeds, per (random stream, settings, grad mode): see StepCounter
    steps: collections.Counter = field(default_factory=collections.Counter)
    adaptive: dict[int, AdaptiveScaleState] = field(default_factory=dict)  # graph id -> state
    optimizer: weakref.ref | None = None  # the optimizer serving this weight's predictions
    graphs: set[int] = field(default_factory=set)  # ids of the graphs compiled for this model
    # graph id -> (its counted sites, per site its range counts and the calls that ran it,
    # summed over the graph's calls)
    saturation: dict[int, tuple[list[Site], torch.Tensor]] = field(default_factory=dict)
    # graph id -> (its counted gradient sites, the probe whose gradient sums per site its
    # range counts and the backward passes)
    gradient_saturation: dict[int, tuple[list[Site], torch.Tensor]] = field(default_factory=dict)
    # graph id -> the module whose frame ran the graph with this parameter, found at the first
    # call of a graph of that frame: a parameter tied across modules names several frames
    places: dict[int, Place] = field(default_factory=dict)


class Registry:
    """Per-model state, compiled-graph records and compile observers of this process."""

    def __init__(self) -> None:
        self._entries = WeakIdKeyDictionary()  # parameter -> Entry
        self._aliases = WeakIdKeyDictionary()  # stand-in -> the parameter it stands for
        # the key of graphs that take no parameter (functional code): they count per
        # stream and settings in the process
        self.no_model = torch.empty(0)
        self._owned = WeakIdKeyDictionary()  # keys whose call counts their owner saves (owned_key)
        self._deferred: list[dict[str, Any]] = []  # saved adaptive states awaiting their graphs
        # saved (digest, counts) no model has taken yet
        self._saved_steps: list[tuple[str, dict[StepCounter, int]]] = []
        self._looked_up = WeakIdKeyDictionary()  # models matched against _saved_steps since the load
        self._restart_warning = False  # a checkpoint without stream state was loaded
        self.records: collections.deque = collections.deque(maxlen=MAX_RECORDS)
        self._splits = weakref.WeakKeyDictionary()  # DDPOptimizer's split -> its first piece's graph id
        # a split's first piece's graph id -> the graph ids and adaptive states of its pieces
        # in the forward that ran them last (blocks compiled one by one run one split each)
        self._pieces: dict[int, list[tuple[int, weakref.ref[AdaptiveScaleState]]]] = {}
        self._unrecorded = 0  # unrecorded() blocks entered: their graphs share no state
        self.watches = CoverageWatches()  # modules no lowprec graph reads, named once
        self.graph_count = 0  # graphs compiled by this process
        self.observers: list[CompileObserver] = []

    # ------------------------------------------------------------------ keys
    def key(self, tensor: torch.Tensor) -> torch.Tensor:
        """The parameter that stands for ``tensor`` in the registry (itself, or what it aliases)."""
        return self._aliases.get(tensor, tensor)

    def owned_key(self) -> torch.Tensor:
        """A new key for state its owner saves and loads itself (:meth:`steps_state`): a
        pipeline stage without parameters, which no weights tell from a stale copy.
        :meth:`streams_state` leaves its counts out, and loaded streams never go to it."""
        key = torch.empty(0)
        self._owned[key] = True
        return key

    def steps_state(self, key: torch.Tensor) -> list[list[Any]]:
        """The call counts of ``key``'s graphs, as rows of :meth:`streams_state`."""
        entry = self._entries.get(self.key(key))
        return [] if entry is None else [[*counter, count] for counter, count in entry.steps.items()]

    def load_steps_state(self, key: torch.Tensor, saved: list[list[Any]]) -> None:
        """Restore :meth:`steps_state` into ``key``'s graphs."""
        self.entry(key).steps = collections.Counter(_counts(saved))

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
    def next_step(self, key: torch.Tensor, counter: StepCounter) -> int:
        """The call number of this call of ``key``'s graphs with this (stream, settings, grad mode)."""
        if self._restart_warning:
            self._restart_warning = False
            warnings.warn(
                "lowprec: the loaded checkpoint has no random-stream state (saved before lowprec kept "
                "it, or by another scaler): stochastic rounding restarts its streams at call 0, so "
                "the run does not continue bit for bit",
                stacklevel=3,
            )
        if self._saved_steps:
            self._resume_steps(key, {counter[0]})
        steps = self.entry(key).steps
        steps[counter] += 1
        return steps[counter] - 1

    def instance_path(self, key: torch.Tensor, graph_id: int, relative: str | None) -> str:
        """Note a call of graph ``graph_id`` for ``key``'s model, and return that model's FQN in
        the outermost module running that holds ``key``, at the first call of a graph of its
        frame ("" for that module itself): blocks compiled one by one share a graph, and
        this tells them apart (their random streams, their layers' names). A key tied across
        modules (an embedding shared with the head) names the graphs of each module's frame:
        each is placed apart."""
        entry = self.entry(key)
        entry.graphs.add(graph_id)
        if (place := entry.places.get(graph_id)) is None:
            place = Place("", None, relative)  # a graph keyed by no parameter: no module to find
            if relative is not None:
                path, module = instance_of(self.key(key), relative)
                if module is None:  # the frame's module is the outermost
                    module = running_holder(self.key(key))
                # a graph of a module placed before (a recompile, a block then called on its
                # own) keeps where that module was found first
                held = (p for p in entry.places.values() if p.module is not None and p.module() is module)
                place = next(held, None) if module is not None else None
                place = place or Place(path, None if module is None else weakref.ref(module), relative)
            entry.places[graph_id] = place
        return place.path

    def streams_state(self) -> list[dict[str, Any]]:
        """The call counts of every model alive, with a digest of its key parameter's values
        (:func:`fingerprint`) that tells apart models whose graphs share streams."""
        return [
            {
                "model": fingerprint(key),
                "steps": [[*counter, count] for counter, count in entry.steps.items()],
            }
            for key, entry in list(self._entries.items())
            if entry.steps and key not in self._owned
        ]

    def load_streams_state(self, saved: list[dict[str, Any]] | None) -> None:
        """Restore :meth:`streams_state`: at once for a model alive whose graphs' streams it
        has, else at a model's first call. ``None`` (a checkpoint saved without it) warns,
        at the first call that rounds stochastically, that the streams restart."""
        if saved is None:
            self._saved_steps, self._restart_warning = [], True
            return
        check_streams_state(saved)
        self._saved_steps = [(model["model"], _counts(model["steps"])) for model in saved]
        self._looked_up = WeakIdKeyDictionary()
        self._restart_warning = False
        for key, entry in list(self._entries.items()):
            if self._saved_steps and entry.steps:
                self._resume_steps(key, {stream for stream, _, _ in entry.steps}, live=True)

    def _resume_steps(self, key: torch.Tensor, streams: set[int], live: bool = False) -> None:
        """Give ``key``'s model the saved call counts of its graphs' ``streams`` (looked up
        once): a saved model with those streams, the one with ``key``'s values if several
        have them, and only that one for a model alive at the load (``live``: it may be
        the saved model's stale copy). Warn when none has them."""
        key = self.key(key)
        if key in self._looked_up or key in self._owned:
            return
        found = [i for i, (_, steps) in enumerate(self._saved_steps) if streams & {s for s, _, _ in steps}]
        if len(found) > 1 or (found and live):
            digest = fingerprint(key)
            same = [i for i in found if self._saved_steps[i][0] == digest]
            found = same if live else same or found
        if found:
            self.entry(key).steps = collections.Counter(self._saved_steps.pop(found[0])[1])
        if found or not live:
            self._looked_up[key] = True
        if not found and not live:
            warnings.warn(
                f"lowprec: the loaded random-stream state has no counts for this model's graphs (a "
                f"model with a {tuple(key.shape)} first parameter): its stochastic-rounding streams "
                "restart at call 0",
                stacklevel=4,
            )

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Calls of compiled graphs inside leave no trace in what decides later bits: the
        call counts are restored, the adaptive states and saturation counts of graphs first
        called inside are dropped (they start afresh at their next call), and saved state
        loaded for later (stream counts, deferred adaptive states) stays where it was.

        For compiling graphs ahead of their first real call (a pipeline's warm-up). States
        of graphs called before are not restored, so call only new graphs inside."""
        entries = list(self._entries.items())
        before = {
            id(key): (
                collections.Counter(entry.steps),
                set(entry.adaptive),
                set(entry.saturation),
                set(entry.gradient_saturation),
            )
            for key, entry in entries
        }
        saved_steps = [(digest, dict(counts)) for digest, counts in self._saved_steps]
        looked_up = list(self._looked_up.keys())
        restart_warning, deferred = self._restart_warning, list(self._deferred)
        self._unrecorded += 1
        try:
            yield
        finally:
            self._unrecorded -= 1
            for key, entry in list(self._entries.items()):
                steps, adaptive, saturation, gradients = before.get(
                    id(key), (collections.Counter(), set(), set(), set())
                )
                entry.steps = steps
                entry.adaptive = {g: s for g, s in entry.adaptive.items() if g in adaptive}
                entry.saturation = {g: c for g, c in entry.saturation.items() if g in saturation}
                entry.gradient_saturation = {
                    g: c for g, c in entry.gradient_saturation.items() if g in gradients
                }
            self._saved_steps = saved_steps
            self._looked_up = WeakIdKeyDictionary()
            for key in looked_up:
                self._looked_up[key] = True
            self._restart_warning, self._deferred[:] = restart_warning, deferred

    # ------------------------------------------------------------------ adaptive loss scaling
    def first_piece(self, split: Any, graph_id: int) -> int:
        """The graph id of the first piece of DDPOptimizer's ``split`` (``graph_id`` for it)."""
        return self._splits.setdefault(split, graph_id)

    def adaptive_state(
        self, key: torch.Tensor, graph_id: int, layout: AdaptiveLayout, args: tuple, split_from: int | None
    ) -> AdaptiveScaleState:
        """The adaptive-scaling state of ``key``'s model in graph ``graph_id``: that of another
        graph of the same layers (a recompile, the ``eval()`` forward), where it fits
        (:meth:`AdaptiveScaleState.interchangeable`); else a new one, loaded from a deferred
        saved state with its layers, or starting from the scales of such a graph. The states
        of the pieces of one split graph (``split_from``: its first piece) form one chain; a
        recompile's pieces share an earlier chain's states while they match it piece by piece.
        On fake tensors (DDPOptimizer compiles and runs the pieces on them) a state of no
        model."""
        entry = None if isinstance(key, FakeTensor) else self.entry(key)
        if entry is not None and (state := entry.adaptive.get(graph_id)) is not None:
            return state
        weights = [None if i is None else args[i] for i in layout.weight_inputs]
        owners = [None if w is None else self.key(w) for w in weights]
        device = next((w.device for w in weights if w is not None), torch.device("cpu"))
        state = AdaptiveScaleState(layout, weights, owners, device)
        if entry is None:
            return state
        pieces = [] if split_from is None else self._pieces.setdefault(split_from, [])
        if pieces and graph_id <= pieces[-1][0]:  # a piece before the last: another forward
            pieces.clear()
        before = [alive for _, piece in pieces if (alive := piece()) is not None]  # in graph order
        shared = self._unrecorded == 0 and next(
            (
                s
                for s in self.adaptive_states()
                if s.interchangeable(state)
                and (s.split_from is None) == (split_from is None)
                and s.chain[: len(before) + 1] == [*before, s]
            ),
            None,
        )
        if split_from is not None:
            pieces.append((graph_id, weakref.ref(shared or state)))
        if shared:
            entry.adaptive[graph_id] = shared
            return shared
        entry.adaptive[graph_id] = state
        if split_from is not None:
            state.split_from = split_from
            if before and before[0].split_from == split_from:
                state.chain = before[0].chain  # not where an earlier split's states were shared
                state.chain.append(state)
                state.relate_telemetry()
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
        # a state its graphs share once, at the oldest
        return list({id(state): state for _, state in sorted(found, key=lambda pair: pair[0])}.values())

    def adaptive_loader(
        self, saved: list[dict[str, Any]], model: torch.nn.Module | None = None
    ) -> Callable[[], None]:
        """Check saved adaptive states (of every model, or of ``model``) whole, raising
        ``ValueError`` if any does not fit, and return what loads them: into the compiled
        graphs' states, or, when none is compiled yet (a fresh process), into each graph's
        state as it compiles."""
        states = self.adaptive_states(model)
        if not states:
            for entry in saved:
                check_saved_state(entry)
        elif len(saved) != len(states):
            raise ValueError(
                f"state dict has {len(saved)} adaptive states, the compiled graphs hold {len(states)}"
            )
        pairs = list(zip(states, saved if states else [], strict=True))
        for state, entry in pairs:
            state.check_state_dict(entry)

        def load() -> None:
            self.defer_states([] if states else list(saved))
            for state, entry in pairs:
                state.load_state_dict(entry)

        return load

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

    # ------------------------------------------------------------------ saturation
    def count_saturation(
        self, key: torch.Tensor, graph_id: int, sites: list[Site], counts: torch.Tensor
    ) -> None:
        """Add one call's saturation ``counts`` (per site: its range counts, and 1 where the
        call ran it) of graph ``graph_id`` to ``key``'s model's totals (on the device: no
        synchronisation)."""
        totals = self.entry(key).saturation
        if graph_id not in totals:
            totals[graph_id] = (sites, counts.clone())
        else:
            totals[graph_id][1].add_(counts)

    def gradient_probe(
        self, key: torch.Tensor, graph_id: int, sites: list[Site], device: torch.device
    ) -> torch.Tensor:
        """The probe graph ``graph_id`` of ``key``'s model counts its gradient sites'
        saturation into: a float64 leaf whose gradient accumulates the counts."""
        totals = self.entry(key).gradient_saturation
        if graph_id not in totals:
            totals[graph_id] = (sites, count_probe(len(sites), device))
        return totals[graph_id][1]

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
        ids = {g for entry in self.model_entries(model) for g in entry.graphs}
        return [record for record in self.records if record.graph_id in ids]

    def model_entries(self, model: torch.nn.Module) -> list[Entry]:
        """The entries of ``model``'s parameters (FSDP2's unsharded ones included) that name a
        model (or a pipeline stage)."""
        wanted = model_tensor_ids(model)
        return [entry for key, entry in list(self._entries.items()) if id(key) in wanted]

    def named_graphs(self, model: torch.nn.Module) -> list[tuple[Entry, int, str | None]]:
        """The graphs of :meth:`model_entries`, each with its entry and the FQN in ``model``
        of the module whose frame ran it with that entry's parameter as its key ("" for
        ``model`` itself; None where no call placed it: not called yet, or with another key,
        as an adaptive state keyed by a layer's weight), in ``model``'s order of modules,
        then compile order. The module that ran it is found in ``model`` by identity (a
        block that ran on its own at its first call too), else by the key's name in it."""
        root = unwrapped(model)[0]
        order: dict[int, tuple[int, str]] = {}
        for name, module in root.named_modules():
            order.setdefault(id(unwrapped(module)[0]), (len(order), module_name(name)))
        wanted = model_tensor_ids(model)
        found = []
        for key, entry in list(self._entries.items()):
            if id(key) not in wanted:
                continue
            graphs = (
                entry.graphs | set(entry.adaptive) | set(entry.saturation) | set(entry.gradient_saturation)
            )
            for graph_id in graphs:
                if (place := entry.places.get(graph_id)) is None:
                    found.append(((-1, graph_id), entry, graph_id, None))
                    continue
                module = None if place.module is None else place.module()
                if id(module) not in order:  # not found then, freed, or not in ``model``
                    module = instance_of(key, place.relative, root)[1]
                (index, name) = order.get(id(module), (-1, ""))
                found.append(((index, graph_id), entry, graph_id, name))
        return [
            (entry, graph_id, name) for _, entry, graph_id, name in sorted(found, key=lambda item: item[0])
        ]


REGISTRY = Registry()


def model_tensor_ids(model: torch.nn.Module) -> set[int]:
    """The ids of the tensors that may name ``model`` in the registry: its parameters, and
    the unsharded parameters FSDP2 swaps in for its sharded ones."""
    return {id(p) for p in model.parameters()} | {id(p) for p in unsharded_parameters(model).values()}


@dataclass(frozen=True)
class LayerCoverage:
    """What became of one product of a compiled model: its rounded roles, or why not."""

    layer: str
    graph_id: int
    # role -> "format rounding overflow [scaling]", e.g. {"weight": "e5m2 nearest saturate"}; a
    # role rounded another way in one matmul of its backward also under that option's name
    # ("weight_for_input_grad")
    quantized: dict[str, str]
    kept: str | None = None  # why it stays in higher precision (then ``quantized`` is empty)
    op: str | None = None


def coverage(model: torch.nn.Module) -> list[LayerCoverage]:
    """Per product of ``model``'s compiled graphs: which roles were rounded, with which
    format and rounding, or why the product stays in higher precision."""
    runs: dict[int, list[str]] = {}  # graph id -> the modules that ran it (blocks share one)
    for entry, graph_id, name in REGISTRY.named_graphs(model):
        # (a graph compiled for this key and not yet called: its names are its frame's)
        if graph_id in entry.graphs and (name or "") not in runs.setdefault(graph_id, []):
            runs[graph_id].append(name or "")
    rows = []
    for record in REGISTRY.model_records(model):
        roles: dict[str, dict[str, str]] = {}
        for site in record.sites.values():
            roles.setdefault(site.layer, {})[site.option] = site.spec()
        for name in runs[record.graph_id]:
            rows += [
                LayerCoverage(qualified_name(name, layer), record.graph_id, quantized)
                for layer, quantized in roles.items()
            ]
            rows += [
                LayerCoverage(qualified_name(name, k.layer), record.graph_id, {}, k.reason, k.op)
                for k in record.kept
            ]
    return rows


@dataclass(frozen=True)
class SaturationCount:
    """Where the inputs of one quantize site lay against its format's range."""

    layer: str
    role: str
    fmt: str
    graph_id: int
    # what was counted: calls of the graph that ran the site (weights, activations: a
    # torch.cond branch's only where it was taken), or backward passes through the site
    # (errors, weight gradients)
    calls: int
    saturated: int  # inputs beyond the largest finite value, infinities included
    nonfinite: int  # inputs that were inf or NaN
    nonzero: int  # inputs that were not zero
    underflow: int  # non-zero inputs below the smallest positive value

    @property
    def underflow_fraction(self) -> float:
        """``underflow`` over ``nonzero`` (NaN without a non-zero input)."""
        return self.underflow / self.nonzero if self.nonzero else math.nan


def saturation(model: torch.nn.Module) -> list[SaturationCount]:
    """Per quantize site of ``model``'s graphs compiled with the option
    ``saturation="count"`` (or ``"raise"``), each graph's forward sites (weights,
    activations) then its gradient sites (errors, weight gradients): where its inputs lay
    against the format's range, summed over the calls so far (reading them synchronises
    the device)."""
    rows = []
    for entry, graph_id, name in REGISTRY.named_graphs(model):
        found = []
        if graph_id in entry.saturation:
            sites, counts = entry.saturation[graph_id]
            per_site = zip(sites, counts.tolist(), strict=True)
            found += [(site, calls, *row) for site, (*row, calls) in per_site]
        if graph_id in entry.gradient_saturation:
            sites, probe = entry.gradient_saturation[graph_id]
            totals = torch.zeros_like(probe) if probe.grad is None else probe.grad
            found += [
                (site, int(passes), *map(int, row))
                for site, (*row, passes) in zip(sites, totals.tolist(), strict=True)
            ]
        rows += [
            SaturationCount(qualified_name(name or "", site.layer), site.role, site.fmt, graph_id, *counts)
            for site, *counts in found
        ]
    return rows


def _placed(model: torch.nn.Module, state: AdaptiveScaleState) -> str:
    """The FQN in ``model`` of the module ``state``'s layers are named from, found by its
    layers' weights: a state keyed by a weight that names no call of its own (a block whose
    first parameter is a norm's) is placed so ("" where none places it)."""
    root = unwrapped(model)[0]
    names: dict[int, list[str]] = {}
    unsharded = unsharded_parameters(root)  # what the graphs of an FSDP2 model read
    for path, module in root.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            for held in (param, unsharded.get((id(module), attr))):
                if held is not None:
                    names.setdefault(id(held), []).append(module_name(qualified_name(path, attr)))
    for layer, weight in zip(state.layers, state.weights, strict=True):
        owners = [n.rpartition(".")[0] for n in names.get(id(weight()), ())] if weight is not None else []
        layer = layer.split("#")[0]
        for owner in owners:
            if owner == layer or owner.endswith("." + layer):
                return owner.removesuffix(layer).removesuffix(".")
    return ""


def stats(model: torch.nn.Module) -> list[LayerTelemetry]:
    """Per set of layers of ``model`` a compiled graph scales (compile order) and layer (graph
    order): scale α, cumulative scale, the last refresh's underflow fraction, overflows since,
    the history of refreshes, and the id of the oldest graph of them."""
    graphs = [
        (graph_id, name, entry.adaptive[graph_id])
        for entry, graph_id, name in REGISTRY.named_graphs(model)
        if graph_id in entry.adaptive
    ]
    found = {}  # a state its graphs share once, at the oldest
    for graph_id, name, s in sorted(graphs, key=lambda item: item[0]):
        found.setdefault(id(s), (graph_id, _placed(model, s) if name is None else name, s))
    return [
        dataclasses.replace(t, layer=qualified_name(name, t.layer), graph_id=graph_id)
        for graph_id, name, state in found.values()
        for t in state.telemetry
    ]
