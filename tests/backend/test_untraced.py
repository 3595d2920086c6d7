"""What torch.compile does not trace on its own, under lowprec. A root ``forward`` with a
graph break inside its loop over layers runs uncompiled, and Dynamo skips the ``torch.nn``
layers it calls: for lowprec (only), a module with products reached that way is traced,
so its products run in FP8. What still runs outside every lowprec graph (the root's own
product, a layer called through ``torch._dynamo.disable``) is named once, after the first
forward; a model whose products all compiled is quiet."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from grid import GridCheck, watched_backend
from models import Records
from torch import nn

import lpcompile
from lpcompile.backend import lowprec
from lpcompile.backend.distributed import LOWPREC_BACKEND
from lpcompile.backend.watch import sparse_tensors
from lpcompile.runtime.pipeline import capture_graph

EAGER_SR = {"recipe": "fp8-e5m2-sr", "executor": "eager"}


class LoopBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.w = nn.Parameter(torch.randn(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
            torch._dynamo.graph_break()  # Dynamo gives up on the whole frame
        return x @ self.w


@torch._dynamo.disable
def _eager(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


class Disabled(nn.Module):
    def __init__(self, disable_head: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.disable_head = disable_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.embed(x))
        return _eager(self.head, x) if self.disable_head else self.head(x)


class PerBlock(nn.Module):
    """Compiled block by block, the head too: the blocks of two copies share graphs."""

    def __init__(self, outputs: int) -> None:
        super().__init__()
        blocks = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)]
        self.layers = nn.ModuleList(torch.compile(b, backend="lowprec", options=EAGER_SR) for b in blocks)
        self.head = torch.compile(nn.Linear(8, outputs), backend="lowprec", options=EAGER_SR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _steps(run: nn.Module) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            run(torch.randn(4, 8)).sum().backward()
    return [str(w.message) for w in caught if "no lowprec graph read" in str(w.message)]


def test_layers_a_skipped_root_calls_run_on_the_grid_and_its_own_product_is_named():
    torch._dynamo.reset()
    check = GridCheck()
    run = torch.compile(LoopBreak(), backend=watched_backend(EAGER_SR, check))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = run(torch.randn(4, 8)).sum()
    with check:
        loss.backward()
    first = dict(check.products)
    # the warning comes at the end of the second forward: torch.compile's wrapper had no
    # hooks when the first began, so that call runs none
    found = [str(w.message) for w in caught if "no lowprec graph read" in str(w.message)] + _steps(run)
    # forward: the three layers' products (the mode sees compiled graphs only, not the
    # root's x @ w); backward: each layer's weight gradient and all but the first one's
    # input gradient on the grid, the root's two gradient products off it
    assert first == {("addmm.default", True): 3, ("mm.default", True): 5, ("mm.default", False): 2}
    assert len(found) == 1 and "the parameters of (the root) (LoopBreak: w) while LoopBreak ran:" in found[0]


class Unsqueeze(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(self.dim) if self.dim >= 0 else x.squeeze(-self.dim)


class MixedLoopBreak(nn.Module):
    """A graph break in its loop over layers of different classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            [nn.Linear(8, 8), Unsqueeze(1), nn.Conv1d(1, 2, 3, padding=1), nn.Flatten()]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            torch._dynamo.graph_break()
        return x


def _coverage_names(model: nn.Module) -> list[str]:
    torch._dynamo.reset()
    _steps(torch.compile(model, backend="lowprec", options=EAGER_SR))
    return [row.layer for row in lpcompile.coverage(model)]


def test_layers_compiled_as_frames_of_their_own_are_named_as_modules():
    """Where Dynamo gives up on the root's forward, each layer compiles as a frame of its
    own, its product its own: named as in ``named_modules()``, whether identical layers
    share one graph (named relative to each) or each class occurs once."""
    for model, expected in [
        (LoopBreak(), ["layers.0", "layers.1", "layers.2"]),
        (MixedLoopBreak(), ["layers.0", "layers.2"]),
    ]:
        names = _coverage_names(model)
        assert names == expected and set(names) <= dict(model.named_modules()).keys()


def test_other_backends_still_skip_those_layers():
    graphs = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(LoopBreak(), backend=counting)(torch.randn(4, 8)).sum().backward()
    assert graphs == []


def test_a_layer_run_through_dynamo_disable_is_named_once():
    torch._dynamo.reset()
    found = _steps(torch.compile(Disabled(disable_head=True), backend="lowprec", options=EAGER_SR))
    assert len(found) == 1
    assert "the parameters of head (Linear: weight) while Disabled ran:" in found[0]
    torch._dynamo.reset()
    assert _steps(torch.compile(Disabled(disable_head=False), backend="lowprec", options=EAGER_SR)) == []


class CheckpointBreak(nn.Module):
    """A forward that is only a checkpoint call, whose body breaks the graph: Dynamo runs
    the checkpoint uncompiled and compiles no graph at all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)


def test_a_model_that_compiles_no_graph_is_named():
    """No lowprec graph ever runs, so the backend is never called: the watch starts when
    Dynamo begins compiling the frame for lowprec (after torch._dynamo.reset() too)."""
    for _ in range(2):
        torch._dynamo.reset()
        model = CheckpointBreak()
        found = _steps(torch.compile(model, backend="lowprec", options=EAGER_SR))
        assert len(found) == 1
        assert "of a (Linear: weight), b (Linear: weight) while CheckpointBreak ran" in found[0]
        assert not lpcompile.coverage(model)
    torch._dynamo.reset()
    assert _steps(torch.compile(CheckpointBreak(), backend="inductor")) == []


def test_models_that_share_graphs_or_copy_a_watched_root_are_quiet():
    torch._dynamo.reset()
    first = PerBlock(outputs=4)
    found = _steps(first)
    # the second model's blocks run on the first one's graphs; only its head compiles
    found += _steps(PerBlock(outputs=3))
    watched = PerBlock(outputs=2)
    watched(torch.randn(4, 8)).sum().backward()  # the head's compile hooks the root
    found += _steps(copy.deepcopy(watched))  # the hook came along, the watch did not
    assert found == [] and _steps(watched) == []


class Holder(nn.Module):
    """Holds a compiled model: ``named_modules()`` names its layers through ``_orig_mod``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.compile(Disabled(disable_head=True), backend="lowprec", options=EAGER_SR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_model_compiled_in_place_is_watched_and_warned_at_the_callers_line():
    torch._dynamo.reset()
    model = Disabled(disable_head=True)
    model.compile(backend="lowprec", options=EAGER_SR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
    found = [w for w in caught if "no lowprec graph read" in str(w.message)]
    assert len(found) == 1 and "the parameters of head (Linear: weight) while Disabled ran:" in str(
        found[0].message
    )
    assert found[0].filename == __file__  # the model(...) line above, not torch's or lpcompile's
    torch._dynamo.reset()
    quiet = Disabled(disable_head=False)
    quiet.compile(backend="lowprec", options=EAGER_SR)
    assert _steps(quiet) == []


def test_layers_of_a_compiled_submodule_are_named_without_orig_mod():
    torch._dynamo.reset()
    found = _steps(Holder())
    assert len(found) == 1 and "the parameters of inner.head (Linear: weight) while Holder ran:" in found[0]


class Broken(nn.Module):
    """A graph break inside its forward: Dynamo compiles it as a frame of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        torch._dynamo.graph_break()
        return self.down(h)


class Nested(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8)
        self.body = nn.Sequential(*[Broken() for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.relu(self.embed(x)))


def _layers(model: nn.Module) -> set[str]:
    torch._dynamo.reset()
    records = Records()
    torch.compile(model, backend="lowprec", options=EAGER_SR)(torch.randn(4, 8)).sum().backward()
    return {s.layer for r in records.new for s in r.sites.values()}


def test_a_frame_compiled_after_a_graph_break_names_its_layers_from_the_model():
    """The graph of the frame Dynamo compiled apart starts at ``body.0``: its layers are
    named from the model's root. Where the model has several modules of that class, one
    graph may run for each of them, and its names stay relative to the module."""
    model = Nested(blocks=1)
    assert _layers(model) == {"embed", "body.0.up", "body.0.down"}
    assert {"body.0.up", "body.0.down"} <= {name for name, _ in model.named_modules()}
    assert _layers(Nested(blocks=2)) == {"embed", "up", "down"}


class Stacked(nn.Module):
    """``self.head(self.decoder(self.encoder(x)))`` with a graph break in the encoder: the
    frame that resumes the model's ``forward`` holds the head and the decoder as Dynamo's
    stack temporaries (``___stack0``, ``___stack1``), not as attributes of ``self``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Broken()
        self.decoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(self.encoder(x)))


def test_modules_a_resumed_frame_holds_as_stack_temporaries_are_named_from_the_model():
    """They were named from each temporary (the head ``weight``, the decoder's layers ``0``
    and ``2``), and ``exclude=["head"]`` matched nothing."""
    model = Stacked()
    assert _layers(model) == {"encoder.up", "encoder.down", "decoder.0", "decoder.2", "head"}
    torch._dynamo.reset()
    options = {**EAGER_SR, "exclude": ["head"]}
    torch.compile(model, backend="lowprec", options=options)(torch.randn(4, 8)).sum().backward()
    kept = [(row.layer, row.kept) for row in lpcompile.coverage(model) if row.kept]
    assert kept == [("head", "exclude")]


def test_blocks_whose_resumed_frames_hold_stack_temporaries_are_told_apart():
    """Two such blocks run one resumed graph, named relative to the block; each block's
    layers are reported under it (all were the first block's)."""
    model = nn.Sequential(Stacked(), Stacked())
    assert _layers(model) == {"up", "down", "decoder.0", "decoder.2", "head"}  # each frame's, relative
    names = ("encoder.up", "encoder.down", "decoder.0", "decoder.2", "head")
    assert {row.layer for row in lpcompile.coverage(model)} == {f"{i}.{name}" for i in "01" for name in names}


class TiedEncoder(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed, self.layer = embed, nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        torch._dynamo.graph_break()
        return torch.relu(self.layer(h))


class TiedSeq2Seq(nn.Module):
    """An encoder-decoder sharing its embedding with the encoder, the decoder and the head,
    with a graph break in the encoder after its lookup (HF's LED, Switch Transformers): the
    tied weight is the first parameter of the encoder's first frame and of the model's
    resumed one, which also runs the decoder and the head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Embedding(16, 8)
        self.encoder = TiedEncoder(self.shared)
        self.decoder = nn.Module()
        self.decoder.embed, self.decoder.layer = self.shared, nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(ids)
        return self.head(torch.relu(self.decoder.layer(self.decoder.embed(ids) + memory)))


class TiedStack(nn.Module):
    """A stack reading the tied embedding as its own ``embed``, with a graph break after
    its first layer (T5's and Switch Transformers' encoder and decoder stacks, a decoder's
    taking the encoder's output: Dynamo compiles a graph for each)."""

    def __init__(self, embed: nn.Embedding, decoder: bool) -> None:
        super().__init__()
        self.embed, self.layer, self.decoder = embed, nn.Linear(8, 8), decoder

    def forward(self, ids: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = self.layer(self.embed(ids) + memory if self.decoder else self.embed(ids))
        torch._dynamo.graph_break()
        return torch.relu(h)


class TiedStacks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Embedding(16, 8)
        self.encoder, self.decoder = TiedStack(self.shared, False), TiedStack(self.shared, True)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.decoder(ids, self.encoder(ids))
        return self.head(h)


@pytest.mark.parametrize("model", [TiedSeq2Seq, TiedStacks], ids=["seq2seq", "stacks"])
def test_the_frames_of_a_weight_tied_across_modules_are_named_from_the_model(model):
    """Each frame whose first parameter is the tied weight is placed by its own module: the
    decoder and the head were named under the encoder (``encoder.decoder.layer``), whose
    frame read the weight first; two stacks of one class, each reading it as its own
    ``embed``, are told apart by which of them runs."""
    model = model()
    torch._dynamo.reset()
    options = {**EAGER_SR, "saturation": "count"}
    run = torch.compile(model, backend="lowprec", options=options)
    run(torch.randint(0, 16, (4, 6))).sum().backward()
    expected = {"encoder.layer", "decoder.layer", "head"}
    assert {row.layer for row in lpcompile.coverage(model)} == expected
    assert {row.layer for row in lpcompile.saturation(model)} == expected
    assert expected <= {name for name, _ in model.named_modules(remove_duplicate=False)}


class Recompute(torch.autograd.Function):
    """A reversible layer's pattern: the backward recomputes the forward and backpropagates
    through it, which Dynamo cannot trace, so it runs the Function uncompiled."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        ctx.layer = layer
        ctx.save_for_backward(x)
        return layer(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            torch.autograd.backward(ctx.layer(x), grad)
        return x.grad, None


class Reversible(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(Recompute.apply(x, self.inner))


def test_a_function_run_uncompiled_is_named_once():
    """Its forward's layer compiles (rounded); its backward recomputes in higher precision,
    off the grid (tests/grid.py): one warning names the Function."""
    check = GridCheck()
    torch._dynamo.reset()
    run = torch.compile(Reversible(), backend=watched_backend(EAGER_SR, check))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            loss = run(torch.randn(4, 8, requires_grad=True)).sum()
            with check:  # (the compiled calls enter it themselves)
                loss.backward()
    found = [str(w.message) for w in caught if "torch.autograd.Function" in str(w.message)]
    assert len(found) == 1 and "Recompute is a torch.autograd.Function" in found[0], found
    assert check.off_grid, check.products  # the backward's recomputation
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        torch.compile(Nested(blocks=1), backend="lowprec", options=EAGER_SR)(torch.randn(4, 8))
    assert not [w for w in caught if "torch.autograd.Function" in str(w.message)]


class GraphConvolution(nn.Module):
    """Two graph convolutions, ``adj @ (x W)``, the adjacency an argument or a buffer."""

    def __init__(self, adj: torch.Tensor | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 4)
        if adj is not None:
            self.register_buffer("adj", adj)

    def forward(self, x: torch.Tensor, adj: torch.Tensor | None = None) -> torch.Tensor:
        adj = self.adj if adj is None else adj
        return torch.sparse.mm(adj, self.lin2(torch.relu(torch.sparse.mm(adj, self.lin1(x)))))


def _sparse_warnings(model: nn.Module, **kwargs: torch.Tensor) -> list[str]:
    torch._dynamo.reset()
    run = torch.compile(model, backend="lowprec", options=EAGER_SR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            run(torch.randn(10, 8), **kwargs).sum().backward()
    return [str(w.message) for w in caught if "sparse tensors" in str(w.message)]


def test_sparse_tensors_a_model_runs_with_are_named_once():
    """Dynamo does not trace a sparse tensor: the forward that multiplies by the sparse
    adjacency runs uncompiled (its layers compile as frames of their own), those products
    in FP32. One warning names the tensor, passed or held; a dense adjacency is quiet."""
    g = torch.Generator().manual_seed(0)
    adj = torch.sparse_coo_tensor(
        torch.randint(0, 10, (2, 30), generator=g), torch.rand(30, generator=g), (10, 10)
    )
    passed = _sparse_warnings(GraphConvolution(), adj=adj)
    assert (
        len(passed) == 1
        and "GraphConvolution ran with sparse tensors (argument adj (torch.sparse_coo))" in passed[0]
    )
    held = _sparse_warnings(GraphConvolution(adj.to_sparse_csr()))
    assert len(held) == 1 and "(buffer adj (torch.sparse_csr))" in held[0]
    assert _sparse_warnings(GraphConvolution(), adj=adj.to_dense()) == []
    jagged = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)], layout=torch.jagged)
    assert sparse_tensors(GraphConvolution(), (jagged,), {}) == []  # Dynamo traces nested tensors


class Sweep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def _past_limit(
    compiles: list[tuple[str, dict]],
    shapes: tuple[int, ...] = (4,),
    make: Callable[[], nn.Module] = Sweep,
    **compile_kwargs,
) -> tuple:
    """Run a model from ``make`` compiled with each (backend, options) of ``compiles`` on
    inputs of each batch size, with Dynamo's recompile limit at 2: whether each call gave
    FP32 eager's bits, and lowprec's recompile-limit warnings."""
    torch._dynamo.reset()
    fp32 = []
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for backend, options in compiles:
            model = make()
            run = torch.compile(model, backend=backend, options=options, **compile_kwargs)
            for rows in shapes:
                x = torch.randn(rows, 8)
                fp32.append(torch.equal(run(x), model(x)))
    return fp32, [w for w in caught if "lowprec: Dynamo hit" in str(w.message)]


def test_a_recipe_sweep_past_dynamos_recompile_limit_is_named():
    """Each torch.compile with other options compiles the model's forward anew; past the
    limit Dynamo runs it uncompiled. One warning names the model, the limit and the options
    of the first compile it ran in FP32, at the user's line."""
    recipes = ("fp8-e5m2", "fp8-e5m2-sr", "fp8-hybrid", "bf16")
    fp32, found = _past_limit([("lowprec", {"recipe": r, "executor": "eager"}) for r in recipes])
    assert fp32 == [False, False, True, True]  # the last two sweeps ran unrounded
    assert len(found) == 1
    message = str(found[0].message)
    assert "recompile_limit (2) compiling Sweep's forward" in message
    assert "options={'recipe': 'fp8-hybrid', 'executor': 'eager'}" in message
    assert found[0].filename == __file__


def test_new_shapes_past_the_limit_are_named_once():
    """An nn.Sequential: Dynamo compiles a wrapper of its call; the warning names its class
    and its forward's source."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    fp32, found = _past_limit([("lowprec", EAGER_SR)], shapes=(1, 2, 3, 4), make=make, dynamic=False)
    assert fp32 == [False, False, True, True]
    assert len(found) == 1
    assert f"Sequential's forward ({nn.Sequential.forward.__code__.co_filename}:" in str(found[0].message)


def test_other_backends_and_hard_failures_past_the_limit_are_not_named():
    fp32, found = _past_limit([("eager", None)] * 3)
    assert fp32 == [True] * 3 and found == []
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        _past_limit([("lowprec", EAGER_SR)], shapes=(1, 2, 3), dynamic=False, fullgraph=True)
    with (
        torch._dynamo.config.patch(fail_on_recompile_limit_hit=True),
        pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit),
    ):
        _past_limit([("lowprec", EAGER_SR)], shapes=(1, 2, 3), dynamic=False)


def test_a_layer_compiled_as_a_frame_of_its_own_past_the_limit_is_named():
    """The root's forward gives up at its graph break and its layers compile as frames of
    their own, one graph per batch size: the warning names the layer's class and source."""

    def make() -> nn.Module:
        return LoopBreak()

    fp32, found = _past_limit([("lowprec", EAGER_SR)], shapes=(1, 2, 3), make=make, dynamic=False)
    assert fp32[0] is False and fp32[-1] is True  # (three layers, one code: the limit comes soon)
    assert len(found) == 1
    assert f"Linear's forward ({nn.Linear.forward.__code__.co_filename}:" in str(found[0].message)


class OneTemporary(nn.Module):
    """``self.w * self.head(self.encoder(x))`` with a graph break in the encoder: the resumed
    frame holds the weight and the head as stack temporaries; one without the weight."""

    def __init__(self, weighted: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.head, self.weighted = Broken(), nn.Linear(8, 8), weighted
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weighted:
            return self.w @ self.head(self.encoder(x)).T
        return self.head(self.encoder(x))


@pytest.mark.parametrize("weighted", [False, True], ids=["head", "weight-and-head"])
def test_a_single_stack_temporary_and_a_parameter_on_the_stack_are_placed(weighted):
    """Named as in the model compiled whole (the head was ``weight``, or ``""``)."""
    model = OneTemporary(weighted)
    own = {"w", "matmul"} if weighted else set()  # the forward's own product's, as compiled whole
    assert _layers(model) == {"encoder.up", "encoder.down", "head"} | own


def _compiled_over(case: str) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """A model compiled with lowprec, and what compiles it again (``"recompiled"``: compiled
    in place with another backend instead; ``"method"``: a method other than its call)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    if case == "wrapper":
        return model, torch.compile(
            torch.compile(model, backend="lowprec", options=EAGER_SR), backend="eager"
        )
    if case == "function":
        step = torch.compile(lambda x: model(x) * 2, backend="lowprec", options=EAGER_SR)
        return model, torch.compile(step, backend="eager")
    model.compile(backend="lowprec", options=EAGER_SR)
    if case == "in place":
        return model, torch.compile(model, backend="eager")
    if case == "recompiled":  # (replaces lowprec's compile, and runs eager)
        model.compile(backend="eager")
    else:  # (another method of the model, which never calls it)
        torch.compile(model.extra_repr, backend="eager")
    return model, model


@pytest.mark.parametrize(
    ("case", "named"),
    [("wrapper", True), ("function", True), ("in place", True), ("recompiled", False), ("method", False)],
)
def test_a_model_compiled_with_lowprec_and_compiled_again_is_named(case, named):
    """Dynamo traces through the inner compile, and lowprec's backend never runs."""
    torch._dynamo.reset()
    x = torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, compiled = _compiled_over(case)
        for _ in range(2):
            compiled(x).sum().backward()
    said = [str(w.message) for w in caught if "compiled with lowprec" in str(w.message)]
    if named:
        name = "function _compiled_over.<locals>.<lambda>" if case == "function" else "Sequential"
        assert len(said) == 1 and said[0].startswith(f"lowprec: {name}, compiled with lowprec, is "), said
        assert lpcompile.coverage(model) == []  # what the warning says: lowprec never ran
    else:
        assert said == []
        assert bool(lpcompile.coverage(model)) == (case == "method")  # lowprec ran


class Scaled(nn.Module):
    """A module without products of its own around ``inner``."""

    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.inner = inner
        self.scale = nn.Parameter(torch.full((2,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).relu() * self.scale


def _called_inside(case: str, backend: Callable) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """A model compiled with lowprec (``backend``), and what another torch.compile compiles that
    calls it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    if case.startswith("block compiled in place"):
        model.compile(backend=backend)
        if case.endswith("with a hook"):  # (Dynamo calls it through its __call__)
            model.register_forward_pre_hook(lambda module, args: None)
        return model, Scaled(model)
    if case == "function":
        step = torch.compile(lambda x: model(x), backend=backend)
        return model, lambda x: step(x) * 2
    compiled = torch.compile(model, backend=backend)
    return model, Scaled(compiled) if case == "block" else (lambda x: compiled(x) * 2)


class Outer:
    """Another backend: Dynamo's graphs run as they are, watched by ``check``."""

    def __init__(self, check: GridCheck) -> None:
        self.check = check
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs += 1

        def run(*args: torch.Tensor) -> object:
            with self.check:
                return gm(*args)

        return run


@pytest.mark.parametrize(
    "case", ["block", "block compiled in place with a hook", "model in a function", "function"]
)
def test_lowprec_runs_apart_where_another_compile_calls_it(case):
    """A model or function compiled with lowprec, called where another backend's torch.compile
    traces: Dynamo breaks its graph there and calls lowprec's compile, whose graphs round
    every product, forward and backward, by a dispatch-mode check of what ran."""
    torch._dynamo.reset()
    check = GridCheck()
    model, outer = _called_inside(case, watched_backend(EAGER_SR, check))
    other = Outer(check)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            loss = torch.compile(outer, backend=other)(torch.randn(4, 8)).sum()
            with check:
                loss.backward()
    assert not [str(w.message) for w in caught if "lowprec" in str(w.message)]
    assert other.graphs >= 1 and check.count == 2 * 5 and not check.off_grid, dict(check.products)
    assert [row.layer for row in lpcompile.coverage(model)] == ["0", "2"]


def test_a_fullgraph_compile_that_calls_lowprec_says_why_it_breaks():
    torch._dynamo.reset()
    _, outer = _called_inside("block", "lowprec")
    why = "compiled with lowprec: a torch.compile that calls it runs it apart"
    with pytest.raises(torch._dynamo.exc.Unsupported, match=why):
        torch.compile(outer, backend="eager", fullgraph=True)(torch.randn(4, 8))


@pytest.mark.parametrize("how", ["wrapper", "in place", "forward"])
def test_a_model_holding_blocks_compiled_in_place_is_named_where_another_backend_compiles_it(how):
    """Without hooks, Dynamo traces a module's ``forward``, not the compiled call of a module
    compiled in place: lowprec never runs, and the warning names the blocks and the fix."""
    torch._dynamo.reset()
    model, outer = _called_inside("block compiled in place", "lowprec")
    said = r"Scaled holds inner, compiled with lowprec in place .* Register torch.compile\(module"
    with pytest.warns(UserWarning, match=said) as record:
        if how == "wrapper":
            compiled = torch.compile(outer, backend="eager")
        elif how == "in place":
            compiled = outer
            outer.compile(backend="eager")
        else:
            compiled = torch.compile(outer.forward, backend="eager")
    assert len([w for w in record if "lowprec" in str(w.message)]) == 1
    compiled(torch.randn(4, 8)).sum().backward()
    assert lpcompile.coverage(model) == []  # what it says


def test_blocks_compiled_in_place_inside_a_block_that_runs_apart_are_not_named():
    torch._dynamo.reset()
    block = nn.Sequential(_called_inside("block compiled in place", "lowprec")[0])
    outer = Scaled(torch.compile(block, backend="lowprec", options=EAGER_SR))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(outer, backend="eager")(torch.randn(4, 8)).sum().backward()
    assert not [str(w.message) for w in caught if "lowprec" in str(w.message)]
    assert [row.layer for row in lpcompile.coverage(block)] == ["0.0", "0.2"]  # it ran apart


class Blocks(nn.Module):
    """Blocks compiled with lowprec, called in a loop, and a product of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), backend="lowprec", options=EAGER_SR)
            for _ in range(2)
        )
        self.w = nn.Parameter(torch.randn(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x @ self.w


def test_an_outer_lowprec_compile_traces_its_blocks_compiled_with_lowprec_into_one_graph():
    """lowprec's own compile traces through its blocks compiled with lowprec, as Dynamo does
    (one graph, the blocks rounded with its options); so does the pipeline's capture."""
    torch._dynamo.reset()
    model, records = Blocks(), Records()
    torch.compile(model, backend="lowprec", options=EAGER_SR, fullgraph=True)(
        torch.randn(4, 8)
    ).sum().backward()
    assert len(records.new) == 1
    assert len(records.only().sites) == 3 * 4
    names = ["blocks.0._orig_mod.0", "blocks.1._orig_mod.0", "w"]  # as model.named_modules() says
    assert [row.layer for row in lpcompile.coverage(model)] == names
    graph = capture_graph(model, torch.randn(1, 8))
    assert len(graph.graph.find_nodes(op="call_function", target=torch._C._nn.linear)) == 2


def test_another_backends_compiles_leave_the_graphs_of_lowprecs_own_compiles_valid():
    """The mark that runs a lowprec function apart is set only while another backend
    compiles: a lowprec compile that traced through it is not compiled again."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer, graphs = nn.Linear(8, 8), []

    def counted(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return lowprec(gm, example_inputs, EAGER_SR)

    setattr(counted, LOWPREC_BACKEND, True)
    inner = torch.compile(lambda x: layer(x).relu(), backend="lowprec", options=EAGER_SR)
    step = torch.compile(lambda x: inner(x) * 2, backend=counted)
    other = torch.compile(lambda x: inner(x) + 1, backend="eager", dynamic=False)
    x = torch.randn(4, 8)
    for rows in (2, 3, 5):
        step(x)
        other(torch.randn(rows, 8))  # another backend's compile, each time
    assert len(graphs) == 1


def test_blocks_inside_a_block_compiled_in_place_with_a_hook_are_not_named():
    """A block compiled in place with a hook runs apart (Dynamo calls its compiled call), and
    with it the blocks compiled in place inside it."""
    torch._dynamo.reset()
    inner, _ = _called_inside("block compiled in place", "lowprec")
    block = nn.Sequential(inner)
    block.compile(backend="lowprec", options=EAGER_SR)
    block.register_forward_pre_hook(lambda module, args: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(Scaled(block), backend="eager")(torch.randn(4, 8)).sum().backward()
    assert not [str(w.message) for w in caught if "lowprec" in str(w.message)]
    assert [row.layer for row in lpcompile.coverage(block)] == ["0.0", "0.2"]
