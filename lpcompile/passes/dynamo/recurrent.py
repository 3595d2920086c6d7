"""Recurrent layers in the Dynamo graph: ``torch.lstm`` / ``gru`` / ``rnn_tanh`` /
``rnn_relu`` become their cells, unrolled over the sequence, so that every gate product
is a layer the quantize pass rounds.

Dynamo skips a frame that runs ``nn.LSTM``/``GRU``/``RNN`` unless
``torch._dynamo.config.allow_rnn`` is set (the backend sets it when it is imported);
with it, the recurrent layer is one opaque ATen call. ``decompose_recurrent_layers``
writes that call out with the math of torch's cells: per layer and direction, one
``F.linear`` of the whole sequence with ``weight_ih`` (named ``<module>.weight_ih_l<k>``,
``_reverse`` for the backward direction) and, per time step, one with ``weight_hh``
(``<module>.weight_hh_l<k>#<t>``); dropout between layers as torch applies it.
A sequence length Dynamo made symbolic, or ``proj_size``, leaves the call whole with a
warning naming the module.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx
import torch.nn.functional as F

from lpcompile.passes.driver import CompileContext, KeptProduct
from lpcompile.passes.dynamo.quantize import op_name
from lpcompile.passes.graph import LAYER_NAME, find_calls, inline, layer_name, recompile_bodies, replace_with

# ATen recurrent call -> its cell
RECURRENT = {torch.lstm: "lstm", torch.gru: "gru", torch.rnn_tanh: "tanh", torch.rnn_relu: "relu"}
PARAMS = (
    "input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional", "batch_first",
)  # fmt: skip


def _named(proxy, name: str):
    proxy.node.meta[LAYER_NAME] = name
    return proxy


def _cell(cell: str, gi, gh, h, c):
    """One step of torch's cell from the input's and the hidden state's gate products."""
    if cell == "lstm":
        i, f, g, o = (gi + gh).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if cell == "gru":
        ir, iz, in_ = gi.chunk(3, 1)
        hr, hz, hn = gh.chunk(3, 1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - z) * n + z * h, None
    return (torch.tanh if cell == "tanh" else torch.relu)(gi + gh), None


def _recurrent(
    cell, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first, steps, path
):
    x = input.transpose(0, 1) if batch_first else input  # (T, N, features)
    directions = 2 if bidirectional else 1
    per = 4 if has_biases else 2
    h0, c0 = (hx[0], hx[1]) if cell == "lstm" else (hx, None)
    last_h, last_c = [], []
    for layer in range(num_layers):
        outputs = []
        for d in range(directions):
            k = layer * directions + d
            w_ih, w_hh = params[k * per], params[k * per + 1]
            b_ih, b_hh = (params[k * per + 2], params[k * per + 3]) if has_biases else (None, None)
            suffix = f"_l{layer}" + ("_reverse" if d else "")
            gates_in = _named(F.linear(x, w_ih, b_ih), f"{path}.weight_ih{suffix}")
            h, c = h0[k], (c0[k] if c0 is not None else None)
            ys = [None] * steps
            for t in reversed(range(steps)) if d else range(steps):
                gh = _named(F.linear(h, w_hh, b_hh), f"{path}.weight_hh{suffix}#{t}")
                h, c = _cell(cell, gates_in[t], gh, h, c)
                ys[t] = h
            outputs.append(torch.stack(ys, 0))
            last_h.append(h)
            last_c.append(c)
        x = torch.cat(outputs, -1) if directions == 2 else outputs[0]
        if dropout > 0 and train and layer < num_layers - 1:
            x = F.dropout(x, dropout, training=True)
    out = x.transpose(0, 1) if batch_first else x
    if cell == "lstm":
        return out, torch.stack(last_h, 0), torch.stack(last_c, 0)
    return out, torch.stack(last_h, 0)


def decompose_recurrent_layers(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Each LSTM/GRU/RNN call (in checkpoint bodies too) becomes its cells, unrolled over a
    static sequence length."""
    for graph, node in find_calls(gm, RECURRENT):
        cell = RECURRENT[node.target]
        args = dict(zip(PARAMS, node.args, strict=False))
        path = layer_name(node)
        example = args["input"].meta["example_value"]
        steps = example.shape[1 if args["batch_first"] else 0]
        directions = 2 if args["bidirectional"] else 1
        per = len(args["params"]) // (args["num_layers"] * directions)
        if not isinstance(steps, int) or per != (4 if args["has_biases"] else 2):
            why = "a symbolic sequence length" if not isinstance(steps, int) else "proj_size"
            ctx.kept.append(KeptProduct(path, op_name(node), why))
            warnings.warn(
                f"lowprec: recurrent layer {path!r} has {why}: its gate products stay in higher precision"
                " (give the model a fixed sequence length, compile with dynamic=False)",
                stacklevel=1,
            )
            continue
        out = inline(graph, node, _recurrent, {"cell": cell, **args, "steps": steps, "path": path})
        replace_with(node, out)
    recompile_bodies(gm)
