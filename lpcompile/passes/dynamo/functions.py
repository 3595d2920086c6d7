"""Custom ``torch.autograd.Function`` calls in a Dynamo graph.

Dynamo traces a Function whose forward and backward it can follow into one
``autograd_function_apply(forward, backward, *inputs)`` call of two bodies:

* the forward body takes the inputs and returns ``(outputs, saved)``;
* the backward body takes the outputs' gradients, then the saved tensors, and returns
  one gradient per input.

AOT autograd runs the forward body in the forward graph and the backward body in the
backward graph. These helpers read that structure and pass the bodies lowprec's own
inputs (the step's seed).
"""

from __future__ import annotations

import torch
import torch.fx

from lpcompile.passes.graph import append_input, mark_parameters

FUNCTION_BODY = "lowprec_function_body"  # GraphModule.meta key of a body: (parent, call, phase)
FORWARD, BACKWARD = "forward", "backward"


def function_bodies(gm: torch.fx.GraphModule, call: torch.fx.Node) -> tuple[torch.fx.GraphModule, ...]:
    """The forward and backward bodies of the Function ``call`` of ``gm``, each marked with
    its parent, and their inputs with the parameters they read."""
    forward, backward = (getattr(gm, body.target) for body in call.args[:2])
    forward.meta[FUNCTION_BODY] = (gm, call, FORWARD)
    backward.meta[FUNCTION_BODY] = (gm, call, BACKWARD)
    mark_parameters(zip(forward.graph.find_nodes(op="placeholder"), call.args[2:], strict=False))
    mark_parameters(zip(backward_inputs(forward, backward)[1], saved_values(forward), strict=True))
    return forward, backward


def saved_values(forward: torch.fx.GraphModule) -> list:
    """What the forward body saves for the backward, in the order the backward reads it."""
    (output,) = forward.graph.find_nodes(op="output")
    return list(output.args[0][1])


def backward_inputs(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule
) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """The backward body's inputs: the outputs' gradients, and the saved tensors."""
    inputs = backward.graph.find_nodes(op="placeholder")
    grads = len(inputs) - len(saved_values(forward))
    return inputs[:grads], inputs[grads:]


def from_gradients(backward: torch.fx.GraphModule, grads: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes of the backward body computed from the outputs' gradients (the errors)."""
    found = set(grads)
    for node in backward.graph.nodes:
        if any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def pass_to_forward(
    forward: torch.fx.GraphModule, call: torch.fx.Node, outer: torch.fx.Node
) -> torch.fx.Node:
    """Pass ``outer`` (a node of the caller) to the forward body as a new last input, which
    gets no gradient; the forward body's node for it."""
    inner = append_input(forward, outer.name, outer)
    call.args = (*call.args, outer)
    backward = getattr(call.graph.owning_module, call.args[1].target)
    (output,) = backward.graph.find_nodes(op="output")
    output.args = ((*output.args[0], None),)
    return inner


def pass_to_backward(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, inner: torch.fx.Node
) -> torch.fx.Node:
    """Save ``inner`` (an input of the forward body) for the backward body; the backward
    body's node for it."""
    (output,) = forward.graph.find_nodes(op="output")
    outputs, saved = output.args[0]
    output.args = ((outputs, (*saved, inner)),)
    return append_input(backward, inner.name, inner)
