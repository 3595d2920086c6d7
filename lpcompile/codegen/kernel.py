"""Kernel emission: one fusion group -> the source of one Triton kernel.

The kernel is written through an :class:`IndentedBuffer` in the style of the
Triton tutorials: ``_ptr`` suffixes, ``BLOCK_SIZE: tl.constexpr``, the
pid / offsets / mask idiom, and a header comment naming the FX nodes it fuses.
Each program handles ``BLOCK_SIZE`` consecutive elements of the group's
iteration shape in row-major order (the element index is also the counter of
the stochastic-rounding RNG, as in ``lpcompile.numerics.rng``). Inputs are read once,
outputs written once; reductions are finished per program:

* integer sums (counts) and histograms: atomic adds, exact;
* float sums: one partial per program, summed by the launcher (deterministic,
  but not in torch's order: equal to a few ulp, not bit for bit);
* amax: an atomic max on an order-preserving integer key, exact.

The kernel's name is ``lowprec_fused_<hash>``, the hash of its code with the
comments left out, so identical groups (the same pattern in two layers, the
same graph compiled twice) share one compiled kernel.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from lpcompile.codegen.fusion import FusionGroup, static_shape
from lpcompile.codegen.triton_ops import OPS, TL_DTYPES, Value, cast, literal, rng_helpers

NAME_PLACEHOLDER = "__KERNEL_NAME__"
# Block reductions are tl.reduce with triton's own combine functions rather than tl.sum /
# tl.max: those are triton.jit functions of triton.language, which the interpreter can only
# call if TRITON_INTERPRET was set before triton's first import, whereas tl.reduce is patched
# by the interpreter and, given these combine functions, takes its numpy fast path.
SUM_COMBINE = "tl.standard._sum_combine"
MAX_COMBINE = "tl.standard._elementwise_max"


class IndentedBuffer:
    """Lines of source with an indentation level (as Inductor's ``IndentedBuffer``)."""

    def __init__(self, indent: str = "    ") -> None:
        self.lines: list[str] = []
        self.level = 0
        self.indent = indent

    def writeline(self, line: str = "") -> None:
        self.lines.append(self.indent * self.level + line if line else "")

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.writeline(line)

    @contextlib.contextmanager
    def indented(self) -> Iterator[None]:
        self.level += 1
        try:
            yield
        finally:
            self.level -= 1

    def getvalue(self) -> str:
        return "\n".join(self.lines) + "\n"


@dataclass(frozen=True)
class InputSpec:
    name: str  # the FX node read
    kind: str  # "contiguous", "strided" (incl. broadcast) or "scalar"
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class OutputSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    strided: bool


@dataclass(frozen=True)
class ReductionSpec:
    name: str
    kind: str  # "sum" (integer, atomic), "sum_partials" (float), "amax", "histogram"
    dtype: torch.dtype  # of the graph value
    shape: tuple[int, ...]
    bins: int = 0


@dataclass
class KernelSpec:
    """A generated kernel and everything the launcher needs to call it."""

    name: str
    key: str  # hash of the code without comments
    source: str
    graph: str
    shape: tuple[int, ...]
    inputs: list[InputSpec]
    outputs: list[OutputSpec]
    reductions: list[ReductionSpec]
    ints: list[tuple[str, int]]  # runtime int arguments (RNG stream offsets)
    nodes: list[str]  # the FX nodes it fuses
    exact: bool  # False when a transcendental op makes it agree to a few ulp only
    coords: bool  # whether strided loads/stores need row-major coordinates
    device: torch.device  # where the group's values live (0-dim CPU inputs are copied there)
    views: list[str] = field(default_factory=list)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _describe(node: torch.fx.Node) -> str:
    def show(a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return a.name
        if isinstance(a, list | tuple):
            return "[" + ", ".join(show(x) for x in a) + "]"
        return repr(a)

    target = str(node.target).replace("aten::", "aten.").replace("lowprec::", "lowprec.")
    args = [show(a) for a in node.args] + [f"{k}={show(v)}" for k, v in node.kwargs.items()]
    return f"{node.name} = {target}({', '.join(args)})"


def _shape_text(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"


def code_key(source: str) -> str:
    """The hash of ``source``'s code: comments and blank lines left out."""
    code = []
    for line in source.splitlines():
        stripped = line.split("#", 1)[0].rstrip()
        if stripped:
            code.append(stripped)
    return hashlib.sha256("\n".join(code).encode()).hexdigest()


class KernelWriter:
    """Renders a fusion group; the ``triton_ops.Writer`` the op table writes through."""

    def __init__(self, group: FusionGroup) -> None:
        self.group = group
        self.body = IndentedBuffer()
        self.body.level = 1
        self.values: dict[torch.fx.Node, Value] = {}
        self.inputs: list[InputSpec] = []
        self._input_values: dict[torch.fx.Node, Value] = {}
        self.helpers: dict[str, str] = {}
        self.ints: list[tuple[str, int]] = []
        self._keys: dict[tuple[str, int], str] = {}
        self._count = 0
        self.coords = False

    # -- the Writer interface (triton_ops) --------------------------------------------

    def arg(self, a: Any) -> Value | Any:
        if not isinstance(a, torch.fx.Node):
            return a
        if a in self.values:
            return self.values[a]
        return self._load(a)

    def operand(self, a: Any, dtype: torch.dtype) -> str:
        if isinstance(a, torch.fx.Node):
            return self.cast(self.arg(a), dtype).expr
        return literal(a, dtype)

    def cast(self, value: Value, dtype: torch.dtype) -> Value:
        return cast(self, value, dtype)

    def assign(self, expr: str, dtype: torch.dtype) -> Value:
        name = f"t{self._count}"
        self._count += 1
        self.body.writeline(f"{name} = {expr}")
        return Value(name, dtype)

    def helper(self, name: str, source: str) -> str:
        if name in ("stream_key", "random_bits"):
            self.helper("lowbias32", rng_helpers()["lowbias32"])
        self.helpers.setdefault(name, source)
        return name

    def runtime_int(self, prefix: str, value: int) -> str:
        name = f"{prefix}{sum(1 for n, _ in self.ints if n.startswith(prefix))}"
        self.ints.append((name, value))
        return name

    def random(self, seed: Value, offset: int) -> Value:
        helpers = rng_helpers()
        for name in ("stream_key", "random_bits"):
            self.helper(name, helpers[name])
        key = (seed.expr, offset)
        if key not in self._keys:
            arg = self.runtime_int("offset", offset)
            k = len(self._keys)
            self.body.writeline(f"key{k} = stream_key({seed.expr}, {arg})")
            self.body.writeline(f"random{k} = random_bits(offsets, key{k})")
            self._keys[key] = f"random{k}"
        return Value(self._keys[key], torch.int64)

    # -- loads ---------------------------------------------------------------------------

    def _load(self, node: torch.fx.Node) -> Value:
        if node in self._input_values:
            return self._input_values[node]
        value = node.meta["val"]
        shape = static_shape(node)
        i = len(self.inputs)
        ptr = f"in{i}_ptr"
        if value.numel() == 1 and shape != self.group.shape or value.dim() == 0:
            kind, expr = "scalar", f"tl.load({ptr})"
        elif shape == self.group.shape and value.is_contiguous():
            kind, expr = "contiguous", f"tl.load({ptr} + offsets, mask=mask)"
        else:
            kind, expr = "strided", f"tl.load({ptr} + {self._strided(f'in{i}')}, mask=mask)"
            self.coords = True
        self.inputs.append(InputSpec(node.name, kind, value.dtype, shape))
        how = "broadcast" if kind == "strided" and shape != self.group.shape else kind
        self.body.writeline(f"in{i} = {expr}  # {node.name}: {_shape_text(value.dtype, shape)} ({how})")
        loaded = Value(f"in{i}", value.dtype)
        self._input_values[node] = loaded
        return loaded

    def _strided(self, prefix: str) -> str:
        rank = len(self.group.shape)
        if rank == 0:
            return "0"
        return " + ".join(f"idx{d} * {prefix}_stride{d}" for d in range(rank))


def generate_kernel(
    group: FusionGroup, graph: str, outputs: list[torch.fx.Node], views: list[torch.fx.Node]
) -> KernelSpec:
    """The Triton source and call spec of ``group``; ``outputs`` are the members to write."""
    w = KernelWriter(group)
    exact = True
    for node in group.nodes:
        spec = OPS[node.target]
        exact = exact and not spec.transcendental
        w.body.writeline(f"# {_describe(node)}")
        w.values[node] = spec.render(w, node)

    epilogue = IndentedBuffer()
    epilogue.level = 1
    out_specs = []
    for j, node in enumerate(outputs):
        value = node.meta["val"]
        shape = tuple(int(d) for d in value.shape)
        stride = tuple(int(d) for d in value.stride())
        strided = not value.is_contiguous()
        v = w.cast(w.values[node], value.dtype)
        where = f"out{j}_ptr + " + (w._strided(f"out{j}") if strided else "offsets")
        w.coords = w.coords or strided
        epilogue.writeline(f"tl.store({where}, {v.expr}, mask=mask)  # {node.name}")
        out_specs.append(OutputSpec(node.name, value.dtype, shape, stride, strided))

    red_specs = []
    for k, red in enumerate(group.reductions):
        v = w.arg(red.source)  # a member, or an input the group reads anyway
        value = red.node.meta["val"]
        ptr = f"red{k}_ptr"
        epilogue.writeline(f"# {_describe(red.node)}  ({red.kind} of {red.source.name})")
        if red.kind == "histogram":
            epilogue.writeline(f"bins{k} = {v.expr}.to(tl.int32)")
            epilogue.writeline(f"in_range{k} = mask & (bins{k} >= 0) & (bins{k} < {red.bins})")
            epilogue.writeline(f"counts{k} = tl.histogram(bins{k}, {red.bins}, mask=in_range{k})")
            epilogue.writeline(f"tl.atomic_add({ptr} + tl.arange(0, {red.bins}), counts{k}.to(tl.float32))")
            kind = "histogram"
        elif red.kind == "amax":
            epilogue.writeline(f"bits{k} = {v.expr}.to(tl.int32, bitcast=True)")
            epilogue.writeline("# an integer key in the order of the floats; NaN above everything")
            flipped = f"bits{k} ^ ((bits{k} >> 31) & 0x7FFFFFFF)"
            epilogue.writeline(f"key{k} = tl.where({v.expr} != {v.expr}, 0x7FFFFFFF, {flipped})")
            block_max = f"tl.reduce(tl.where(mask, key{k}, -2147483648), 0, {MAX_COMBINE})"
            epilogue.writeline(f"tl.atomic_max({ptr}, {block_max})")
            kind = "amax"
        elif v.dtype == torch.float32:
            block_sum = f"tl.reduce(tl.where(mask, {v.expr}, 0.0), 0, {SUM_COMBINE})"
            epilogue.writeline(f"tl.store({ptr} + pid, {block_sum})  # this program's partial sum")
            kind = "sum_partials"
        else:
            block_sum = f"tl.reduce(tl.where(mask, {v.expr}.to(tl.int64), 0), 0, {SUM_COMBINE})"
            epilogue.writeline(f"tl.atomic_add({ptr}, {block_sum})")
            kind = "sum"
        red_specs.append(
            ReductionSpec(red.node.name, kind, value.dtype, tuple(int(d) for d in value.shape), red.bins)
        )

    source = _assemble(w, group, graph, outputs, views, epilogue, out_specs, red_specs)
    key = code_key(source)
    name = f"lowprec_fused_{key[:12]}"
    return KernelSpec(
        name=name,
        key=key,
        source=source.replace(NAME_PLACEHOLDER, name),
        graph=graph,
        shape=group.shape,
        inputs=w.inputs,
        outputs=out_specs,
        reductions=red_specs,
        ints=w.ints,
        nodes=[n.name for n in group.nodes] + [r.node.name for r in group.reductions],
        exact=exact,
        coords=w.coords,
        device=group.nodes[0].meta["val"].device,
        views=[v.name for v in views],
    )


def _assemble(
    w: KernelWriter,
    group: FusionGroup,
    graph: str,
    outputs: list[torch.fx.Node],
    views: list[torch.fx.Node],
    epilogue: IndentedBuffer,
    out_specs: list[OutputSpec],
    red_specs: list[ReductionSpec],
) -> str:
    buf = IndentedBuffer()
    shape = _shape_text(torch.float32, group.shape).split("[", 1)[1].rstrip("]")
    buf.writeline(f"# {NAME_PLACEHOLDER}: generated by lpcompile.codegen (do not edit)")
    buf.writeline(f"# Graph {graph!r}, iteration shape [{shape}]. Fuses these FX nodes:")
    for node in group.nodes:
        buf.writeline(f"#   {_describe(node)}")
    for red in group.reductions:
        buf.writeline(f"#   {_describe(red.node)}")
        for helper in red.helpers:
            buf.writeline(f"#     (with {_describe(helper)})")
    buf.writeline("# Reads: " + (", ".join(f"in{i} = {s.name}" for i, s in enumerate(w.inputs)) or "nothing"))
    buf.writeline(
        "# Writes: " + (", ".join(f"out{j} = {s.name}" for j, s in enumerate(out_specs)) or "nothing")
    )
    if red_specs:
        buf.writeline(
            "# Reduces: " + ", ".join(f"red{k} = {s.name} ({s.kind})" for k, s in enumerate(red_specs))
        )
    if views:
        buf.writeline("# Views recreated outside the kernel: " + ", ".join(v.name for v in views))
    buf.writeline("import triton")
    buf.writeline("import triton.language as tl")
    for source in w.helpers.values():
        buf.writeline()
        buf.writeline()
        buf.writelines(source.rstrip("\n").split("\n"))
    buf.writeline()
    buf.writeline()
    if w.ints:  # an int argument equal to 1 would become a constexpr, which has no .to()
        names = ", ".join(repr(name) for name, _ in w.ints)
        buf.writeline(f"@triton.jit(do_not_specialize=[{names}])")
    else:
        buf.writeline("@triton.jit")
    buf.writeline(f"def {NAME_PLACEHOLDER}(")
    rank = len(group.shape)
    with buf.indented():
        params = [f"in{i}_ptr" for i in range(len(w.inputs))]
        params += [f"out{j}_ptr" for j in range(len(out_specs))]
        params += [f"red{k}_ptr" for k in range(len(red_specs))]
        params.append("n_elements")
        if w.coords:
            params += [f"size{d}" for d in range(rank)]
            params += [
                f"in{i}_stride{d}" for i, s in enumerate(w.inputs) if s.kind == "strided" for d in range(rank)
            ]
            params += [f"out{j}_stride{d}" for j, s in enumerate(out_specs) if s.strided for d in range(rank)]
        params += [name for name, _ in w.ints]
        for p in params:
            buf.writeline(f"{p},")
        buf.writeline("BLOCK_SIZE: tl.constexpr,")
    buf.writeline("):")
    with buf.indented():
        buf.writeline("pid = tl.program_id(axis=0)")
        buf.writeline("block_start = pid.to(tl.int64) * BLOCK_SIZE  # int64: 2**31+ elements or bytes")
        buf.writeline("offsets = block_start + tl.arange(0, BLOCK_SIZE)")
        buf.writeline("mask = offsets < n_elements")
        if w.coords:
            buf.writeline("# row-major coordinates, for the strided and broadcast tensors")
            buf.writeline("rest = offsets")
            for d in reversed(range(rank)):
                if d == 0:
                    buf.writeline("idx0 = rest")
                else:
                    buf.writeline(f"idx{d} = rest % size{d}")
                    buf.writeline(f"rest = rest // size{d}")
    buf.lines.extend(w.body.lines)
    buf.lines.extend(epilogue.lines)
    return buf.getvalue()


def input_nodes(spec: KernelSpec, graph: torch.fx.Graph) -> list[torch.fx.Node]:
    by_name = {n.name: n for n in graph.nodes}
    return [by_name[s.name] for s in spec.inputs]


__all__ = ["IndentedBuffer", "KernelSpec", "generate_kernel", "code_key", "TL_DTYPES"]
