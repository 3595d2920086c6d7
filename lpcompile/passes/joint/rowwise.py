"""Rowwise and block scaling per matmul (joint graph): each matmul's operands scaled along
the dimension that matmul sums over, as torchao's rowwise float8, MXFP8, NVFP4 and blockwise
FP8 scale them.

A rowwise ``lowprec::quantize`` gives each row of its input's last dimension a factor of
its own, an MX one each block of 32 values of a row, an NVFP4 one each block of 16, a
blockwise one each block of 128 (:func:`lpcompile.numerics.quantize.dynamic_scale`). That suits the forward of
``x @ w.T``, which sums over both operands' last dimension, but the backward's matmuls
read the same tensors along other dimensions: ``grad_x = grad_y @ w`` sums over ``w``'s
rows, ``grad_w = grad_y.T @ x`` over ``x``'s. A factor must be constant along the summed
dimension to come out of each dot product (what an FP8 GEMM with row scales computes), so
:func:`round_operands_per_matmul` gives every matmul its own rounding of each operand:
the tensor the site rounds (before rounding), taken through the views and gathers the
matmul reads it through, rounded with a factor per row of the summed dimension. Each
such rounding is a site of its own (its own random stream), shared by the matmuls that
need the same one; the forward's usually is the site's own node.

Products that are not matmuls (a convolution, a fused attention kernel) read one rounding
of a tensor in both passes, and a row of it is no slice they sum over: they get the
tensorwise counterpart. Other readers (a bias gradient's sum) read the site's node as it is.

The per-matmul options (``weight_for_input_grad``, ``activation_for_weight_grad``,
``error_for_weight_grad``) round a role another way in one matmul of a layer's backward,
whatever the role's scaling: the input gradient's matmul reads the layer's error and
weight sites, the weight gradient's its error and activation sites (a layer with a weight,
the activation multiplied with no other activation of its layer). The matmul reads the
site's tensor unrounded, or rounded with the option's scaling (a site of its own). A layer
whose backward the options reach through no matmul is named in a warning.

With ``wgrad_hadamard``, a layer's weight-gradient matmul (one operand an error site's, the
other an activation site's of the same layer, which has a weight site) reads both operands
transformed along the tokens it sums over before they are rounded: in blocks of 16, each
multiplied by the random signs of :func:`lpcompile.numerics.rng.hadamard_signs` and by the
16 x 16 Hadamard matrix over 4 (orthonormal), as NVIDIA's NVFP4 recipe does. The transform
is the same for both, so it cancels in the product; written as four butterfly steps of
additions, not as a matmul.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._functorch._aot_autograd.fx_utils import get_all_input_and_grad_nodes
from torch._functorch.partitioners import _is_tangent as is_tangent
from torch.fx.experimental.symbolic_shapes import guard_or_false

from lpcompile.config import PER_MATMUL, QuantSpec, per_matmul_option
from lpcompile.numerics.quantize import is_rowwise, per_tensor, scale_arguments
from lpcompile.numerics.rng import HADAMARD_BLOCK, hadamard_signs
from lpcompile.passes.driver import CompileContext, KeptProduct, Site

aten = torch.ops.aten
QUANTIZE = torch.ops.lowprec.quantize.default
CONVERT = torch.ops.prims.convert_element_type.default
# matmuls: target -> (position of an operand, the dimension the matmul sums it over)
MATMULS: dict[object, tuple[tuple[int, int], ...]] = {
    **{op: ((0, -1), (1, -2)) for op in (aten.mm.default, aten.bmm.default, aten._grouped_mm.default)},
    **{op: ((1, -1), (2, -2)) for op in (aten.addmm.default, aten.baddbmm.default)},
    aten.mv.default: ((0, -1), (1, -1)),
    aten.addmv.default: ((1, -1), (2, -1)),
    aten.dot.default: ((0, -1), (1, -1)),
    aten.vdot.default: ((0, -1), (1, -1)),
}
# Other products: they read one rounding of each operand (per tensor here), forward and backward.
FUSED_ATTENTION = (
    *(f"_scaled_dot_product_{kind}_attention" for kind in ("flash", "efficient", "cudnn")),
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention",
    "_efficient_attention",
)
WHOLE_TENSOR_PRODUCTS = {
    aten.convolution.default,
    aten.convolution_backward.default,
    aten._trilinear.default,
    *(
        getattr(aten, name + suffix).default
        for name in FUSED_ATTENTION
        for suffix in ("", "_backward", "_forward")
        if hasattr(aten, name + suffix)
    ),
    torch.ops.higher_order.flex_attention,
    torch.ops.higher_order.flex_attention_backward,
}
# Ops whose output elements are copies of their first argument's (casts: in another dtype,
# autocast's): a matmul reading a rounded tensor through them reads its own rounding of the
# tensor they copy from, taken through them.
COPIES = {
    aten._to_copy.default,
    CONVERT,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.permute.default,
    aten.t.default,
    aten.transpose.int,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.clone.default,
    aten.alias.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.index_select.default,
    aten.index.Tensor,
    aten.embedding.default,
    aten.repeat.default,
}


def rounds_per_matmul(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """Whether some role of the graph's options is scaled per row, or rounded another way in
    one matmul of a layer's backward."""
    config = ctx.config
    scalings = (config.weight.scaling, config.activation.scaling, config.error.scaling)
    return bool(config.per_matmul) or any(is_rowwise(scaling) for scaling in scalings)


def round_operands_per_matmul(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Round each matmul operand that reads a rowwise site along the dimension the matmul
    sums over, each operand of another product per tensor, and the operands the options
    round another way in a layer's input- or weight-gradient matmul as they say (see the
    module's doc). Warns, naming the layer, where a matmul reads a site through an op that
    is no copy, and where the per-matmul options cannot reach a layer's backward."""
    graph = gm.graph
    roundings = _Roundings(gm, ctx)
    layers = _Layers.of(gm, ctx)
    replaced: list[torch.fx.Node] = []  # the site nodes and copies read before
    unfollowed: dict[str, str] = {}  # layer -> the op between its site and a matmul
    untransformed: dict[str, str] = {}  # layer -> why its weight gradient takes no Hadamard transform
    unrounded: dict[tuple[str, str], set[str]] = {}  # (layer, matmul) -> the options leaving operands so
    # layer -> a backward product that is no matmul of one kind, and the kinds it computes
    unresolved: dict[str, tuple[str, set[str]]] = {}
    seen: dict[str, set[str]] = {}  # layer -> the kinds of its backward matmuls told apart

    def note(layer: str, op: str, kinds: Iterable[str] = ("input_grad", "weight_grad")) -> None:
        first, noted = unresolved.get(layer, (op, set()))
        unresolved[layer] = (first, noted | set(kinds))

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in MATMULS:
            operands = [(i, dim) for i, dim in MATMULS[node.target] if i < len(node.args)]
            sources = {i: _site_source(node.args[i], ctx) for i, _ in operands}
            layer, matmul = layers.backward_matmul(sources)
            if matmul:
                seen.setdefault(layer, set()).add(matmul)
            hadamard = (
                ctx.config.wgrad_hadamard
                and matmul == "weight_grad"
                and all(is_rowwise(_scaling(found[0])) for found in sources.values())
                and _transforms(node, operands, layer, untransformed)
            )
            for index, dim in operands:
                if found := sources[index]:
                    role = ctx.sites[found[0].args[5]].role
                    spec = ctx.config.in_matmul(role, matmul)
                    value = roundings.operand(node, *found, dim, spec, matmul, hadamard)
                    if value is not None:
                        replaced += [found[0], *found[1]]
                        node.update_arg(index, value)
                    if spec is not None and not spec.enabled:
                        unrounded.setdefault((layer, matmul), set()).add(per_matmul_option(role, matmul))
                elif found := _read_through(node.args[index], ctx):
                    unfollowed[ctx.sites[found[0].args[5]].layer] = str(found[1].target)
            if matmul is None and not all(sources.values()):
                for site in layers.errors_of_weighted(sources.values()):
                    note(site.layer, str(node.target))
        elif node.target in WHOLE_TENSOR_PRODUCTS:
            for index, operand in enumerate(node.args):
                if not (isinstance(operand, torch.fx.Node) and (found := _site_source(operand, ctx))):
                    continue
                for site in layers.errors_of_weighted([found]):
                    note(site.layer, str(node.target), _gradients_computed(node))
                if is_rowwise(scaling := _scaling(found[0])):
                    replaced += [found[0], *found[1]]
                    node.update_arg(index, roundings.whole(node, *found, per_tensor(scaling)))
        elif ctx.config.per_matmul and (layer := layers.outer_product(node)):
            note(layer, str(node.target), ["weight_grad"])
    for layer in layers.rereading:
        note(layer, "a weight another matmul rounds, read as an activation")
    for node in sorted(set(replaced), key=list(graph.nodes).index, reverse=True):
        if not node.users:
            graph.erase_node(node)
    for (layer, matmul), options in unrounded.items():
        kept = KeptProduct(layer, f"{matmul} matmul", f"{', '.join(sorted(options))}: unrounded")
        if kept not in ctx.kept:  # (each adaptive variant compiles the joint graph again)
            ctx.kept.append(kept)
    if unfollowed:
        found = ", ".join(f"{layer!r} (through {op})" for layer, op in unfollowed.items())
        ctx.warn_from_joint_graph(
            f"lowprec: rowwise scaling: matmuls read the rounding of {found} through an op that"
            " is no view or copy of it: they read its rows along its last dimension, not along"
            " the dimension they sum over"
        )
    if untransformed:
        found = ", ".join(f"{layer!r} ({why})" for layer, why in sorted(untransformed.items()))
        ctx.warn_from_joint_graph(
            f"lowprec: wgrad_hadamard: the operands of the weight gradients of {found} are rounded"
            " without the Hadamard transform"
        )
    unreached = {
        layer: (op, options)
        for layer, (op, kinds) in sorted(unresolved.items())
        if (
            options := [
                o for o in ctx.config.per_matmul if PER_MATMUL[o][1] in layers.unseen(layer, seen) & kinds
            ]
        )
    }
    if unreached:
        found = ", ".join(f"{layer!r} ({op}; {', '.join(o)})" for layer, (op, o) in unreached.items())
        ctx.warn_from_joint_graph(
            f"lowprec: per-matmul options reach no matmul of {found}: its backward computes its"
            " gradients in one call (a convolution, F.bilinear) or as products of elements"
            " (one-row matmuls), or reads an operand through ops other than views and copies (an"
            " im2col convolution's patches), or reads a weight as an activation (a gathered weight"
            " two matmuls share), and reads each operand rounded as its role is"
        )


@dataclass(frozen=True)
class _Layers:
    """What tells a layer's backward matmuls apart: the layers with a weight site, and the
    activation sites a matmul multiplies with another activation of their layer (a custom
    Function's attention scores): those have no weight gradient. (A weight scaled per tile
    is no site in Inductor's joint graph: decomposed, it is not read as one; its layer is
    weighted all the same, by the site the Dynamo pass recorded.)"""

    ctx: CompileContext
    weighted: frozenset[str]
    shared: frozenset[int]  # offsets of activation sites multiplied with another activation
    frozen: frozenset[str]  # layers whose every weight is a graph input that gets no gradient
    # layers without a weight site that round, as an activation, a weight site's rounding
    # or the weight it computes (a weight gathered once and read by two matmuls):
    # the options miss their weight
    rereading: frozenset[str]

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, ctx: CompileContext) -> _Layers:
        weighted = frozenset(site.layer for site in ctx.sites.values() if site.role == "weight")
        shared: set[int] = set()
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in MATMULS:
                sites = _operand_sites(node, ctx)
                if len(sites) == 2 and {site.role for site in sites} == {"activation"} and _one_layer(sites):
                    shared.update(site.offset for site in sites)
        backward = any(map(is_tangent, gm.graph.find_nodes(op="placeholder")))
        gradients = _input_gradients(gm) if backward else {}
        frozen, trained = set(), set()
        # a weight site's rounding, or the weight computed in the graph it rounds -> whether
        # that weight is frozen
        weight_roots: dict[Any, bool] = {}
        readers: dict[Any, set[str]] = {}  # the tensor an activation site rounds -> its layers
        for node in gm.graph.find_nodes(op="call_function", target=QUANTIZE):
            site = ctx.sites.get(node.args[5])
            if site is None:
                continue
            source = _copied_from(node.args[0])
            if site.role == "weight":
                is_frozen = source in gradients and gradients[source] is None
                (frozen if is_frozen else trained).add(site.layer)
                for root in (node, source) if source.op not in ("placeholder", "get_attr") else (node,):
                    weight_roots[root] = weight_roots.get(root, True) and is_frozen
            elif site.role == "activation" and site.layer not in weighted and backward:
                readers.setdefault(source, set()).add(site.layer)
        for root, is_frozen in weight_roots.items():
            for layer in readers.get(root, ()):
                (frozen if is_frozen else trained).add(layer)
        rereading = frozenset(layer for root in weight_roots for layer in readers.get(root, ()))
        return cls(ctx, weighted, frozenset(shared), frozenset(frozen - trained), rereading)

    def unseen(self, layer: str, seen: dict[str, set[str]]) -> set[str]:
        """The matmuls of ``layer``'s backward not told apart (in ``seen``): of the input
        gradient, and of the weight gradient unless its weights are frozen."""
        kinds = {"input_grad"} if layer in self.frozen else {"input_grad", "weight_grad"}
        return kinds - seen.get(layer, set())

    def has_weight_grad(self, activation: Site) -> bool:
        """Whether a layer's error times ``activation`` is the layer's weight gradient."""
        return activation.layer in self.weighted and activation.offset not in self.shared

    def backward_matmul(self, sources: dict[int, tuple | None]) -> tuple[str, str | None]:
        """The layer of a matmul's sites, and which matmul of that layer's backward it is:
        ``"input_grad"`` (its error and weight), ``"weight_grad"`` (its error and activation,
        :meth:`has_weight_grad`) or ``None`` (another)."""
        sites = _sites(sources.values(), self.ctx)
        if len(sites) != 2 or not _one_layer(sites):
            return "", None
        roles = {site.role: site for site in sites}
        if roles.keys() == {"error", "weight"}:
            return sites[0].layer, "input_grad"
        if roles.keys() == {"error", "activation"} and self.has_weight_grad(roles["activation"]):
            return sites[0].layer, "weight_grad"
        return sites[0].layer, None

    def outer_product(self, node: torch.fx.Node) -> str | None:
        """The layer whose error and activation ``node`` (no matmul) reads, where they make
        its weight gradient: computed as products of elements (a batch of one-row matmuls,
        transformers' ``batched_mm`` experts)."""
        operands = [_site_source(arg, self.ctx) for arg in node.args if isinstance(arg, torch.fx.Node)]
        sites = {site.role: site for site in _sites(operands, self.ctx)}
        error, activation = sites.get("error"), sites.get("activation")
        if error and activation and error.layer == activation.layer and self.has_weight_grad(activation):
            return error.layer
        return None

    def errors_of_weighted(self, sources: Iterable) -> list[Site]:
        """The error sites among ``sources`` of layers with a weight."""
        return [
            site for site in _sites(sources, self.ctx) if site.role == "error" and site.layer in self.weighted
        ]


def _input_gradients(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node | None]:
    """Each differentiable input of a joint graph (with a backward) and its gradient output
    (``None``: it gets none, a frozen weight), as AOT autograd's descriptors pair them;
    empty where they do not pair them (tensor subclasses)."""
    try:
        pairs = get_all_input_and_grad_nodes(gm.graph)
    except (RuntimeError, KeyError, AttributeError, AssertionError):
        return {}
    return dict(pairs.values())


def _gradients_computed(node: torch.fx.Node) -> list[str]:
    """The kinds of a layer's backward matmuls a product that is no matmul computes: a
    convolution's backward those its output mask asks for, the others both."""
    if node.target is aten.convolution_backward.default:
        mask = node.args[10]
        return [kind for kind, wanted in zip(("input_grad", "weight_grad"), mask[:2], strict=True) if wanted]
    return ["input_grad", "weight_grad"]


def _copied_from(node: torch.fx.Node) -> torch.fx.Node:
    """The value ``node`` copies through :data:`COPIES` (itself if it is no copy)."""
    while node.op == "call_function" and node.target in COPIES:
        node = node.args[0]
    return node


def _operand_sites(product: torch.fx.Node, ctx: CompileContext) -> list[Site]:
    """The sites a matmul's operands read (through views and copies)."""
    operands = [product.args[i] for i, _ in MATMULS[product.target] if i < len(product.args)]
    return _sites([_site_source(operand, ctx) for operand in operands], ctx)


def _sites(sources: Iterable, ctx: CompileContext) -> list[Site]:
    """The sites of ``sources`` (:func:`_site_source`'s results, ``None`` for none)."""
    return [ctx.sites[source[0].args[5]] for source in sources if source]


def _one_layer(sites: list[Site]) -> bool:
    return sites[0].layer == sites[1].layer


def _scaling(site_node: torch.fx.Node) -> str:
    """The scaling a site node rounds with (its argument: a custom Function's backward may
    round a forward site's tensor with another spec)."""
    return scale_arguments(site_node.args, site_node.kwargs)[1]


def _transforms(
    product: torch.fx.Node, operands: list[tuple[int, int]], layer: str, untransformed: dict[str, str]
) -> bool:
    """Whether ``product``, ``layer``'s weight-gradient matmul, takes the Hadamard transform:
    summed over a multiple of 16 tokens, and no grouped matmul of experts (else noted, with
    why, in ``untransformed``)."""
    if product.target is aten._grouped_mm.default:
        untransformed[layer] = "a grouped matmul of experts: a block of 16 tokens may span two"
        return False
    index, dim = operands[0]
    tokens = product.args[index].meta["val"].shape[dim]
    if not guard_or_false(tokens % HADAMARD_BLOCK == 0):  # (a symbolic length: guarded)
        hint = tokens if isinstance(tokens, int) else tokens.node.hint
        untransformed[layer] = f"{tokens if hint is None else hint} tokens, no multiple of 16"
        return False
    return True


def _read_through(operand: Any, ctx: CompileContext) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """The rowwise site node a matmul operand reads through ops of one tensor input each,
    one of them no copy (:data:`COPIES`), and the first such op from the site; ``None`` if
    it reads none within a few ops."""
    node, blocker = operand, None
    for _ in range(8):
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            return None
        if node.target is QUANTIZE:
            found = is_rowwise(scale_arguments(node.args, node.kwargs)[1]) and node.args[5] in ctx.sites
            return (node, blocker) if found and blocker is not None else None
        if node.target not in COPIES:
            if len(node.all_input_nodes) != 1:
                return None
            blocker = node
        node = node.args[0]
    return None


def _site_source(operand: Any, ctx: CompileContext) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """The site node (one without a given scale) ``operand`` copies its values from, and the
    copying ops from it to ``operand`` (first to last); ``None`` if it reads none."""
    chain = []
    node = operand
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is QUANTIZE:
            scale = scale_arguments(node.args, node.kwargs)[0]
            return (node, chain[::-1]) if scale is None and node.args[5] in ctx.sites else None
        if node.target not in COPIES:
            return None
        chain.append(node)
        node = node.args[0]
    return None


@dataclass
class _Roundings:
    """The roundings (or unrounded tensors) a graph's products read instead of its sites:
    per row or block, per tensor, or as a per-matmul option says; each made once, before the
    first product that reads it."""

    gm: torch.fx.GraphModule
    ctx: CompileContext
    made: dict[tuple, torch.fx.Node] = field(default_factory=dict)

    def operand(
        self,
        product: torch.fx.Node,
        site_node: torch.fx.Node,
        chain: list[torch.fx.Node],
        dim: int,
        spec: QuantSpec | None,
        matmul: str | None,
        hadamard: bool,
    ) -> torch.fx.Node | None:
        """What ``product``, a matmul summing over its operand's dimension ``dim``, reads of the
        site ``site_node`` (through ``chain``): its source unrounded where ``spec`` (the
        options' spec for the site's role in ``matmul``) is off, else rounded with the
        scaling of ``spec`` or of the site, along ``dim`` for a rowwise one
        (:meth:`along`); ``None`` where that is the site's own rounding."""
        if spec is not None and not spec.enabled:
            return self.unrounded(product, site_node, chain)
        scaling = _scaling(site_node) if spec is None else spec.scaling
        matmul = None if spec is None else matmul
        if is_rowwise(scaling):
            return self.along(product, site_node, chain, dim, scaling, matmul, hadamard)
        if scaling == _scaling(site_node):
            return None
        return self.whole(product, site_node, chain, scaling, matmul)

    def along(
        self,
        product: torch.fx.Node,
        site_node: torch.fx.Node,
        chain: list[torch.fx.Node],
        dim: int,
        scaling: str,
        matmul: str | None,
        hadamard: bool,
    ) -> torch.fx.Node:
        """The operand ``site_node`` and ``chain`` give ``product``, rounded with the rowwise
        ``scaling`` along its dimension ``dim`` (a factor per row of it, or per MX block): the
        site's own rounding where that is the site's scaling and last dimension; with
        ``hadamard``, transformed along ``dim`` first (:func:`_hadamard`). ``matmul`` names the
        backward matmul whose option asks for ``scaling``."""
        dim %= _ndim(chain[-1] if chain else site_node)
        own = scaling == _scaling(site_node)
        if own and not hadamard and _source_dim(chain, dim) == _ndim(site_node) - 1:
            return chain[-1] if chain else site_node
        key = (site_node, *chain, dim, scaling, hadamard)
        if key not in self.made:
            graph = self.gm.graph
            with graph.inserting_before(product):
                value = _replay(graph, product, site_node.args[0], chain)
                swap = list(range(_ndim(value)))  # the summed dimension and the last exchanged
                swap[dim], swap[-1] = swap[-1], swap[dim]
                if dim != swap[dim]:
                    value = _call(graph, product, aten.permute.default, (value, swap))
                how = ("rows", *_signature(chain), dim, scaling)
                dtype = value.meta["val"].dtype
                if hadamard:  # in FP32: the sums of 16 values, exact enough to cancel in the product
                    if dtype != torch.float32:
                        value = _call(graph, product, CONVERT, (value, torch.float32))
                    value = _hadamard(graph, product, value, hadamard_signs(self.ctx.config.seed))
                    how += ("hadamard",)
                value = _rounding(graph, self.ctx, product, site_node, value, how, scaling, matmul)
                if value.meta["val"].dtype != dtype:
                    value = _call(graph, product, CONVERT, (value, dtype))
                if dim != swap[dim]:
                    value = _call(graph, product, aten.permute.default, (value, swap))
            self.made[key] = value
        return self.made[key]

    def whole(
        self,
        product: torch.fx.Node,
        site_node: torch.fx.Node,
        chain: list[torch.fx.Node],
        scaling: str,
        matmul: str | None = None,
    ) -> torch.fx.Node:
        """The operand ``site_node`` and ``chain`` give ``product``, its source rounded with
        ``scaling`` (one factor, or a weight's tiles) and taken through ``chain``."""
        key = (site_node, "tensor", scaling, *chain)
        if key not in self.made:
            graph = self.gm.graph
            with graph.inserting_before(product):
                source, how = site_node.args[0], ("tensor", scaling)
                value = _rounding(graph, self.ctx, product, site_node, source, how, scaling, matmul)
                self.made[key] = _replay(graph, product, value, chain)
        return self.made[key]

    def unrounded(
        self, product: torch.fx.Node, site_node: torch.fx.Node, chain: list[torch.fx.Node]
    ) -> torch.fx.Node:
        """The operand ``site_node`` and ``chain`` give ``product``, of its source unrounded."""
        key = (site_node, "unrounded", *chain)
        if key not in self.made:
            with self.gm.graph.inserting_before(product):
                self.made[key] = _replay(self.gm.graph, product, site_node.args[0], chain)
        return self.made[key]


def _hadamard(
    graph: torch.fx.Graph, product: torch.fx.Node, value: torch.fx.Node, signs: list[int]
) -> torch.fx.Node:
    """``value`` (its last dimension a multiple of 16) with each block of 16 values of its
    last dimension multiplied by ``signs``, then by the 16 x 16 Hadamard matrix (Sylvester's
    order) over 4: four butterfly steps of sums and differences. Its sizes may be symbolic."""
    shape = [
        size if isinstance(size, int) else _call(graph, product, aten.sym_size.int, (value, i))
        for i, size in enumerate(value.meta["val"].shape)
    ]
    value = _call(graph, product, aten.clone.default, (value,), {"memory_format": torch.contiguous_format})
    device = value.meta["val"].device
    flips = [i for i, sign in enumerate(signs) if sign < 0]
    value = _call(graph, product, aten.view.default, (value, [-1, HADAMARD_BLOCK]))
    if flips:  # 1 - 2 * (bit i of the flips' mask), from an iota (factories Inductor lowers)
        iota = {"start": 0, "step": 1, "dtype": torch.int64, "device": device, "requires_grad": False}
        index = _call(graph, product, torch.ops.prims.iota.default, (HADAMARD_BLOCK,), iota)
        flipped = _call(graph, product, aten.bitwise_right_shift.Scalar_Tensor, (_mask(flips), index))
        flipped = _call(graph, product, aten.bitwise_and.Scalar, (flipped, 1))
        sign_row = _call(graph, product, aten.mul.Tensor, (flipped, -2))
        sign_row = _call(graph, product, aten.add.Tensor, (sign_row, 1))
        value = _call(graph, product, aten.mul.Tensor, (value, sign_row))
    half = 1
    while half < HADAMARD_BLOCK:  # pairs (j, j + half) in groups of 2 * half
        pairs = _call(graph, product, aten.view.default, (value, [-1, HADAMARD_BLOCK // (2 * half), 2, half]))
        first = _call(graph, product, aten.select.int, (pairs, -2, 0))
        second = _call(graph, product, aten.select.int, (pairs, -2, 1))
        both = [
            _call(graph, product, aten.unsqueeze.default, (_call(graph, product, op, (first, second)), -2))
            for op in (aten.add.Tensor, aten.sub.Tensor)
        ]
        value = _call(graph, product, aten.cat.default, (both, -2))
        value = _call(graph, product, aten.view.default, (value, [-1, HADAMARD_BLOCK]))
        half *= 2
    value = _call(graph, product, aten.mul.Tensor, (value, 1.0 / 4))
    return _call(graph, product, aten.view.default, (value, shape))


def _mask(positions: list[int]) -> int:
    """The int with the bits at ``positions`` set."""
    return sum(1 << i for i in positions)


def _rounding(
    graph: torch.fx.Graph,
    ctx: CompileContext,
    product: torch.fx.Node,
    site_node: torch.fx.Node,
    value: torch.fx.Node,
    how: tuple,
    scaling: str,
    matmul: str | None,
) -> torch.fx.Node:
    """``value`` rounded as ``site_node`` rounds but with ``scaling``, with a site (a random
    stream) of its own, the same for the same ``how`` in every compile of the graph (the
    adaptive variants'). ``how`` says what is rounded, in plain values; ``matmul`` names the
    backward matmul whose option asks for the rounding."""
    site = ctx.sites[site_node.args[5]]
    derived = ctx.derived_sites.get((site.offset, how))
    if derived is None:
        spec = dataclasses.replace(site, offset=ctx.new_offset(), scaling=scaling, matmul=matmul)
        derived = ctx.derived_sites[(site.offset, how)] = ctx.sites[spec.offset] = spec
    fmt, rounding, overflow, seed = site_node.args[1:5]
    args = (value, fmt, rounding, overflow, seed, derived.offset, None, derived.scaling)
    node = _call(graph, product, QUANTIZE, args)
    node.meta["lowprec"] = derived.meta()
    return node


def _replay(
    graph: torch.fx.Graph, product: torch.fx.Node, source: torch.fx.Node, chain: list[torch.fx.Node]
) -> torch.fx.Node:
    """``chain``'s copying ops taken of ``source`` (the site's input) instead of the rounded
    tensor, made contiguous first where the chain reshapes it (a view of the rounded tensor,
    which is contiguous, may not be one of its input)."""
    value = source
    if chain and not source.meta["val"].is_contiguous():
        value = _call(
            graph, product, aten.clone.default, (value,), {"memory_format": torch.contiguous_format}
        )
    for op in chain:
        value = _call(graph, product, op.target, (value, *op.args[1:]), dict(op.kwargs))
    return value


def _call(
    graph: torch.fx.Graph, product: torch.fx.Node, target: Any, args: tuple, kwargs: dict | None = None
) -> torch.fx.Node:
    """A call of ``target`` with ``product``'s metadata (its pass, forward or backward, and
    its recomputation tags), and the value it computes on the example values."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta = {k: v for k, v in product.meta.items() if k not in ("val", "tensor_meta")}
    values = torch.fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    leaves = [*torch.utils._pytree.tree_leaves(values), product.meta["val"]]  # (a factory: the product's)
    fake_mode = next(v.fake_mode for v in leaves if hasattr(v, "fake_mode"))
    with fake_mode:
        node.meta["val"] = target(*values[0], **values[1])
    return node


def _signature(chain: list[torch.fx.Node]) -> tuple:
    """``chain`` in plain values (its ops and their non-tensor arguments), the same in every
    compile of the graph."""
    return tuple((str(op.target), *torch.fx.node.map_arg(op.args[1:], lambda _: "tensor")) for op in chain)


def _ndim(node: torch.fx.Node) -> int:
    return node.meta["val"].dim()


def _source_dim(chain: list[torch.fx.Node], dim: int) -> int | None:
    """The dimension of the chain's source that dimension ``dim`` of its result copies
    along, where that is one dimension of it; else ``None``."""
    for op in reversed(chain):
        source = op.args[0]
        rank_in, rank_out = _ndim(source), _ndim(op)
        dim %= rank_out
        target, args = op.target, op.args
        if target in (aten.clone.default, aten.alias.default, aten._to_copy.default, CONVERT):
            pass
        elif target in (aten.slice.Tensor, aten.index_select.default):
            if args[1] % rank_in == dim:  # a part of each row: rounded with factors of its own
                return None
        elif target is aten.t.default:
            dim = rank_in - 1 - dim
        elif target is aten.transpose.int:
            a, b = args[1] % rank_in, args[2] % rank_in
            dim = b if dim == a else a if dim == b else dim
        elif target is aten.permute.default:
            dim = args[1][dim] % rank_in
        elif target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            in_shape, out_shape = source.meta["val"].shape, op.meta["val"].shape
            if dim != rank_out - 1 or rank_in == 0 or in_shape[-1] != out_shape[-1]:
                return None
            dim = rank_in - 1
        elif target in (aten.expand.default, aten.repeat.default):
            dim -= rank_out - rank_in
            if dim < 0 or source.meta["val"].shape[dim] != op.meta["val"].shape[dim + rank_out - rank_in]:
                return None
        elif target is aten.unsqueeze.default:
            new = args[1] % rank_out
            if dim == new:
                return None
            dim -= dim > new
        elif target is aten.select.int:
            dim += dim >= args[1] % rank_in
        elif target is aten.embedding.default and dim == rank_out - 1:
            dim = rank_in - 1
        else:  # squeeze, index, embedding's gathered dimensions: not followed
            return None
    return dim
