"""Per-layer adaptive loss scaling: the state a compiled graph reads, and its telemetry.

One :class:`AdaptiveScaleState` belongs to each set of layers of a model that a compiled
graph rewritten by ``insert_loss_scale`` scales: the graphs of the same layers (a recompile
for a new shape, an ``eval()`` forward) share it, so a layer has one scale whichever graph
runs (:meth:`AdaptiveScaleState.interchangeable`). It owns the tensors the graph takes as
inputs:

* ``scales`` (L,): the power-of-two scale ``s_i`` of each layer's error, and
  ``inverses``, their reciprocals (for the unscaling);
* ``hist`` (L, STATS_SIZE): a probe whose gradient is each layer's error
  histogram, passed on refresh calls. The other calls pass a probe of their
  own (``hist_off``), by the layout's ``recording``: with the statistics under
  ``torch.cond`` it requires grad too, the calls pass ``record`` false and the
  graph returns zeros for it; where one graph records at every call it
  requires grad and its gradient is dropped; otherwise it does not require
  grad, and the refresh calls run a second compiled variant of the graph, the
  only one with statistics;
* ``flags`` (L,): a probe whose gradient counts inf/NaN in one gradient of
  each layer without a trained weight (its smallest input gradient), every
  call (for ``LossScaler("adaptive")``; a trained weight's gradient shows the
  layer's overflow instead). It accumulates over backward passes (gradient
  accumulation) until :meth:`AdaptiveScaleState.back_off` reads it.

Every ``interval`` calls (the first included) the backward records the
histograms, and the next call turns them into new scales by the chosen rule (a
pipeline stage's backward does, :meth:`AdaptiveScaleState.refresh_sample`).
With :attr:`AdaptiveScaleState.ranks` set (``LossScaler`` sets it to the ranks whose
states have the same layers: data-parallel replicas, of the model or of one pipeline
stage), the statistics wait for the scaler's step, which sums them over those ranks
(:meth:`AdaptiveScaleState.agree_statistics`), and an overflow on any of them backs a
layer off, so every replica holds the same scales whichever graphs each one ran. A refresh whose layers saw
no non-zero error (all flushed by a graph above: a later pipeline stage, or the graph
after a graph break) decides nothing, and a calibrating state keeps recording. The
pieces of a graph that DDPOptimizer split keep one state each, chained in graph order
(:attr:`AdaptiveScaleState.chain`): they refresh together, bounded as the layers of
one graph (:func:`refresh_chain`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lpcompile.numerics.checks import check_count
from lpcompile.numerics.formats import parse_format
from lpcompile.numerics.quantize import whole_tensor
from lpcompile.numerics.scale_grad import STATS_SIZE
from lpcompile.numerics.scale_rules import (
    approx_range_scale,
    bound_scales,
    overflow_cap,
    quantile_scale,
    underflow_fraction,
)
from lpcompile.passes.dynamo.loss_scale import (
    FLAGS_INPUT,
    HIST_INPUT,
    INVERSES_INPUT,
    RECORD_IN_VARIANT,
    RECORD_INPUT,
    RECORD_UNDER_COND,
    SCALES_INPUT,
    AdaptiveLayout,
)


@dataclass
class LayerTelemetry:
    """What the last refresh saw for one layer, and its history."""

    layer: str
    scale: float = 1.0  # α_i = s_i / s_(i+1): this layer's scale over the one above it
    cumulative: float = 1.0  # s_i, the paper's A_i
    # fraction of non-zero |error| below the format's min at the scale in use (NaN: all zero)
    underflow: float = 0.0
    overflow: int = 0  # inf/NaN seen in this layer's gradients since the last refresh
    # (recording call, the s_i that call used, underflow at it)
    history: list[tuple[int, float, float]] = field(default_factory=list)
    graph_id: int | None = None  # the compiled graph, in lpcompile.stats' rows (None here)


# The keys every AdaptiveScaleState.state_dict() has ("recorded", "recorded_call",
# "recorded_round", "rounds" and "pending" may be missing).
STATE_KEYS = ("layers", "scales", "calls", "telemetry")


def check_saved_state(state: Any) -> None:
    """Raise ``ValueError`` unless ``state`` has the shape of an
    :meth:`AdaptiveScaleState.state_dict` (of any layers): loading it cannot fail half-way."""
    if not isinstance(state, dict) or any(key not in state for key in STATE_KEYS):
        raise ValueError(f"a per-layer scaling state is a dict with keys {STATE_KEYS}, got {state!r:.200}")
    layers = state["layers"]
    if not isinstance(layers, list | tuple) or not all(isinstance(name, str) for name in layers):
        raise ValueError(f"a per-layer scaling state's 'layers' are layer names, got {layers!r:.200}")
    count = len(layers)
    shapes = {"scales": (count,), "recorded": (count,), "pending": (count, STATS_SIZE)}
    for key, shape in shapes.items():
        value = state.get(key)
        if value is None and key != "scales":
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != shape:
            raise ValueError(f"a per-layer scaling state's {key!r} must be a float tensor of shape {shape}")
    check_count("a per-layer scaling state's 'calls'", state["calls"])
    for key in ("recorded_call", "recorded_round", "rounds"):
        if key in state:
            check_count(f"a per-layer scaling state's {key!r}", state[key])
    telemetry = state["telemetry"]
    if not (isinstance(telemetry, list) and len(telemetry) == count):
        raise ValueError(f"a per-layer scaling state's 'telemetry' must be a list of {count} entries")
    for entry in telemetry:
        try:
            LayerTelemetry(**entry)
        except TypeError as error:
            raise ValueError(f"a per-layer scaling state has a bad telemetry entry: {error}") from None


class AdaptiveScaleState:
    """Scales, probes and telemetry of one model's layers, shared by the graphs that scale them.

    ``calibrating``: the scales have not yet been set from statistics (the initial
    ones, or a cascade of refreshes still raising them by more than a binade), so
    every call records statistics. ``unsettled``: since ``LossScaler.update`` a
    backward ran on errors quantized at such scales (the refresh of its statistics
    left the state calibrating), and ``LossScaler`` skips the step those gradients
    went into. A graph that is called but never backpropagated (a forward in
    ``eval()`` with grad on) stays calibrating without holding any step back.
    """

    def __init__(
        self,
        layout: AdaptiveLayout,
        weights: list[torch.Tensor | None],
        owners: list[torch.Tensor | None],
        device: torch.device,
    ) -> None:
        self.layers = list(layout.layers)
        # Weak: the state lives in the registry, keyed weakly by the model's first weight,
        # which a strong reference here would keep alive (and the state with it) after the
        # model. ``weights`` are what the graph reads (a pipeline's weight slots);
        # ``owners`` the model's own parameters they stand for.
        self.weights = [None if w is None else weakref.ref(w) for w in weights]
        self.owners = [None if w is None else weakref.ref(w) for w in owners]
        self.out_dims = layout.out_dims
        self.groups = layout.groups
        self.fmt = parse_format(layout.fmt)
        self.config = config = layout.config
        count = len(self.layers)
        self.scales = torch.full((count,), float(config.init), device=device)
        self.hist = torch.zeros(count, STATS_SIZE, device=device, requires_grad=True)
        self.under_cond = layout.recording == RECORD_UNDER_COND
        one_graph = layout.recording != RECORD_IN_VARIANT
        self.hist_off = torch.zeros(count, STATS_SIZE, device=device, requires_grad=one_graph)
        self.record = {flag: torch.tensor(flag) for flag in (False, True)}  # on the CPU, read by torch.cond
        self.flags = torch.zeros(count, device=device, requires_grad=True)
        self.calls = 0
        self.awaiting = False  # the last call recorded: its backward returns statistics
        self.warned_unreached = False  # see statistics_unreached
        self.recorded = self.scales  # the scales the last recording call read
        self.recorded_call = 0  # and that call's index
        self.recorded_round = 0  # and the rounds of refreshes before it
        # Refreshes from statistics recorded at the scales the latest such refresh set (a
        # pipeline stage's samples in flight read older ones): calibration's cascade
        self.rounds = 0
        # Until the scales come from statistics, every call records them and its
        # gradients (errors quantized at the initial scale) are not to be stepped on.
        self.calibrating = config.rule != "fixed"
        self.unsettled = False
        self.telemetry = [LayerTelemetry(name) for name in self.layers]
        # The states of one graph's layers, in graph order: this one alone, or the pieces of
        # a graph DDPOptimizer split (the first piece's graph id in split_from), whose scales
        # refresh together, bounded as one graph's.
        self.chain: list[AdaptiveScaleState] = [self]
        self.split_from: int | None = None
        self.ranks: Any = None  # a process group whose ranks agree on the scales, or None
        self.agreed = False  # the pending statistics are summed over ranks (agree_statistics)
        self.set_scales([float(config.init)] * count)

    @property
    def scales(self) -> torch.Tensor:
        """The scales ``s_i`` the next call reads (a new tensor whenever they change)."""
        return self._scales

    @scales.setter
    def scales(self, value: torch.Tensor) -> None:
        self._scales = value
        # 1/s_i, exact for powers of two, as an input of its own: a division by s_i in
        # Inductor's loops is redone per vector (the scale's pointer may alias the output)
        self.inverses = value.reciprocal()

    def next_inputs(self) -> tuple[dict[str, torch.Tensor], bool]:
        """The graph inputs for the next call, and whether it records statistics.

        First turns the statistics of the last recording call into new scales.
        While :attr:`calibrating`, every call records.
        """
        self.refresh_pending()
        self.hist_off.grad = None  # what the calls that did not record returned
        recording = self.calibrating or self.calls % self.config.interval == 0
        self.awaiting = recording
        if recording:
            self.recorded, self.recorded_call, self.recorded_round = self.scales, self.calls, self.rounds
        self.calls += 1
        return self.example_inputs(recording), recording

    def example_inputs(self, recording: bool) -> dict[str, torch.Tensor]:
        """Graph inputs by name: the probe of recording calls, or of the others."""
        hist = self.hist if recording else self.hist_off
        scales = {SCALES_INPUT: self.scales, INVERSES_INPUT: self.inverses}
        record = {RECORD_INPUT: self.record[recording]} if self.under_cond else {}
        return {**scales, HIST_INPUT: hist, FLAGS_INPUT: self.flags, **record}

    def statistics_unreached(self) -> bool:
        """Whether the last call recorded statistics that its backward did not return: a
        backward through ``torch.autograd.grad`` or ``backward(inputs=...)`` leaves the
        probe, a leaf, without its gradient (or that call had no backward)."""
        return self.awaiting and self.hist.grad is None

    def received_statistics(self) -> bool:
        """Whether statistics reached this state: pending, or refreshed from (or loaded)."""
        return self.hist.grad is not None or any(t.history for t in self.telemetry)

    def refresh_pending(self) -> None:
        """Turn the statistics of the last recording call, if not yet done, into scales
        (of every state of :attr:`chain`). Statistics to be summed over :attr:`ranks` wait
        for the scaler's step (:meth:`agree_statistics`): until then, calls add theirs."""
        if any(s.hist.grad is not None and s.ranks is not None and not s.agreed for s in self.chain):
            return
        pending = [state for state in self.chain if state.hist.grad is not None]
        if not pending:
            return
        before = [state.calibrating for state in pending]  # as when that call ran: only refreshes change it
        unconfirmed = refresh_chain(self.chain)
        for state, calibrating in zip(pending, before, strict=True):
            state.unsettled |= calibrating and unconfirmed

    def refresh_sample(self, read: torch.Tensor, call: int, rounds: int) -> bool:
        """Turn the statistics of one backward, whose forward (call ``call``, after ``rounds``
        :attr:`rounds`) read the scales ``read``, into scales: a pipeline stage's graph (not
        split), refreshed after each sample's backward, since its forwards run ahead of
        their backwards. Whether they left ``read`` unconfirmed (:func:`refresh_chain`);
        False without statistics."""
        if self.hist.grad is None:
            return False
        assert len(self.chain) == 1, "a pipeline stage's graph is not split"
        self.recorded, self.recorded_call, self.recorded_round = read, call, rounds
        return refresh_chain(self.chain)

    def take_statistics(self) -> tuple[list[float | None], list[float | None]] | None:
        """Record the pending statistics in the telemetry and drop them; return each layer's
        scale by the configured rule and its overflow cap (None for either: no change).
        None without pending statistics."""
        if self.hist.grad is None:
            return None
        stats = self.hist.grad.detach().cpu()
        self.hist.grad, self.agreed = None, False
        used = self.recorded.tolist()  # a back-off since may have changed self.scales
        for i, t in enumerate(self.telemetry):
            t.underflow = underflow_fraction(stats[i], used[i], self.fmt)
            t.history.append((self.recorded_call, used[i], t.underflow))
            t.overflow = 0
        if self.config.rule == "fixed":
            return [None] * len(self.layers), [None] * len(self.layers)
        if self.config.rule == "quantile":
            needed = [quantile_scale(s, self.fmt, self.config.underflow) for s in stats]
        else:
            needed = [
                approx_range_scale(s, None if w is None else w(), self.fmt, self.config.underflow, dim, g)
                for s, w, dim, g in zip(stats, self.weights, self.out_dims, self.groups, strict=True)
            ]
        return needed, [overflow_cap(s, self.fmt) for s in stats]

    def set_scales(self, scales: list[float]) -> None:
        """Use ``scales`` from the next call on (and relate the telemetry to them)."""
        # A new tensor, not an in-place update: a backward still to come (pipelining,
        # or a graph that was run twice before backward) saved the scales its forward read.
        self.scales = torch.tensor(scales, dtype=torch.float32, device=self.scales.device)
        self.relate_telemetry()

    def relate_telemetry(self) -> None:
        """Each layer's telemetry scale over the layer above it, through :attr:`chain`."""
        above = 1.0
        for state in reversed(self.chain):
            for t, s in reversed(list(zip(state.telemetry, state.scales.tolist(), strict=True))):
                t.cumulative, t.scale, above = s, s / above, s

    def weight_keys(self) -> tuple[int | None, ...]:
        """The identities of the layers' own weights (``None`` for a layer without one)."""
        return tuple(_weight_key(w) for w in self.owners)

    def interchangeable(self, other: AdaptiveScaleState) -> bool:
        """Whether a graph made for ``other`` may read this state instead: the same layers
        (:meth:`same_layers`), reading the same weights, with probes of the same kind."""
        return (
            self.same_layers(other)
            and [_weight_key(w) for w in self.weights] == [_weight_key(w) for w in other.weights]
            and (self.out_dims, self.groups) == (other.out_dims, other.groups)
            and (self.under_cond, self.hist_off.requires_grad)
            == (other.under_cond, other.hist_off.requires_grad)
        )

    def same_layers(self, other: AdaptiveScaleState) -> bool:
        """Whether ``other`` scales the same layers of the same model with the same settings
        (another graph of it: a recompile for new shapes, or its ``eval()`` forward)."""
        keys = self.weight_keys()
        return (
            other is not self
            and other.layers == self.layers
            and other.fmt == self.fmt
            and other.config == self.config
            and any(k is not None for k in keys)
            and keys == other.weight_keys()
        )

    def start_from(self, other: AdaptiveScaleState) -> None:
        """Start at ``other``'s scales instead of the initial ones; still calibrating, so the
        first call's statistics confirm them (its step is taken if they hold)."""
        self.set_scales(other.scales.tolist())
        self.recorded = self.scales

    def trained_by(self, params: set[int]) -> bool:
        """Whether an optimizer holding the parameters with these ids trains this state's
        layers (so its scaler backs them off); a state whose layers read no parameter
        belongs to every scaler."""
        keys = {_weight_key(w) for w in self.owners} - {None}
        return not keys or not keys.isdisjoint(params)

    def overflowed(
        self, found_inf: bool = False, grads: Mapping[int, torch.Tensor] | None = None
    ) -> list[int]:
        """Indices of layers whose gradients held inf/NaN since the last back-off.

        The in-graph probe counts them in layers without a trained weight. The
        others show an overflow in their weight gradient (a product of the layer's
        error, or a sum over the batch that overflowed by itself): when
        ``found_inf`` (the step found inf/NaN in some gradient) those are checked:
        the ``.grad`` of the weights the graph read, or ``grads``, the weight
        gradients by the ``id`` of the model's parameter they belong to (a
        pipeline's weight slots hold one in-flight sample's each).
        """
        counts = torch.zeros(len(self.layers)) if self.flags.grad is None else self.flags.grad.detach().cpu()
        if found_inf:
            if grads is None:
                found = [None if w is None or w() is None else w().grad for w in self.weights]
            else:
                found = [None if w is None or w() is None else grads.get(id(w())) for w in self.owners]
            for i, g in enumerate(found):
                if g is not None and not bool(whole_tensor(torch.isfinite(g).all())):
                    counts[i] += 1
        counts = self._agreed(counts.to(self.flags.device), torch.distributed.ReduceOp.MAX)
        return [i for i, count in enumerate(counts.tolist()) if count > 0]

    def join_replicas(self, ranks: Any) -> None:
        """Take the scales, calibration and telemetry of the first rank of ``ranks`` (a
        process group of replicas of these layers), keeping this rank's statistics and
        overflow counts not yet used (zeros where another has some); still calibrating, and
        the step to be skipped, if so on any of them. A backward before the replicas were
        known (1F1B's first microbatches, a warm-up) may have refreshed each rank's scales
        from its own statistics; those since are summed by :meth:`agree_statistics`."""
        dist = torch.distributed
        saved = [self.state_dict()]
        dist.broadcast_object_list(saved, group_src=0, group=ranks, device=self.scales.device)
        held = [self.unsettled, self.calibrating]
        anywhere = torch.tensor(held, dtype=torch.float32, device=self.scales.device)
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=ranks)
        unsettled, calibrating = (bool(flag) for flag in anywhere.tolist())
        if dist.get_rank(ranks) != 0:
            pending, flags = self.hist.grad, self.flags.grad
            self.load_state_dict(saved[0])
            self.hist.grad, self.flags.grad, self.agreed = pending, flags, False
        self.unsettled, self.calibrating = unsettled, calibrating

    def agree_statistics(self) -> None:
        """Sum the pending statistics over :attr:`ranks` (zeros from a rank whose calls since
        the last step did not record), for the next call to refresh from: each replica then
        sets the same scales, whichever of its graphs recorded, and however many times."""
        pending = torch.zeros_like(self.hist) if self.hist.grad is None else self.hist.grad.detach()
        self.hist.grad, self.agreed = self._agreed(pending, torch.distributed.ReduceOp.SUM), True

    def _agreed(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        """``tensor`` reduced with ``op`` over :attr:`ranks` (itself without them)."""
        if self.ranks is None:
            return tensor
        tensor = tensor.clone()
        torch.distributed.all_reduce(tensor, op=op, group=self.ranks)
        return tensor

    def back_off(
        self,
        found_inf: bool = False,
        everywhere: bool = False,
        grads: Mapping[int, torch.Tensor] | None = None,
        read: torch.Tensor | None = None,
    ) -> list[str]:
        """Halve the scale of every layer that overflowed (see :meth:`overflowed`), or of
        every layer (``everywhere``); not under the "fixed" rule. Returns their names.
        ``read``: the scales the overflowing call read, if another call has changed them
        since (pipelining): a layer's scale becomes at most half of what that call read."""
        hit = list(range(len(self.layers))) if everywhere else self.overflowed(found_inf, grads)
        for i in hit:
            self.telemetry[i].overflow += 1
        if hit and self.config.rule != "fixed":
            scales = self.scales.tolist()
            halved = scales if read is None else read.tolist()
            for i in hit:
                scales[i] = min(scales[i], halved[i] / 2)
            self.set_scales(scales)
        self.flags.grad = None
        return [self.layers[i] for i in hit]

    def state_dict(self) -> dict[str, Any]:
        """Scales, call count, telemetry, and the statistics of a recording call not yet
        turned into scales (the next call does that)."""
        pending = self.hist.grad
        return {
            "layers": list(self.layers),
            "scales": self.scales.detach().cpu().clone(),
            "recorded": self.recorded.detach().cpu().clone(),
            "recorded_call": self.recorded_call,
            "recorded_round": self.recorded_round,
            "rounds": self.rounds,
            "pending": None if pending is None else pending.detach().cpu().clone(),
            "agreed": self.agreed,
            "calls": self.calls,
            "calibrating": self.calibrating,
            "telemetry": [dict(t.__dict__, history=list(t.history)) for t in self.telemetry],
        }

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` unless ``state`` is a :meth:`state_dict` of these layers."""
        check_saved_state(state)
        if list(state["layers"]) != self.layers:
            raise ValueError(f"state for layers {state['layers']} does not fit layers {self.layers}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; what calls since compiling left pending is dropped."""
        self.check_state_dict(state)
        device = self.scales.device
        self.scales = state["scales"].to(torch.float32).to(device).clone()
        self.recorded = state.get("recorded", state["scales"]).to(torch.float32).to(device).clone()
        self.recorded_call = state.get("recorded_call", max(state["calls"] - 1, 0))
        self.rounds = state.get("rounds", len(state["telemetry"][0]["history"]))
        self.recorded_round = state.get("recorded_round", self.rounds)
        pending = state.get("pending")
        self.hist.grad = None if pending is None else pending.to(torch.float32).to(device).clone()
        self.agreed = pending is not None and bool(state.get("agreed", False))
        self.flags.grad = None
        self.calls = state["calls"]
        self.calibrating = state.get("calibrating", False)
        self.unsettled = False
        self.telemetry = [LayerTelemetry(**t) for t in state["telemetry"]]


def refresh_chain(chain: list[AdaptiveScaleState]) -> bool:
    """Set new scales from the pending statistics of ``chain``'s states by the configured
    rule, the bounds applied through all their layers in order, as through one graph's.
    Returns whether they left the scales they were recorded at unconfirmed: a layer's new
    scale more than a binade above (that call's errors underflowed), and the states still
    calibrating. Statistics in which no layer saw a non-zero error decide nothing: the
    states keep calibrating (where they were) and their scales; those are unconfirmed only
    if a refresh since the call raised them (a pipeline stage's sample in flight)."""
    taken = [state.take_statistics() for state in chain]
    config = chain[0].config
    if config.rule == "fixed" or all(t is None for t in taken):
        return False
    if all(t is None or all(n is None for n in (*t[0], *t[1])) for t in taken):
        # Where the errors reach the graph from another (a later pipeline stage, a graph
        # break), that one flushed them all: nothing to judge by, so no round either.
        return any(
            new > 2 * old
            for state in chain
            for new, old in zip(state.scales.tolist(), state.recorded.tolist(), strict=True)
        )
    recorded = [state for state, t in zip(chain, taken, strict=True) if t is not None]
    if all(state.recorded_round == state.rounds for state in recorded):
        for state in chain:
            state.rounds += 1
    needed, caps, current, used = [], [], [], []
    for state, t in zip(chain, taken, strict=True):
        count = len(state.layers)
        needed += [None] * count if t is None else t[0]
        caps += [None] * count if t is None else t[1]
        current += state.scales.tolist()
        used += state.recorded.tolist()
    scales = bound_scales(needed, current, caps, config.bounds(chain[0].fmt))
    start = 0
    for state in chain:
        count = len(state.layers)
        state.set_scales(scales[start : start + count])
        start += count
    raised = any(new > 2 * old for new, old in zip(scales, used, strict=True))
    if any(cap is not None and 2 * cap < u for cap, u in zip(caps, used, strict=True)):
        # The call's errors went beyond the format (a loss spike, or scales set too high):
        # the scales its statistics ask for may be far below what the next calls need
        # (their errors flushed to zero), so those calls record, and a step whose statistics
        # raise them by more than a binade is skipped, until a refresh confirms them.
        for state in chain:
            state.calibrating, state.rounds = True, 0
        return raised
    # Calibrated once a call's scales were within a binade of what its statistics ask
    # for: errors that underflowed hid the layers below them (all zero there), so each
    # refresh reaches further down (a round). Bounded: a layer that overflows at the
    # scale its underflow asks for would raise forever.
    if not raised or max(state.rounds for state in chain) > len(scales):
        for state in chain:
            state.calibrating = False
        return False
    return True


def back_off_states(
    states: Sequence[AdaptiveScaleState],
    found_inf: bool,
    grads: Mapping[int, torch.Tensor] | None = None,
    reads: Sequence[torch.Tensor | None] | None = None,
    anywhere: Callable[[bool], bool] = bool,
) -> None:
    """Back off the layers of ``states`` that overflowed (:meth:`AdaptiveScaleState.back_off`,
    with ``grads`` and each state's scales read, ``reads``); where ``found_inf`` but no
    layer's gradients show it, every layer of them. ``anywhere``: whether a layer overflowed
    in any part of the model (pipeline stages on other ranks), from whether one did here."""
    reads = reads or [None] * len(states)
    hit = [state.back_off(found_inf, grads=grads, read=r) for state, r in zip(states, reads, strict=True)]
    if found_inf and not anywhere(any(hit)):
        for state, r in zip(states, reads, strict=True):
            state.back_off(everywhere=True, read=r)


def _weight_key(ref: weakref.ref | None) -> int | None:
    """Identity of a layer's own weight, None without one or once freed."""
    weight = None if ref is None else ref()
    return None if weight is None else id(weight)
