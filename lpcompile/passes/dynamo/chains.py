"""Chains of products as the pairwise products ATen makes of them.

Matrix chains (``linalg.multi_dot``, ``chain_matmul``): ATen computes a chain as ``mm``
calls in an order it picks from the shapes, so a chain can be written out, in that order,
as products the quantize pass rounds like any other: each ``mm``'s operands, the partial
products included, and its error. The result is ATen's, bit for bit, before rounding. Of
symbolic sizes, the order is the one ATen picked for the sizes Dynamo traced with: picking
it compared the sizes, so the graph's guards hold those comparisons (or the sizes
themselves) wherever the graph runs.

A matrix power (``linalg.matrix_power`` of a constant exponent of 2 or more): ATen's
``matmul`` calls, by its binary decomposition of the exponent; of a negative exponent,
those of the inverse (``linalg.inv``, which ATen takes first).

An ``einsum`` of three or more operands: ATen contracts them two at a time, left to
right, or in the order ``opt_einsum`` picks where torch uses it
(``torch.backends.opt_einsum``); each pair becomes an ``einsum`` of two operands, whose
result is the next pair's operand, rounded as an activation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from lpcompile.numerics.compat import optimization_hint
from lpcompile.passes.driver import CompileContext
from lpcompile.passes.graph import find_calls, inline, recompile_bodies, replace_with, with_bodies

MATRIX_CHAINS = {torch.linalg.multi_dot, torch.chain_matmul}


def write_matrix_chains(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Write each matrix chain as ``mm`` calls in ATen's order."""
    for graph, call in find_calls(gm, MATRIX_CHAINS):
        operands = list(call.args[0] if call.target is torch.linalg.multi_dot else call.args)
        if len(operands) < 2:  # chain_matmul of one matrix: a copy
            continue
        values = [operand.meta["example_value"] for operand in operands]
        shapes = [tuple(optimization_hint(size, 1) for size in value.shape) for value in values]
        replace_with(call, inline(graph, call, multiply_chain, {"matrices": operands, "shapes": shapes}))
    recompile_bodies(gm)


def multiply_chain(matrices: list[Any], shapes: list[tuple[int, ...]]) -> Any:
    """``linalg.multi_dot(matrices)`` as ATen computes it: a 1-D first operand is a row, a
    1-D last one a column; two matrices are one ``mm``, three the cheaper of (AB)C and
    A(BC) in multiply-adds ((AB)C on a tie), more the order of least cost by the
    matrix-chain recurrence (of equal costs, the lowest split)."""
    n = len(matrices)
    first, last = len(shapes[0]) == 1, len(shapes[-1]) == 1
    matrices = list(matrices)
    if first:
        matrices[0] = matrices[0].unsqueeze(0)
    if last:
        matrices[-1] = matrices[-1].unsqueeze(-1)
    rows = [1 if first else shapes[0][0], *(shape[0] for shape in shapes[1:])]
    dims = [*rows, 1 if last else shapes[-1][-1]]  # matrix i is dims[i] x dims[i + 1]
    split = _chain_order(dims)

    def product(i: int, j: int) -> Any:
        if i == j:
            return matrices[i]
        return torch.mm(product(i, split[i][j]), product(split[i][j] + 1, j))

    result = product(0, n - 1)
    if first or last:  # back to the operands' dimensions: a vector, or a scalar
        result = result.view([] if first and last else [-1])
    return result


def _chain_order(dims: list[int]) -> list[list[int]]:
    """``split[i][j]``: the last matrix of the left factor of the product of matrices i..j."""
    n = len(dims) - 1
    split = [[i] * n for i in range(n)]  # a product of two: the first matrix, then the second
    if n == 3:
        a, b, c, d = dims
        split[0][2] = 0 if a * c * (b + d) > b * d * (a + c) else 1
        return split
    cost = [[0] * n for _ in range(n)]
    for length in range(1, n):
        for i in range(n - length):
            j = i + length
            costs = [cost[i][k] + cost[k + 1][j] + dims[i] * dims[k + 1] * dims[j + 1] for k in range(i, j)]
            cost[i][j] = min(costs)
            split[i][j] = i + costs.index(cost[i][j])  # the lowest split of least cost
    return split


def has_einsum_chain(call: torch.fx.Node) -> bool:
    """Whether ``call`` (an ``einsum(equation, *operands)``) multiplies three or more operands."""
    return len(call.args) > 3


def write_einsum_chains(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Write each ``einsum`` of three or more operands as ``einsum`` calls of two, in the
    order ATen contracts them."""
    for graph, call in find_calls(gm, {torch.einsum}):
        if not has_einsum_chain(call):
            continue
        equation, *operands = call.args
        shapes = [
            tuple(optimization_hint(size, 1) for size in op.meta["example_value"].shape) for op in operands
        ]
        path = einsum_path(equation, shapes)
        replace_with(
            call,
            inline(graph, call, contract_pairs, {"equation": equation, "operands": operands, "path": path}),
        )
    recompile_bodies(gm)


def einsum_terms(equation: str, count: int) -> tuple[list[str], str]:
    """The subscripts of each of ``count`` operands of ``equation``, and of its output (an
    implicit one: ``...`` if an operand has it, then the letters that appear once, A-Z then
    a-z, as torch orders them)."""
    inputs, arrow, output = equation.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if len(terms) != count:
        raise ValueError(f"einsum equation {equation!r} names {len(terms)} operands, got {count}")
    if not arrow:
        letters = [c for term in terms for c in term if c != "."]
        ellipsis = "..." if any("..." in term for term in terms) else ""
        output = ellipsis + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return terms, output


def einsum_path(equation: str, shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]] | None:
    """The pairs ``opt_einsum`` contracts, as ``torch.einsum`` asks it for them (each pair's
    result goes last); None where torch contracts left to right (``opt_einsum`` missing or
    disabled)."""
    opt_einsum = torch.backends.opt_einsum
    if not (opt_einsum.enabled and opt_einsum.is_available()):
        return None
    path, _ = opt_einsum.get_opt_einsum().contract_path(
        equation, *shapes, optimize=opt_einsum.strategy, shapes=True
    )
    return [tuple(pair) for pair in path]


def contract_pairs(equation: str, operands: list[Any], path: list[tuple[int, ...]] | None) -> Any:
    """``einsum(equation, *operands)`` as ``einsum`` calls of two operands: left to right
    (``path`` None), or along ``path`` (each pair's result goes last, as ATen does). Each
    pair keeps the letters, and the ``...``, that a later operand or the output has."""
    terms, output = einsum_terms(equation, len(operands))
    values = list(operands)
    pairs = (
        path if path is not None else [(0, 1)] + [(len(terms) - 1 - k, 0) for k in range(1, len(terms) - 1)]
    )
    for pair in pairs:
        first, second = pair
        left, right = terms[first], terms[second]
        x, y = values[first], values[second]
        for index in sorted(pair, reverse=True):
            del terms[index], values[index]
        if terms:
            later = "".join(terms) + output
            kept = "".join(dict.fromkeys(c for c in left + right if c != "." and c in later))
            result = ("..." if "..." in left + right and "..." in later else "") + kept
        else:
            result = output
        values.append(torch.einsum(f"{left},{right}->{result}", x, y))
        terms.append(result)
    return values[0]


MATRIX_POWERS = {torch.linalg.matrix_power, torch.matrix_power}


def _matrix_power_args(call: torch.fx.Node) -> tuple[Any, Any] | None:
    """The matrix and the exponent of a matrix power ``call`` (positional or keyword:
    ``input`` and ``n``), or None for another call or one writing into ``out``."""
    if not (call.op == "call_method" and call.target == "matrix_power") and not (
        call.op == "call_function" and call.target in MATRIX_POWERS
    ):
        return None
    if "out" in call.kwargs:
        return None
    named = {"input": 0, "n": 1}
    args = list(call.args) + [None] * (2 - len(call.args))
    for key, value in call.kwargs.items():
        if key in named:
            args[named[key]] = value
    return args[0], args[1]


def is_matrix_power(call: torch.fx.Node) -> bool:
    """Whether ``call`` raises a matrix to a constant power of 2 or more (a product), or a
    negative one (of the inverse)."""
    found = _matrix_power_args(call)
    return found is not None and isinstance(found[1], int) and (found[1] >= 2 or found[1] < 0)


def write_matrix_powers(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Write each matrix power of a constant exponent of 2 or more as ATen's ``matmul``
    calls; of a negative one, of the inverse (``linalg.inv``) as ATen takes it."""
    for graph in with_bodies(gm):
        for call in [node for node in graph.graph.nodes if is_matrix_power(node)]:
            matrix, exponent = _matrix_power_args(call)
            args = {"matrix": matrix, "exponent": exponent}
            replace_with(
                call,
                inline(
                    graph,
                    call,
                    lambda matrix, exponent: raise_matrix(
                        torch.linalg.inv(matrix) if exponent < 0 else matrix, abs(exponent)
                    ),
                    args,
                ),
            )
    recompile_bodies(gm)


def raise_matrix(matrix: Any, exponent: int) -> Any:
    """``linalg.matrix_power(matrix, exponent)``, ``exponent >= 1``, as ATen computes it:
    ``a @ a`` and ``(a @ a) @ a`` for 2 and 3; else from the exponent's lowest bit up, the
    running product times each power of two (``z``, squared at each bit) its bit holds (for
    1, the matrix itself: the inverse a power of -1 takes)."""
    if exponent == 2:
        return torch.matmul(matrix, matrix)
    if exponent == 3:
        return torch.matmul(torch.matmul(matrix, matrix), matrix)
    square, result = None, None
    while exponent > 0:
        bit, exponent = exponent % 2, exponent // 2
        square = matrix if square is None else torch.matmul(square, square)
        if bit:
            result = square if result is None else torch.matmul(result, square)
    return result
