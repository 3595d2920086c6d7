"""Passes over the Dynamo graph, in the order they run (:data:`DYNAMO_PASSES`)."""

from __future__ import annotations

import torch.fx

from lpcompile.passes.driver import CompileContext, Pass
from lpcompile.passes.dynamo.attention import (
    ENCODER_LAYER,
    MHA,
    NATIVE_MHA,
    SDPA,
    decompose_attention,
    decompose_multihead_attention,
)
from lpcompile.passes.dynamo.chains import (
    MATRIX_CHAINS,
    has_einsum_chain,
    is_matrix_power,
    write_einsum_chains,
    write_matrix_chains,
    write_matrix_powers,
)
from lpcompile.passes.dynamo.conv import im2col_applies, use_im2col_convs
from lpcompile.passes.dynamo.loss_scale import insert_loss_scale, loss_scale_applies
from lpcompile.passes.dynamo.numpy_products import has_numpy_products, write_numpy_products
from lpcompile.passes.dynamo.pipeline import insert_predict_weight, remove_pipe_splits, split_stages
from lpcompile.passes.dynamo.quantize import (
    INPLACE_PRODUCTS,
    SPARSE_PRODUCTS,
    aten_overload,
    flatten_einsum_operands,
    forget_body_parents,
    has_bodies,
    insert_quantize,
    write_aten_calls,
    write_dense_sparse_products,
    write_inplace_products,
)
from lpcompile.passes.dynamo.recurrent import CELLS, RECURRENT, decompose_recurrent_layers
from lpcompile.passes.dynamo.regions import has_regions, inline_nested_regions
from lpcompile.passes.dynamo.saturation import counts_saturation, insert_saturation_counts
from lpcompile.passes.graph import find_calls, with_bodies
from lpcompile.passes.stages import is_pipe_split


def rewrites(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """A recipe that quantizes, or a pipeline."""
    return ctx.config.quantizes or ctx.config.pipeline is not None


def has_nested_regions(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return rewrites(gm, ctx, kind) and has_regions(gm)


def has_multihead_attention(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return rewrites(gm, ctx, kind) and bool(find_calls(gm, {MHA, ENCODER_LAYER, NATIVE_MHA}))


def has_recurrent_layers(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return rewrites(gm, ctx, kind) and bool(find_calls(gm, RECURRENT.keys() | CELLS.keys()))


def has_aten_calls(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """A graph that calls ATen's products or views itself (a module ``torch.export`` wrote)."""
    return rewrites(gm, ctx, kind) and any(aten_overload(n) for g in with_bodies(gm) for n in g.graph.nodes)


def has_numpy(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return ctx.config.quantizes and has_numpy_products(gm)


def has_einsum(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return rewrites(gm, ctx, kind) and bool(find_calls(gm, {torch.einsum}))


def has_einsum_chains(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return ctx.config.quantizes and any(has_einsum_chain(call) for _, call in find_calls(gm, {torch.einsum}))


def has_matrix_powers(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return ctx.config.quantizes and any(is_matrix_power(n) for g in with_bodies(gm) for n in g.graph.nodes)


def has_inplace_products(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    nodes = (n for g in with_bodies(gm) for n in g.graph.nodes)
    return ctx.config.quantizes and any(n.op == "call_method" and n.target in INPLACE_PRODUCTS for n in nodes)


def has_sparse_products(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return ctx.config.quantizes and bool(find_calls(gm, SPARSE_PRODUCTS.keys()))


def has_matrix_chains(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return ctx.config.quantizes and bool(find_calls(gm, MATRIX_CHAINS))


def attention_full(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """``attention="full"`` in a graph that calls ``scaled_dot_product_attention``."""
    full = rewrites(gm, ctx, kind) and ctx.config.attention == "full"
    return full and bool(find_calls(gm, {SDPA}))


def pipelined(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return ctx.config.pipeline is not None


def has_stage_markers(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """Under Inductor, which cannot lower ``pipe_split``: a pipeline, or the markers."""
    inductor = ctx.config.executor == "inductor" and ctx.config.codegen != "triton"
    return inductor and (ctx.config.pipeline is not None or any(map(is_pipe_split, gm.graph.nodes)))


DYNAMO_PASSES = (
    Pass(inline_nested_regions, has_nested_regions),
    Pass(write_aten_calls, has_aten_calls),
    Pass(write_numpy_products, has_numpy),
    Pass(flatten_einsum_operands, has_einsum),
    Pass(write_dense_sparse_products, has_sparse_products),
    Pass(write_matrix_chains, has_matrix_chains),
    Pass(write_einsum_chains, has_einsum_chains),
    Pass(write_matrix_powers, has_matrix_powers),
    Pass(write_inplace_products, has_inplace_products),
    Pass(decompose_multihead_attention, has_multihead_attention),
    Pass(decompose_attention, attention_full),
    Pass(decompose_recurrent_layers, has_recurrent_layers),
    Pass(insert_loss_scale, loss_scale_applies),
    Pass(insert_quantize, rewrites),
    Pass(use_im2col_convs, im2col_applies),
    Pass(split_stages, pipelined),
    Pass(insert_predict_weight, pipelined),
    Pass(remove_pipe_splits, has_stage_markers),
    Pass(insert_saturation_counts, counts_saturation),
    Pass(forget_body_parents, has_bodies),
)
