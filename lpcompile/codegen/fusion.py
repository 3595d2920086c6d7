"""Fusion groups: connected pointwise regions of an ATen graph around lowprec nodes.

A group starts at a ``lowprec`` node and grows over nodes that
``triton_ops.OPS`` can render and whose output has the group's shape (the
iteration space; other inputs must broadcast to it):

* producers of a member (their inputs are then read instead of their output);
* users of a member;
* siblings: users of a full-size input of the group, so that the input is
  read once (the error's histogram and its scaled quantize read ``g`` once);
* reductions fed by a member: a full ``sum`` / ``amax``, and the exponent
  histogram ``index_add(zeros(K), 0, bins.view(-1).to(int64), ones.view(-1))``
  that ``lowprec.adaptive_ops.gradient_stats`` traces into.

A node joins only if the group stays convex (no path leaves the group and
comes back), so the group can become one call. A group is kept only if it
does real lowprec work (a ``quantize`` or ``predict_weight``): the forward
copies of ``quantize_grad`` and ``scale_grad`` alone are left as they are.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from lpcompile.codegen.triton_ops import OPS, cpu_scalar
from lpcompile.passes.graph import INDEX_CASTS, RESHAPES

aten = torch.ops.aten
WORK_TARGETS = {torch.ops.lowprec.quantize.default, torch.ops.lowprec.predict_weight.default}
SEED_TARGETS = {
    torch.ops.lowprec.quantize.default,
    torch.ops.lowprec.quantize_grad.default,
    torch.ops.lowprec.scale_grad.default,
    torch.ops.lowprec.predict_weight.default,
}
MAX_BINS = 4096


@dataclass
class Reduction:
    """A reduction of a member's values; ``node`` is the graph value it produces."""

    node: torch.fx.Node
    kind: str  # "sum", "amax" or "histogram"
    source: torch.fx.Node
    bins: int = 0
    helpers: list[torch.fx.Node] = field(default_factory=list)  # pattern nodes that go with it


@dataclass
class FusionGroup:
    """Nodes fused into one kernel, over one iteration shape."""

    shape: tuple[int, ...]
    nodes: list[torch.fx.Node]  # pointwise, identity and view members, in graph order
    reductions: list[Reduction]

    @property
    def members(self) -> set[torch.fx.Node]:
        out = set(self.nodes)
        for red in self.reductions:
            out.add(red.node)
            out.update(red.helpers)
        return out


def static_shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    """The shape of a node's tensor value when it is static, else ``None``."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    if not all(is_concrete_int(d) for d in value.shape):
        return None
    return tuple(int(d) for d in value.shape)


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False))


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensors a member reads (``scale_grad``'s scale and probe are not read in the forward)."""
    return OPS[node.target].reads(node)


def on_device(node: torch.fx.Node, device: torch.device) -> bool:
    """Whether a kernel on ``device`` can read ``node``'s value: on that device, or a 0-dim CPU
    tensor (such as the per-step seed on a GPU), which the launcher copies there."""
    return node.meta["val"].device == device or cpu_scalar(node)


def fusable(node: torch.fx.Node, shape: tuple[int, ...], device: torch.device, stage: object = None) -> bool:
    """Whether ``node`` can be a pointwise member of a group over ``shape`` (in pipeline ``stage``)."""
    if node.op != "call_function" or node.target not in OPS:
        return False
    if node.meta.get("stage") != stage:  # pipelined graphs: a kernel stays inside one stage
        return False
    if static_shape(node) != shape or node.meta["val"].device != device:
        return False
    values = [n.meta["val"] for n in (node, *_tensor_args(node))]
    if any(isinstance(v, torch.Tensor) and v.is_complex() for v in values):  # Triton has no complex dtype
        return False
    for arg in _tensor_args(node):
        arg_shape = static_shape(arg)
        if arg_shape is None or not broadcasts_to(arg_shape, shape) or not on_device(arg, device):
            return False
    try:
        return bool(OPS[node.target].check(node))
    except (ValueError, TypeError, KeyError, AttributeError):
        return False


def _single_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def match_histogram(node: torch.fx.Node, numel: int) -> Reduction | None:
    """A histogram of ``bins``: ``index_add(zeros([K]), 0, bins.view(-1).to(int64), ones.view(-1))``."""
    if node.op != "call_function" or node.target != aten.index_add.default:
        return None
    base, dim, index, source = node.args[:4]
    alpha = node.args[4] if len(node.args) > 4 else node.kwargs.get("alpha", 1)
    if dim != 0 or alpha != 1 or not all(isinstance(a, torch.fx.Node) for a in (base, index, source)):
        return None
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 1:
        return None
    bins = out.shape[0]
    if not isinstance(bins, int) or bins < 1 or bins > MAX_BINS or bins & (bins - 1):
        return None
    if base.target != aten.zeros.default or len(base.users) != 1:
        return None
    helpers = [base]
    # index: the binned member, through a flattening view and a cast to int64
    walk = index
    while walk.op == "call_function" and walk.target in RESHAPES | INDEX_CASTS and len(walk.users) == 1:
        helpers.append(walk)
        walk = walk.args[0]
    if (
        walk is index
        or walk.meta["val"].dtype not in (torch.int32, torch.int64)
        or walk.meta["val"].numel() != numel
    ):
        return None
    member = walk
    # source: ones of the same size, possibly flattened
    walk = source
    while walk.op == "call_function" and walk.target in RESHAPES and len(walk.users) == 1:
        helpers.append(walk)
        walk = walk.args[0]
    ones = walk.target in (aten.ones_like.default, aten.ones.default) or (
        walk.target in (aten.full.default, aten.full_like.default) and walk.args[1] == 1
    )
    if not ones or len(walk.users) != 1 or walk.meta["val"].numel() != numel:
        return None
    helpers.append(walk)
    return Reduction(node, "histogram", member, bins, helpers)


def match_reduction(user: torch.fx.Node, member: torch.fx.Node, numel: int) -> Reduction | None:
    """A full reduction of ``member`` (a sum, an amax or a histogram) starting at its user ``user``."""
    if user.op != "call_function":
        return None
    value = member.meta["val"]
    rank = value.dim()
    if user.target in (aten.sum.default, aten.sum.dim_IntList, aten.amax.default) and user.args[0] is member:
        if user.target == aten.sum.default:
            full = len(user.args) == 1
        else:
            dims = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", [])
            full = dims in (None, []) or sorted(d % max(rank, 1) for d in dims) == list(range(rank))
        if not full or user.kwargs.get("dtype") is not None:
            return None
        if user.target == aten.amax.default:
            return Reduction(user, "amax", member) if value.dtype == torch.float32 else None
        ok = value.dtype == torch.float32 or value.dtype in (torch.bool, torch.int32, torch.int64)
        return Reduction(user, "sum", member) if ok else None
    # histogram: member -> (view / cast)* -> index_add
    walk = user
    for _ in range(3):
        if walk.op != "call_function" or walk.target not in RESHAPES | INDEX_CASTS:
            break
        nxt = _single_user(walk)
        if nxt is None:
            return None
        if nxt.target == aten.index_add.default:
            hist = match_histogram(nxt, numel)
            return hist if hist is not None and hist.source is member else None
        walk = nxt
    return None


class _Order:
    """Positions of the graph's nodes, for the convexity test."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.pos = {node: i for i, node in enumerate(graph.nodes)}

    def convex(self, members: set[torch.fx.Node]) -> bool:
        """No path from a member through non-members back into the group."""
        last = max(self.pos[n] for n in members)
        stack = [u for m in members for u in m.users if u not in members and self.pos[u] < last]
        seen: set[torch.fx.Node] = set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            for user in node.users:
                if user in members:
                    return False
                if self.pos[user] < last and user not in seen:
                    stack.append(user)
        return True


def grow_group(seed: torch.fx.Node) -> FusionGroup | None:
    """The fusion group around ``seed``, or ``None`` if it would do no lowprec work."""
    shape = static_shape(seed)
    if shape is None:
        return None
    device = seed.meta["val"].device
    stage = seed.meta.get("stage")
    if not fusable(seed, shape, device, stage):
        return None
    numel = seed.meta["val"].numel()
    order = _Order(seed.graph)
    nodes: set[torch.fx.Node] = {seed}
    reductions: dict[torch.fx.Node, Reduction] = {}

    def all_members() -> set[torch.fx.Node]:
        out = set(nodes)
        for red in reductions.values():
            out.add(red.node)
            out.update(red.helpers)
        return out

    queue = deque([seed])
    while queue:
        node = queue.popleft()
        candidates: list[torch.fx.Node | Reduction] = []
        for arg in _tensor_args(node):
            if arg not in nodes and fusable(arg, shape, device, stage):
                candidates.append(arg)
            elif arg not in nodes and static_shape(arg) == shape:  # a full-size input: its other readers
                for user in arg.users:
                    if user in nodes or user in reductions:
                        continue
                    if fusable(user, shape, device, stage):
                        candidates.append(user)
                    elif (red := match_reduction(user, arg, numel)) is not None:
                        candidates.append(red)
        for user in node.users:
            if user in nodes or user in reductions:
                continue
            if fusable(user, shape, device, stage):
                candidates.append(user)
            else:
                red = match_reduction(user, node, numel)
                if red is not None:
                    candidates.append(red)
        for cand in candidates:
            # A reduction's value exists only after the kernel: no member may read it.
            if isinstance(cand, Reduction):
                if cand.node in reductions or cand.node.meta.get("stage") != stage:
                    continue
                if any(user in nodes for user in cand.node.users):
                    continue
                trial = all_members() | {cand.node, *cand.helpers}
                if order.convex(trial):
                    reductions[cand.node] = cand
            else:
                if cand in nodes or any(arg in reductions for arg in cand.all_input_nodes):
                    continue
                if order.convex(all_members() | {cand}):
                    nodes.add(cand)
                    queue.append(cand)
    if not any(n.target in WORK_TARGETS for n in nodes):
        return None
    ordered = sorted(nodes, key=order.pos.__getitem__)
    reds = sorted(reductions.values(), key=lambda r: order.pos[r.node])
    return FusionGroup(shape, ordered, reds)


def is_seed(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in SEED_TARGETS
