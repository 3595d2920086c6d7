"""Attention in the Dynamo graph, before the quantize pass (option ``attention``).

* ``decompose_multihead_attention``: ``nn.MultiheadAttention`` reaches the graph as one
  opaque ``F.multi_head_attention_forward`` call. It becomes what that function computes:
  the in-projections (``F.linear``, named ``<module>.in_proj_q`` / ``_k`` / ``_v``), the
  attention (``scaled_dot_product_attention``, or with ``need_weights`` the explicit
  ``bmm`` → softmax → ``bmm`` torch runs) and ``<module>.out_proj``, so each product is a
  layer the quantize pass rounds. Unsupported arguments (``bias_k``/``bias_v``,
  ``add_zero_attn``, static keys) leave the call whole, with a warning. Torch's fused
  inference paths (``eval()`` without gradients: ``nn.TransformerEncoderLayer``'s
  ``_transformer_encoder_layer_fwd``, ``nn.MultiheadAttention``'s
  ``_native_multi_head_attention``) first become the module's own path, whose products are
  named as in training (``<layer>.self_attn.in_proj_q``, ``<layer>.linear1``, ...).
* ``decompose_attention`` (``attention="full"``): every ``scaled_dot_product_attention``
  becomes ``matmul`` → mask → softmax (FP32) → dropout → ``matmul``, so the
  probabilities and their gradient are quantized too. Under ``"operands"`` (the default)
  the fused call stays, and the quantize pass rounds Q, K, V and the error entering it.

Both are written as Python over FX proxies (``lpcompile.passes.graph.inline``): the
code reads like the eager function it replaces.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from lpcompile.passes.driver import CompileContext, KeptProduct
from lpcompile.passes.graph import (
    ATTENTION,
    LAYER_NAME,
    dropout_at,
    find_calls,
    inline,
    layer_name,
    module_path,
    qualified_name,
    recompile_bodies,
    replace_with,
)

SDPA = F.scaled_dot_product_attention
MHA = F.multi_head_attention_forward
# torch's fused inference paths of nn.TransformerEncoderLayer and nn.MultiheadAttention
ENCODER_LAYER = torch._transformer_encoder_layer_fwd
NATIVE_MHA = torch._native_multi_head_attention
ENCODER_LAYER_PARAMS = (
    "src", "embed_dim", "num_heads", "in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias",
    "use_gelu", "norm_first", "eps", "norm1_weight", "norm1_bias", "norm2_weight", "norm2_bias",
    "linear1_weight", "linear1_bias", "linear2_weight", "linear2_bias", "mask", "mask_type",
)  # fmt: skip
NATIVE_MHA_PARAMS = (
    "query", "key", "value", "embed_dim", "num_heads", "in_proj_weight", "in_proj_bias", "out_proj_weight",
    "out_proj_bias", "mask", "need_weights", "average_attn_weights", "mask_type",
)  # fmt: skip
NATIVE_MHA_DEFAULTS = {"mask": None, "need_weights": True, "average_attn_weights": True, "mask_type": None}
# F.multi_head_attention_forward's parameters, in order, and their defaults
_MHA_SIGNATURE = inspect.signature(MHA).parameters
MHA_PARAMS = tuple(_MHA_SIGNATURE)
MHA_DEFAULTS = {
    name: p.default for name, p in _MHA_SIGNATURE.items() if p.default is not inspect.Parameter.empty
}
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _arguments(node: torch.fx.Node, params: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
    return {**defaults, **dict(zip(params, node.args, strict=False)), **node.kwargs}


def _mha(
    query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, dropout_p,
    out_proj_weight, out_proj_bias, training, key_padding_mask, need_weights, attn_mask,
    use_separate_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight, average_attn_weights,
    is_causal, batched, dtype, mask_dims, names,
):  # fmt: skip
    """``F.multi_head_attention_forward`` over proxies, for the arguments it supports."""
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.size(0), query.size(1), query.size(2)
    src_len = key.size(0)
    head_dim = embed_dim_to_check // num_heads
    key_padding_mask = _additive(key_padding_mask, dtype)
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = _additive(attn_mask, dtype)
        if key_padding_mask is not None:
            is_causal = False
    if use_separate_proj_weight:
        weights = (q_proj_weight, k_proj_weight, v_proj_weight)
    else:
        weights = tuple(
            torch.narrow(in_proj_weight, 0, i * embed_dim_to_check, embed_dim_to_check) for i in range(3)
        )
    if in_proj_bias is None:
        biases = (None, None, None)
    else:
        biases = tuple(
            torch.narrow(in_proj_bias, 0, i * embed_dim_to_check, embed_dim_to_check) for i in range(3)
        )
    q, k, v = (
        _named(F.linear(x, w, b), name)
        for x, w, b, name in zip((query, key, value), weights, biases, names[:3], strict=True)
    )
    if attn_mask is not None and mask_dims == 2:
        attn_mask = attn_mask.unsqueeze(0)
    q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.view(src_len, bsz * num_heads, head_dim).transpose(0, 1)
    v = v.view(src_len, bsz * num_heads, head_dim).transpose(0, 1)
    if key_padding_mask is not None:
        key_padding_mask = (
            key_padding_mask.view(bsz, 1, 1, src_len)
            .expand(-1, num_heads, -1, -1)
            .reshape(bsz * num_heads, 1, src_len)
        )
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    if not training:
        dropout_p = 0.0
    if need_weights:
        q_scaled = q * math.sqrt(1.0 / float(head_dim))
        if attn_mask is not None:
            weights = _named(torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1)), names[3] + "#0", True)
        else:
            weights = _named(torch.bmm(q_scaled, k.transpose(-2, -1)), names[3] + "#0", True)
        weights = dropout_at(torch.softmax(weights, dim=-1), dropout_p)
        out = _named(torch.bmm(weights, v), names[3] + "#1", True)
        out = out.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
    else:
        if attn_mask is not None and mask_dims == 2 and key_padding_mask is None:
            attn_mask = attn_mask.unsqueeze(0)  # (1, L, S) -> (1, 1, L, S)
        elif attn_mask is not None:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
        q = q.view(bsz, num_heads, tgt_len, head_dim)
        k = k.view(bsz, num_heads, src_len, head_dim)
        v = v.view(bsz, num_heads, src_len, head_dim)
        out = _named(F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal), names[3])
        out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    out = _named(F.linear(out, out_proj_weight, out_proj_bias), names[4])
    out = out.view(tgt_len, bsz, embed_dim)
    if need_weights:
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        weights = None
    if not batched:
        out = out.squeeze(1)
        weights = None if weights is None else weights.squeeze(0)
    return out, weights


def _named(proxy, name: str, attention: bool = False):
    proxy.node.meta[LAYER_NAME] = name
    if attention:
        proxy.node.meta[ATTENTION] = True
    return proxy


def _additive(mask, dtype: torch.dtype):
    """A boolean mask (True: not allowed, as nn.MultiheadAttention reads it) as an additive one."""
    if mask is None or mask.node.meta["example_value"].dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill(mask, float("-inf"))


def _batch_first_attention(
    query, key, value, embed_dim, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
    mask, need_weights, average_attn_weights, mask_type, name,
):  # fmt: skip
    """``torch._native_multi_head_attention`` (batch-first inputs; a mask merged by
    ``nn.MultiheadAttention.merge_masks``) as the ``F.multi_head_attention_forward`` call
    ``nn.MultiheadAttention`` makes outside its fast path."""
    attn_mask, key_padding_mask = None, None
    if mask_type == 1:
        key_padding_mask = mask
    elif mask is not None:  # (N, H, L, S) -> (N * H, L, S)
        attn_mask = mask.flatten(0, 1) if mask_type == 2 else mask
    result = MHA(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), embed_dim, num_heads,
        in_proj_weight, in_proj_bias, None, None, False, 0.0, out_proj_weight, out_proj_bias,
        training=False, key_padding_mask=key_padding_mask, need_weights=need_weights,
        attn_mask=attn_mask, average_attn_weights=average_attn_weights,
    )  # fmt: skip
    if name is not None:  # else named as the module's own F.multi_head_attention_forward call
        result.node.meta[LAYER_NAME] = name
    return result[0].transpose(0, 1), result[1] if need_weights else None


def _encoder_layer(
    src, embed_dim, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias, use_gelu,
    norm_first, eps, norm1_weight, norm1_bias, norm2_weight, norm2_bias, linear1_weight, linear1_bias,
    linear2_weight, linear2_bias, mask, mask_type, path,
):  # fmt: skip
    """``torch._transformer_encoder_layer_fwd`` as ``nn.TransformerEncoderLayer`` computes it
    outside its fast path (no dropout: the fast path runs in ``eval()`` only)."""

    def attention(x):
        projections = (in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias)
        args = (x, x, x, embed_dim, num_heads, *projections, mask, False, True, mask_type)
        return _batch_first_attention(*args, qualified_name(path, "self_attn"))[0]

    def feed_forward(x):
        h = _named(F.linear(x, linear1_weight, linear1_bias), qualified_name(path, "linear1"))
        h = F.gelu(h) if use_gelu else F.relu(h)
        return _named(F.linear(h, linear2_weight, linear2_bias), qualified_name(path, "linear2"))

    shape = (embed_dim,)
    x = src
    if norm_first:
        x = x + attention(F.layer_norm(x, shape, norm1_weight, norm1_bias, eps))
        return x + feed_forward(F.layer_norm(x, shape, norm2_weight, norm2_bias, eps))
    x = F.layer_norm(x + attention(x), shape, norm1_weight, norm1_bias, eps)
    return F.layer_norm(x + feed_forward(x), shape, norm2_weight, norm2_bias, eps)


def restore_module_paths(gm: torch.fx.GraphModule) -> None:
    """Torch's fused inference paths of encoder layers and multi-head attention (in
    checkpoint bodies too) become the modules' own paths."""
    for graph, node in find_calls(gm, {ENCODER_LAYER}):
        args = _arguments(node, ENCODER_LAYER_PARAMS, {})
        replace_with(node, inline(graph, node, _encoder_layer, {**args, "path": module_path(node)}))
    for graph, node in find_calls(gm, {NATIVE_MHA}):
        args = _arguments(node, NATIVE_MHA_PARAMS, NATIVE_MHA_DEFAULTS)
        replace_with(node, inline(graph, node, _batch_first_attention, {**args, "name": None}))


# the layer names of an nn.MultiheadAttention's calls, after the module's
MULTIHEAD_CALLS = ("in_proj_q", "in_proj_k", "in_proj_v", "attention", "out_proj")
UNSUPPORTED_MHA = ("bias_k", "bias_v", "static_k", "static_v")


def decompose_multihead_attention(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Each ``F.multi_head_attention_forward`` call (in checkpoint bodies too) becomes its
    projections and attention; torch's fused inference paths first become such calls."""
    restore_module_paths(gm)
    for graph, node in find_calls(gm, {MHA}):
        args = _arguments(node, MHA_PARAMS, MHA_DEFAULTS)
        path = layer_name(node)
        unsupported = [name for name in UNSUPPORTED_MHA if args[name] is not None]
        if args["add_zero_attn"]:
            unsupported.append("add_zero_attn")
        if unsupported:
            ctx.kept.append(KeptProduct(path, "multi_head_attention_forward", f"unsupported {unsupported}"))
            warnings.warn(
                f"lowprec: nn.MultiheadAttention {path!r} with {unsupported} stays in higher precision",
                stacklevel=1,
            )
            continue
        query = node.args[0] if node.args else node.kwargs["query"]
        example = query.meta["example_value"]
        for name in (*UNSUPPORTED_MHA, "add_zero_attn"):
            args.pop(name, None)
        names = tuple(f"{path}.{call}" for call in MULTIHEAD_CALLS)
        out = inline(
            graph,
            node,
            _mha,
            {
                **args,
                "batched": example.dim() == 3,
                "dtype": example.dtype,
                "mask_dims": None
                if args["attn_mask"] is None
                else args["attn_mask"].meta["example_value"].dim(),
                "names": names,
            },
        )
        replace_with(node, out)
    recompile_bodies(gm)


def _explicit_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, name):
    """``scaled_dot_product_attention`` as matmul → mask → softmax → dropout → matmul."""
    scale = query.size(-1) ** -0.5 if scale is None else scale
    if enable_gqa:
        repeats = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(repeats, -3)
        value = value.repeat_interleave(repeats, -3)
    scores = _named(torch.matmul(query, key.transpose(-2, -1)), f"{name}#0", True) * scale
    if is_causal:
        allowed = torch.ones_like(scores, dtype=torch.bool).tril()  # tril: the last two dimensions
        scores = scores.masked_fill(allowed.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.node.meta["example_value"].dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    # a query that sees no key attends to nothing (zeros, not NaN), as torch's SDPA does
    probs = dropout_at(torch.ops.aten._safe_softmax.default(scores, -1), dropout_p)
    return _named(torch.matmul(probs, value), f"{name}#1", True)


def decompose_attention(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """``attention="full"``: each ``scaled_dot_product_attention`` (in checkpoint bodies too)
    becomes explicit matmuls."""
    for graph, node in find_calls(gm, {SDPA}):
        args = _arguments(node, SDPA_PARAMS, SDPA_DEFAULTS)
        out = inline(graph, node, _explicit_attention, {**args, "name": layer_name(node)})
        replace_with(node, out)
    recompile_bodies(gm)
