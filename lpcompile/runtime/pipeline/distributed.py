"""Pipelined backpropagation on ``torch.distributed`` ranks: placement, messages, faults.

:class:`lpcompile.runtime.pipeline.PipelinedTrainer` with ``distributed=True`` runs
its stages on the ranks of a process group (``torchrun --nproc_per_node=R``): rank
``r`` of ``R`` runs the ``S/R`` contiguous stages ``r*S/R ... (r+1)*S/R - 1`` with
the same :class:`~lpcompile.runtime.pipeline.schedule.StageRunner` the simulator
uses; this module is what crosses between ranks.

* :class:`Ranks`: the process group (initialised here from torchrun's environment
  unless it already is; gloo on CPUs, NCCL on CUDA), which stages this rank runs,
  the check that every rank cut the same pipeline, gathering the whole model.
* :class:`P2PTransport`: at step ``t`` the activation a rank's first stage reads
  was sent by the previous rank at step ``t - 1``, the error its last stage reads
  by the next rank at ``t - 1``. Every rank is called with the same ``step(x, y)``
  arguments, so each knows from the feed history which messages exist, and their
  layouts come from the stage graphs: receives are posted a step ahead, with no
  handshake. A message is one byte buffer (each tensor 64-byte aligned; an error
  message starts with the loss scale it was computed at, as a float64, and a byte per
  value saying whether it has a gradient), sent with ``isend`` as soon as the stage
  made it and waited for two steps later. Activations and errors travel in two
  process groups, so that the point-to-point operations between two ranks are
  matched in order in each direction (NCCL needs that).
* Faults: every wait has a deadline (``timeout``). A rank whose wait fails (the
  peer's connection closed: it died) or times out (it hung) records the lost rank
  in the process group's store, which torchrun's agent keeps, and raises
  :class:`LostRankError`; a rank that then loses that rank in turn finds the record
  and names the rank lost first.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lpcompile.runtime.pipeline.schedule import (
    BackwardMessage,
    ForwardMessage,
    TensorMeta,
    dense_order,
)

ALIGN = 64  # bytes: each tensor of a message starts at a multiple (as a fresh allocation would)
SCALE_BYTES = 8  # an error message's loss scale, float64
STORE_PREFIX = "lowprec_pipeline"


class LostRankError(RuntimeError):
    """A pipeline rank was lost (its process died or it sent nothing within the timeout).

    ``rank`` is the rank lost (the first one any rank of the run found lost);
    ``reporter`` the rank that found it.
    """

    def __init__(self, message: str, rank: int, reporter: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.reporter = reporter


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_world_size(world_size: int, num_stages: int) -> int:
    """The number of stages per rank; ``ValueError`` where the ranks cannot share them."""
    if world_size > num_stages or num_stages % world_size:
        raise ValueError(
            f"{world_size} ranks cannot run a pipeline of {num_stages} stages: each rank runs an equal "
            f"group of contiguous stages, so the world size must divide {num_stages} "
            f"(use {', '.join(map(str, divisors(num_stages)))} ranks, e.g. torchrun --nproc_per_node="
            f"{num_stages}, or choose stages= to fit {world_size} ranks)"
        )
    return num_stages // world_size


@dataclass
class Ranks:
    """This process's place in the process group, before and after it is joined."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    joined_here: bool = False  # this trainer initialised the process group
    token: str = ""  # names this run's records in the store
    forward_group: Any = None
    backward_group: Any = None

    @classmethod
    def from_environment(cls) -> Ranks:
        """Rank and world size from the initialised process group, else from torchrun's
        environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); nothing is joined yet."""
        if dist.is_available() and dist.is_initialized():
            backend = str(dist.get_backend())
            cuda = "nccl" in backend
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            local = int(os.environ.get("LOCAL_RANK", device.index or 0))
            return cls(dist.get_rank(), dist.get_world_size(), local, device, backend)
        needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [name for name in needed if name not in os.environ]
        if missing:
            raise ValueError(
                f"distributed=True needs an initialised torch.distributed process group or torchrun's "
                f"environment (missing {', '.join(missing)}): run the script with torchrun "
                "--nproc_per_node=N, or call torch.distributed.init_process_group first"
            )
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        if torch.cuda.is_available():
            return cls(rank, world, local, torch.device("cuda", local % torch.cuda.device_count()), "nccl")
        return cls(rank, world, local, torch.device("cpu"), "gloo")

    def stages(self, num_stages: int) -> range:
        """The stages this rank runs; ``ValueError`` (before any work) where they do not fit."""
        per_rank = check_world_size(self.world_size, num_stages)
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def join(self, setup_timeout: float, summary: dict[str, Any]) -> None:
        """Join the process group (unless joined), check that every rank cut the same
        pipeline (``summary``), agree on a run token, make the two point-to-point groups."""
        if not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(self.backend, timeout=timedelta(seconds=setup_timeout))
            self.joined_here = True
        gathered: list[Any] = [None] * self.world_size
        token = secrets.token_hex(8) if self.rank == 0 else ""
        dist.all_gather_object(gathered, (token, summary))
        self.token = gathered[0][0]
        differ = [r for r, (_, other) in enumerate(gathered) if other != summary]
        if differ:
            raise ValueError(
                f"rank {self.rank}: ranks {differ} cut a different pipeline than this one (every rank must "
                f"build the same model, example input and stages=): here {summary}, "
                f"rank {differ[0]}: {gathered[differ[0]][1]}"
            )
        if self.world_size > 1:
            self.forward_group = dist.new_group(backend=self.backend)
            self.backward_group = dist.new_group(backend=self.backend)

    def barrier(self, timeout: float) -> None:
        """Wait until every rank has built (and compiled) its stages."""
        if self.world_size == 1:
            return
        if self.backend == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout))  # names the ranks missing
        else:
            dist.barrier()

    def gather(self, owned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's ``owned`` tensors (CPU copies), merged, on every rank."""
        local = {name: t.detach().to("cpu", copy=True) for name, t in owned.items()}
        if self.world_size == 1:
            return local
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local)
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return merged

    def store(self) -> Any:
        """The run's store (the process group's, under a prefix of this run), or ``None``."""
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            return dist.PrefixStore(f"{STORE_PREFIX}/{self.token}/", _get_default_store())
        except Exception:  # no store reachable: errors name the neighbour that failed
            return None


@dataclass(frozen=True)
class Layout:
    """Where each value of a message lies in its byte buffer."""

    metas: tuple[TensorMeta | None, ...]
    offsets: tuple[int | None, ...]  # None: the value is not sent (no gradient of an integer tensor)
    nbytes: int
    mask: bool  # an error message: its loss scale (float64), then a byte per value, 1 where present

    @classmethod
    def of(cls, metas: Sequence[TensorMeta | None], mask: bool) -> Layout:
        offset = SCALE_BYTES + len(metas) if mask else 0
        offsets: list[int | None] = []
        for meta in metas:
            if meta is None or (mask and not meta.differentiable):
                offsets.append(None)
                continue
            offset = -(-offset // ALIGN) * ALIGN
            offsets.append(offset)
            offset += meta.nbytes
        return cls(tuple(metas), tuple(offsets), offset if any(o is not None for o in offsets) else 0, mask)

    def pack(self, values: Sequence[Any], device: torch.device, scale: float = 1.0) -> torch.Tensor:
        """``values`` in one buffer (an error message's with the loss ``scale`` they were computed at)."""
        buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        present = []
        for value, meta, offset in zip(values, self.metas, self.offsets, strict=True):
            present.append(isinstance(value, torch.Tensor) and offset is not None)
            if not present[-1]:
                continue
            flat = value.detach().permute(dense_order(meta)).reshape(-1).view(torch.uint8)
            buffer[offset : offset + meta.nbytes].copy_(flat)
        if self.mask:
            buffer[:SCALE_BYTES].copy_(torch.tensor([scale], dtype=torch.float64).view(torch.uint8))
            buffer[SCALE_BYTES : SCALE_BYTES + len(present)].copy_(torch.tensor(present, dtype=torch.uint8))
        return buffer

    def unpack(self, buffer: torch.Tensor) -> list[Any]:
        if self.mask and not self.nbytes:  # nothing that could have a gradient
            return [None] * len(self.metas)
        if self.mask:
            present = buffer[SCALE_BYTES : SCALE_BYTES + len(self.metas)].tolist()
        else:
            present = [1] * len(self.metas)
        values: list[Any] = []
        for meta, offset, there in zip(self.metas, self.offsets, present, strict=True):
            if offset is None or not there:
                values.append(None)
                continue
            order = dense_order(meta)
            shape = [meta.shape[d] for d in order]
            inverse = sorted(range(len(order)), key=order.__getitem__)
            raw = buffer[offset : offset + meta.nbytes]
            values.append(raw.view(meta.dtype).view(shape).permute(inverse))
        return values

    def scale(self, buffer: torch.Tensor) -> float:
        """The loss scale an error message's gradients were computed at (1 for one without room)."""
        if not (self.mask and self.nbytes):
            return 1.0
        return float(buffer[:SCALE_BYTES].cpu().view(torch.float64))


class P2PTransport:
    """The messages between this rank's stages and its neighbours' (module doc).

    ``first``/``count``: the rank's stages; ``inputs``: the layouts of what its first
    stage receives (stage ``first``), ``outputs`` of what the next rank's first stage
    receives.
    """

    def __init__(
        self,
        ranks: Ranks,
        first: int,
        count: int,
        num_stages: int,
        inputs: Sequence[TensorMeta | None],
        outputs: Sequence[TensorMeta | None],
        timeout: float,
    ) -> None:
        self.ranks = ranks
        self.rank = ranks.rank
        self.first, self.last = first, first + count - 1
        self.num_stages = num_stages
        self.per_rank = count
        self.timeout = timeout
        # after a wait timed out, the time given to ranks that timed out at about the same
        # moment to record whom they waited for; waits end that much before the timeout
        self.grace = min(1.0, timeout / 10)
        self.device = ranks.device
        self.forward_in = Layout.of(inputs, mask=False) if first > 0 else None
        self.backward_in = Layout.of(outputs, mask=True) if self.last < num_stages - 1 else None
        self.forward_out = Layout.of(outputs, mask=False) if self.last < num_stages - 1 else None
        self.backward_out = Layout.of(inputs, mask=True) if first > 0 else None
        self._fed: dict[int, int] = {}  # step -> the sample fed at that step
        self._message: ForwardMessage | None = None  # this step's sample, for stage 0
        self._labels: dict[int, Any] = {}  # sample -> its label, on the rank of the last stage
        self._receives: dict[tuple[str, int], tuple[Any, torch.Tensor]] = {}
        self._sends: list[tuple[int, Any, torch.Tensor, int]] = []  # (step, work, buffer, peer)
        self._store = ranks.store()

    # -- the feed, the same on every rank ---------------------------------------------------

    def feed(self, t: int, message: ForwardMessage | None) -> None:
        """Step ``t`` feeds ``message`` (``None``: nothing); every rank is told the same."""
        self._message = None
        if message is None:
            return
        sample, values, label = message
        self._fed[t] = sample
        if self.first == 0:
            self._message = (sample, [_to(v, self.device) for v in values], label)
        if self.last == self.num_stages - 1 and self.first > 0:
            self._labels[sample] = _to(label, self.device)

    def _forward_sample(self, t: int) -> int | None:
        return self._fed.get(t - self.first)

    def _backward_sample(self, t: int) -> int | None:
        return self._fed.get(t - 2 * (self.num_stages - 1) + self.last)

    def begin_step(self, t: int) -> None:
        """Post the receives of steps ``t`` and ``t + 1``; wait for the sends of ``t - 2``."""
        for step in (t, t + 1):
            forward = self.forward_in
            if forward is not None and forward.nbytes and self._forward_sample(step) is not None:
                self._post("forward", step, self.forward_in, self.rank - 1, self.ranks.forward_group)
            if (
                self.backward_in is not None
                and self.backward_in.nbytes
                and self._backward_sample(step) is not None
            ):
                self._post("backward", step, self.backward_in, self.rank + 1, self.ranks.backward_group)
        self._wait_sends(before=t - 1)
        oldest = t - 2 * self.num_stages
        for step in [s for s in self._fed if s < oldest]:
            del self._fed[step]

    # -- messages ---------------------------------------------------------------------------

    def forward_message(self, t: int) -> ForwardMessage | None:
        if self.first == 0:
            return self._message
        sample = self._forward_sample(t)
        if sample is None:
            return None
        assert self.forward_in is not None
        values = self.forward_in.unpack(self._receive("forward", t, self.forward_in, self.rank - 1))
        label = self._labels.pop(sample, None) if self.last == self.num_stages - 1 else None
        return sample, values, label

    def backward_message(self, t: int) -> BackwardMessage | None:
        sample = self._backward_sample(t)
        if sample is None:
            return None
        layout = self.backward_in
        assert layout is not None
        buffer = self._receive("backward", t, layout, self.rank + 1)
        return sample, layout.unpack(buffer), layout.scale(buffer)

    def send_forward(self, t: int, message: ForwardMessage) -> None:
        assert self.forward_out is not None
        self._send(t, self.forward_out, message[1], self.rank + 1, self.ranks.forward_group)

    def send_backward(self, t: int, message: BackwardMessage) -> None:
        assert self.backward_out is not None
        _, grads, scale = message
        self._send(t, self.backward_out, grads, self.rank - 1, self.ranks.backward_group, scale)

    def flush(self) -> None:
        """Wait for every send posted."""
        self._wait_sends(before=None)

    # -- point to point ---------------------------------------------------------------------

    def _post(self, kind: str, t: int, layout: Layout, peer: int, group: Any) -> None:
        if (kind, t) in self._receives:
            return
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        try:
            work = dist.irecv(buffer, src=peer, group=group)
        except RuntimeError as error:
            raise self._lost(peer, error, f"posting the receive of the {kind} message of step {t}") from error
        self._receives[(kind, t)] = (work, buffer)

    def _receive(self, kind: str, t: int, layout: Layout, peer: int) -> torch.Tensor:
        """The buffer of the ``kind`` message of step ``t`` (empty for a layout without room)."""
        if not layout.nbytes:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        group = self.ranks.forward_group if kind == "forward" else self.ranks.backward_group
        self._post(kind, t, layout, peer, group)
        work, buffer = self._receives.pop((kind, t))
        self._wait(work, peer, f"the {kind} message of step {t - 1}")
        return buffer

    def _send(
        self, t: int, layout: Layout, values: Sequence[Any], peer: int, group: Any, scale: float = 1.0
    ) -> None:
        if not layout.nbytes:
            return
        buffer = layout.pack(values, self.device, scale)
        try:
            work = dist.isend(buffer, dst=peer, group=group)
        except RuntimeError as error:
            raise self._lost(peer, error, f"sending a message of step {t}") from error
        self._sends.append((t, work, buffer, peer))

    def _wait_sends(self, before: int | None) -> None:
        keep = []
        for t, work, buffer, peer in self._sends:
            if before is not None and t >= before:
                keep.append((t, work, buffer, peer))
                continue
            self._wait(work, peer, f"the delivery of its message of step {t}")
        self._sends = keep

    def _wait(self, work: Any, peer: int, what: str) -> None:
        start, limit = time.monotonic(), self.timeout - self.grace
        try:
            work.wait(timeout=timedelta(seconds=limit))
        except RuntimeError as error:
            hung = time.monotonic() - start >= 0.99 * limit
            raise self._lost(peer, error, what, hung) from error

    # -- faults -----------------------------------------------------------------------------

    def _stages_of(self, rank: int) -> str:
        lo = rank * self.per_rank
        hi = lo + self.per_rank - 1
        return f"stage {lo}" if lo == hi else f"stages {lo}-{hi}"

    def _lost(self, peer: int, error: BaseException, what: str, hung: bool = False) -> LostRankError:
        """The error this rank stops with, naming the rank lost first in this run.

        A peer whose connection failed died (or stopped after recording whom it lost). A
        peer that sent nothing may itself wait for a rank that hung: each rank that timed
        out records whom it waited for, and after a grace period the chain of waits is
        followed to the rank that waits for nobody."""
        cause = _first_line(error)
        record = self._record()
        if record is None and hung:
            self._set(f"waiting/{self.rank}", str(peer))
            time.sleep(self.grace)  # ranks that timed out at about the same moment record too
            record = self._record()
            if record is None:
                lost = self._follow(peer)
                detail = (
                    f"no message from it within the timeout of {self.timeout:g} s: it hung, or it is "
                    "slower than the timeout allows (PipelinedTrainer(timeout=...))"
                )
                self._set("lost", f"{lost}|{self.rank}|{detail}", first=True)
                record = self._record() or (lost, self.rank, detail)
        elif record is None:
            detail = f"its connection failed: its process died ({cause})"
            self._set("lost", f"{peer}|{self.rank}|{detail}", first=True)
            record = self._record() or (peer, self.rank, detail)
        lost, reporter, detail = record
        found = "" if reporter == self.rank else f"found by rank {reporter}: "
        message = f"rank {lost} ({self._stages_of(lost)}) was lost ({found}{detail})"
        if lost != peer:
            message += f"; rank {peer}, which this rank waited for ({what}), stopped too"
        else:
            message += f"; this rank waited for {what}"
        return LostRankError(
            f"pipeline rank {self.rank} ({self._stages_of(self.rank)}) stops: {message}", lost, reporter
        )

    def _follow(self, peer: int) -> int:
        """The end of the chain of recorded waits from ``peer``: the rank nobody hears from."""
        seen = {self.rank}
        while peer not in seen and self._store is not None:
            seen.add(peer)
            try:
                if not self._store.check([f"waiting/{peer}"]):
                    break
                peer = int(self._store.get(f"waiting/{peer}").decode())
            except Exception:
                break
        return peer

    def _record(self) -> tuple[int, int, str] | None:
        if self._store is None:
            return None
        try:
            if not self._store.check(["lost"]):
                return None
            lost, reporter, detail = self._store.get("lost").decode().split("|", 2)
            return int(lost), int(reporter), detail
        except Exception:  # the store is gone with its host
            return None

    def _set(self, key: str, text: str, first: bool = False) -> None:
        if self._store is None:
            return
        try:
            if first:
                self._store.compare_set(key, "", text)  # the first record stays
            else:
                self._store.set(key, text)
        except Exception:
            pass


def _first_line(error: BaseException) -> str:
    """The gist of a c10d error: its first sentence, without the source location."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    text = text.split(". This is typically")[0].splitlines()[0] if text else type(error).__name__
    return text[:200]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device)
    return value
