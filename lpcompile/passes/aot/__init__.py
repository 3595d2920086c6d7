"""Passes over each partitioned AOT graph (forward, backward, inference), in the order
they run (:data:`AOT_PASSES`). The graphs then go to Inductor, or run as FX (the
eager executor, and ``codegen="triton"`` after :mod:`lpcompile.codegen` fused them)."""

from __future__ import annotations

import torch.fx

from lpcompile.passes.aot.annotate import annotate_lowprec_nodes
from lpcompile.passes.aot.histogram import annotate_cond_operands, count_histograms_serially
from lpcompile.passes.aot.layout import (
    realize_transposed_copies,
    remove_permute_pairs,
    use_channels_last_conv_backward,
)
from lpcompile.passes.aot.stages import tag_stages
from lpcompile.passes.driver import CompileContext, Pass
from lpcompile.passes.dynamo.loss_scale import RECORD_UNDER_COND


def runs_as_fx(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """The graph runs as FX: ``executor="eager"``, or ``codegen="triton"``."""
    return ctx.config.executor == "eager" or ctx.config.codegen == "triton"


def goes_to_inductor(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    return not runs_as_fx(gm, ctx, kind)


def staged_fx(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """A pipeline's graph, run as FX (its stages are cut out of it)."""
    return runs_as_fx(gm, ctx, kind) and ctx.config.pipeline is not None


def inductor_backward(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """A backward graph for Inductor (see ``layout.py`` for why not the forward)."""
    return goes_to_inductor(gm, ctx, kind) and kind.startswith("backward")


def records_under_cond(gm: torch.fx.GraphModule, ctx: CompileContext, kind: str) -> bool:
    """A backward for Inductor with adaptive scaling's statistics under ``torch.cond``."""
    under_cond = ctx.adaptive is not None and ctx.adaptive.recording == RECORD_UNDER_COND
    return inductor_backward(gm, ctx, kind) and under_cond


AOT_PASSES = (
    Pass(annotate_lowprec_nodes, runs_as_fx),
    Pass(tag_stages, staged_fx),
    Pass(remove_permute_pairs, goes_to_inductor),
    Pass(use_channels_last_conv_backward, goes_to_inductor),
    Pass(annotate_cond_operands, records_under_cond),
    Pass(count_histograms_serially, goes_to_inductor),
    Pass(realize_transposed_copies, inductor_backward),
)
