"""NumPy products in a graph: ``x.numpy() @ w.numpy()``, ``np.einsum(...)``.

Dynamo runs NumPy code on tensors through ``torch._numpy``: each NumPy call is a wrapper
in the graph (of a function, an operator such as ``@``, or an ``ndarray`` method), which
no other pass knows for a product. Where a product's operands are tensors of one float
dtype and torch has a function of the same result, :func:`write_numpy_products` writes
the call as that function, rounded like any other; the others keep NumPy's semantics
(type promotion, flattened operands, options torch lacks) and warn.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch
import torch._numpy as tnp
import torch.fx
from torch._dynamo.utils import numpy_method_wrapper, numpy_operator_wrapper, numpy_to_tensor_wrapper

from lpcompile.passes.driver import CompileContext, KeptProduct
from lpcompile.passes.graph import layer_name, recompile_bodies, with_bodies

# NumPy's products, by the function Dynamo runs for them, with their NumPy names
NUMPY_FUNCTIONS = {
    tnp.matmul: "matmul",
    tnp.einsum: "einsum",
    tnp.dot: "dot",
    tnp.inner: "inner",
    tnp.outer: "outer",
    tnp.vdot: "vdot",
    tnp.tensordot: "tensordot",
    tnp.linalg.multi_dot: "linalg.multi_dot",
}
NUMPY_OPERATORS = {operator.matmul: "matmul"}  # a @ b
NUMPY_METHODS = {"dot": "dot"}  # a.dot(b)
KEPT = (
    "a NumPy product that torch writes no other way (operands of different dtypes, "
    "options torch's function lacks, operands NumPy flattens) runs as NumPy computes it, "
    "unrounded; written with torch functions (torch.matmul, torch.einsum, ...) it is rounded"
)


def numpy_product(node: torch.fx.Node) -> str | None:
    """The NumPy name of the product ``node`` calls (``matmul``), if it calls one."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, numpy_to_tensor_wrapper):
        return NUMPY_FUNCTIONS.get(target.f)
    if isinstance(target, numpy_operator_wrapper):
        return NUMPY_OPERATORS.get(target.op)
    if isinstance(target, numpy_method_wrapper):
        return NUMPY_METHODS.get(target.method)
    return None


def _operands(node: torch.fx.Node, name: str) -> list[Any]:
    if name == "linalg.multi_dot":
        return list(node.args[0])
    if name == "einsum":  # the equation first, or operands and their sublists interleaved
        return [a for a in node.args if not isinstance(a, str | list | tuple)]
    return list(node.args[:2])


def _example(operand: Any) -> Any:
    return operand.meta.get("example_value") if isinstance(operand, torch.fx.Node) else operand


def _torch_call(node: torch.fx.Node, name: str, ranks: list[int]) -> tuple[Any, tuple, dict] | None:
    """The torch function and arguments of ``node``'s result, if torch has one."""
    args, kwargs = node.args, dict(node.kwargs)
    if name == "tensordot":
        axes = kwargs.pop("axes", args[2] if len(args) > 2 else 2)
        return (torch.tensordot, (*args[:2], axes), {}) if not kwargs else None
    if kwargs:  # out=, dtype=, optimize=, ...
        return None
    if name in ("matmul", "einsum", "inner"):
        return getattr(torch, name), args, {}
    if name == "linalg.multi_dot":
        return torch.linalg.multi_dot, args, {}
    if name in ("outer", "vdot"):  # NumPy flattens their operands
        return (getattr(torch, name), args, {}) if ranks == [1, 1] else None
    a, b = ranks  # dot: a product over a's last and b's second-to-last dimension
    if b == 1 or max(a, b) <= 2:
        return torch.matmul, args, {}
    return torch.tensordot, (*args, ([a - 1], [b - 2])), {}


def write_numpy_products(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Write each NumPy product (:func:`numpy_product`) whose operands are tensors of one
    float dtype as the torch function of the same result; warn about the others with
    float operands, which run unrounded."""
    kept = []
    for graph in with_bodies(gm):
        for node in graph.graph.nodes:
            if (name := numpy_product(node)) is None:
                continue
            values = [_example(operand) for operand in _operands(node, name)]
            tensors = [v for v in values if isinstance(v, torch.Tensor)]
            if not any(v.is_floating_point() or v.is_complex() for v in tensors):
                continue  # integer products are exact
            if any(v.dim() == 0 for v in tensors):
                continue  # a scalar's: a multiplication
            one_dtype = len(tensors) == len(values) and len({v.dtype for v in tensors}) == 1
            call = _torch_call(node, name, [v.dim() for v in tensors]) if one_dtype else None
            if call is None:
                kept.append(f"numpy.{name} in {layer_name(node)!r}")
                ctx.kept.append(KeptProduct(layer_name(node), f"numpy.{name}", KEPT))
                continue
            node.target, node.args, node.kwargs = call
    recompile_bodies(gm)
    if kept:
        warnings.warn(f"lowprec: {', '.join(kept)}: {KEPT}", stacklevel=1)


def has_numpy_products(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` (or a body in it) calls a NumPy product."""
    return any(numpy_product(n) is not None for g in with_bodies(gm) for n in g.graph.nodes)
