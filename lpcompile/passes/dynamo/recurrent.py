"""Recurrent layers in the Dynamo graph: ``torch.lstm`` / ``gru`` / ``rnn_tanh`` /
``rnn_relu`` become their cells, unrolled over the sequence, and the cells
(``nn.LSTMCell``/``GRUCell``/``RNNCell``) their gate products, so that every gate product
is a layer the quantize pass rounds.

Dynamo skips a frame that runs ``nn.LSTM``/``GRU``/``RNN`` unless
``torch._dynamo.config.allow_rnn`` is set (the backend sets it when it is imported);
with it, the recurrent layer is one opaque ATen call. ``decompose_recurrent_layers``
writes that call out with the math of torch's cells: per layer and direction, one
``F.linear`` of the whole sequence with ``weight_ih`` (named ``<module>.weight_ih_l<k>``,
``_reverse`` for the backward direction) and, per time step, one with ``weight_hh``
(``<module>.weight_hh_l<k>#<t>``) and, with ``proj_size``, one with ``weight_hr``
(``<module>.weight_hr_l<k>#<t>``); dropout between layers as torch applies it. A cell
call becomes its two products, ``<module>.weight_ih`` and ``<module>.weight_hh``,
numbered ``#<i>`` in graph order where the module is called several times (once per time
step of a loop). A sequence length Dynamo made symbolic is specialized to the call's (one
graph per length), with a warning naming the module; a data-dependent one is refused.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, guard_int

from lpcompile.passes.driver import CompileContext
from lpcompile.passes.graph import (
    LAYER_NAME,
    dropout_at,
    find_calls,
    inline,
    layer_name,
    recompile_bodies,
    replace_with,
)

# ATen recurrent call -> its cell
RECURRENT = {torch.lstm: "lstm", torch.gru: "gru", torch.rnn_tanh: "tanh", torch.rnn_relu: "relu"}
# ATen cell call -> the cell
CELLS = {
    torch.lstm_cell: "lstm",
    torch.gru_cell: "gru",
    torch.rnn_tanh_cell: "tanh",
    torch.rnn_relu_cell: "relu",
}
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


def _cell_call(cell, input, hx, w_ih, w_hh, b_ih, b_hh, names):
    h, c = (hx[0], hx[1]) if cell == "lstm" else (hx, None)
    gi = _named(F.linear(input, w_ih, b_ih), names[0])
    gh = _named(F.linear(h, w_hh, b_hh), names[1])
    h, c = _cell(cell, gi, gh, h, c)
    return (h, c) if cell == "lstm" else h


def _recurrent(
    cell, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first, steps, path
):
    x = input.transpose(0, 1) if batch_first else input  # (T, N, features)
    directions = 2 if bidirectional else 1
    per = len(params) // (num_layers * directions)
    projected = per == (5 if has_biases else 3)  # LSTM's proj_size: weight_hr after the others
    h0, c0 = (hx[0], hx[1]) if cell == "lstm" else (hx, None)
    last_h, last_c = [], []
    for layer in range(num_layers):
        outputs = []
        for d in range(directions):
            k = layer * directions + d
            w_ih, w_hh = params[k * per], params[k * per + 1]
            b_ih, b_hh = (params[k * per + 2], params[k * per + 3]) if has_biases else (None, None)
            w_hr = params[k * per + per - 1] if projected else None
            suffix = f"_l{layer}" + ("_reverse" if d else "")
            gates_in = _named(F.linear(x, w_ih, b_ih), f"{path}.weight_ih{suffix}")
            h, c = h0[k], (c0[k] if c0 is not None else None)
            ys = [None] * steps
            for t in reversed(range(steps)) if d else range(steps):
                gh = _named(F.linear(h, w_hh, b_hh), f"{path}.weight_hh{suffix}#{t}")
                h, c = _cell(cell, gates_in[t], gh, h, c)
                if w_hr is not None:
                    h = _named(F.linear(h, w_hr), f"{path}.weight_hr{suffix}#{t}")
                ys[t] = h
            outputs.append(torch.stack(ys, 0))
            last_h.append(h)
            last_c.append(c)
        x = torch.cat(outputs, -1) if directions == 2 else outputs[0]
        if train and layer < num_layers - 1:
            x = dropout_at(x, dropout)
    out = x.transpose(0, 1) if batch_first else x
    if cell == "lstm":
        return out, torch.stack(last_h, 0), torch.stack(last_c, 0)
    return out, torch.stack(last_h, 0)


def _specialize_steps(steps: torch.SymInt, path: str) -> int:
    """The number of steps to unroll a symbolic sequence length over: its value in this call,
    which the graph is then specialized to (Dynamo guards on it and compiles a graph per
    length, as it does for torch's own decomposition of the layer)."""
    if free_unbacked_symbols(steps):
        raise NotImplementedError(
            f"lowprec: recurrent layer {path!r} has a data-dependent sequence length, which neither "
            "lowprec nor torch's decomposition can unroll: slice the sequence to a length known "
            "before the model runs"
        )
    warnings.warn(
        f"lowprec: recurrent layer {path!r} has a symbolic sequence length: lowprec unrolls it over "
        "the length of the call, so the graph is specialized to that length and each new length "
        "compiles a graph of its own; past torch._dynamo.config.recompile_limit lengths Dynamo runs the "
        "model uncompiled, in FP32 (fail_on_recompile_limit_hit=True makes that an error)",
        stacklevel=1,
    )
    return guard_int(steps)


def decompose_recurrent_layers(gm: torch.fx.GraphModule, ctx: CompileContext) -> None:
    """Each LSTM/GRU/RNN call (in checkpoint bodies too) becomes its cells, unrolled over its
    sequence length (a symbolic one specialized), and each cell call its gate products."""
    for graph, node in find_calls(gm, RECURRENT):
        cell = RECURRENT[node.target]
        args = dict(zip(PARAMS, node.args, strict=False))
        path = layer_name(node)
        example = args["input"].meta["example_value"]
        steps = example.shape[1 if args["batch_first"] else 0]
        if isinstance(steps, torch.SymInt):
            steps = _specialize_steps(steps, path)
        out = inline(graph, node, _recurrent, {"cell": cell, **args, "steps": steps, "path": path})
        replace_with(node, out)
    calls: dict[tuple[int, str], list[tuple[torch.fx.GraphModule, torch.fx.Node]]] = {}
    for graph, node in find_calls(gm, CELLS):
        calls.setdefault((id(graph), layer_name(node)), []).append((graph, node))
    for (_, path), made in calls.items():
        for i, (graph, node) in enumerate(made):
            suffix = f"#{i}" if len(made) > 1 else ""
            names = (f"{path}.weight_ih{suffix}", f"{path}.weight_hh{suffix}")
            args = dict(zip(("input", "hx", "w_ih", "w_hh", "b_ih", "b_hh"), node.args, strict=False))
            args = {"b_ih": None, "b_hh": None, **args, **node.kwargs}
            out = inline(graph, node, _cell_call, {"cell": CELLS[node.target], **args, "names": names})
            replace_with(node, out)
    recompile_bodies(gm)
