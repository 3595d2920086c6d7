"""NumPy products in a graph: ``x.numpy() @ w.numpy()``, ``np.einsum(...)``.

Dynamo runs NumPy code on tensors through ``torch._numpy``: each NumPy call is a wrapper
in the graph (of a function, an operator such as ``@``, or an ``ndarray`` method), which
no other pass knows for a product. Where a product's operands are tensors of one float
dtype, :func:`write_numpy_products` writes the call as the torch function that
``torch._numpy`` computes it with, rounded like any other; the others (type promotion,
flattened operands, options torch lacks, ``a @= b`` in place) stay, with a warning.
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
NUMPY_OPERATORS = {operator.matmul: "matmul", operator.imatmul: "imatmul"}  # a @ b, a @= b
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
    """The torch function and arguments ``torch._numpy`` computes ``node`` with, where it
    computes it with one (operands of one dtype, no options but ``einsum``'s ``optimize``)."""
    args, kwargs = node.args, dict(node.kwargs)
    if name == "tensordot":
        axes = kwargs.pop("axes", args[2] if len(args) > 2 else 2)
        if isinstance(axes, list | tuple):  # NumPy's (1, 0) is torch's ([1], [0])
            axes = [[axis] if isinstance(axis, int) else list(axis) for axis in axes]
        return (torch.tensordot, (*args[:2], axes), {}) if not kwargs else None
    if name == "einsum":  # the order of contraction: torch's (opt_einsum's path) from here on
        kwargs.pop("optimize", None)
    if kwargs or name == "imatmul":  # out=, dtype=, ...; an in-place product
        return None
    if name in ("matmul", "einsum", "inner", "outer"):
        return getattr(torch, name), args, {}
    if name == "dot":
        return torch.matmul, args, {}
    if name == "linalg.multi_dot":
        return torch.linalg.multi_dot, args, {}
    return (torch.vdot, args, {}) if ranks == [1, 1] else None  # NumPy flattens vdot's operands


def write_numpy_products(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Write each NumPy product (:func:`numpy_product`) whose operands are tensors of one
    float dtype as the torch call ``torch._numpy`` makes (:func:`_torch_call`); warn about
    the others with float operands, which run unrounded. A product with a number or a 0-d
    array (of one operand besides, for ``einsum``) is a multiplication, left alone."""
    kept = []
    for graph in with_bodies(gm):
        for node in graph.graph.nodes:
            if (name := numpy_product(node)) is None:
                continue
            values = [_example(operand) for operand in _operands(node, name)]
            tensors = [v for v in values if isinstance(v, torch.Tensor)]
            if not any(v.is_floating_point() or v.is_complex() for v in tensors):
                continue  # integer products are exact
            scalars = [v for v in values if not isinstance(v, torch.Tensor) or v.dim() == 0]
            if scalars and (name != "einsum" or len(values) - len(scalars) < 2):
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
