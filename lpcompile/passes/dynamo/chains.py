"""Matrix chains (``linalg.multi_dot``, ``chain_matmul``) as the ``mm`` calls ATen makes.

ATen computes a chain as ``mm`` calls in an order it picks from the shapes, so a chain
can be written out, in that order, as products the quantize pass rounds like any other:
each ``mm``'s operands, the partial products included, and its error. The result is
ATen's, bit for bit, before rounding. Of symbolic sizes, the order is the one ATen
picked for the sizes Dynamo traced with: picking it compared the sizes, so the graph's
guards hold those comparisons (or the sizes themselves) wherever the graph runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from lpcompile.numerics.compat import optimization_hint
from lpcompile.passes.driver import CompileContext
from lpcompile.passes.graph import find_calls, inline, recompile_bodies, replace_with

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
