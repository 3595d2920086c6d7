"""The pipeline in the compiled graph: stage partition, boundary nodes, predict_weight nodes.

Everything compiles with ``executor="eager"`` (AOT autograd, no Inductor).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import pipe_split

import lpcompile
from examples.models import MLP
from lpcompile.backend import REGISTRY
from lpcompile.config import LowPrecConfig, PipelineConfig
from lpcompile.numerics.predict import predict_weight, predict_weight_reference
from lpcompile.passes.dynamo.pipeline import PREDICT_WEIGHT
from lpcompile.passes.stages import BOUNDARY, STAGE, balanced_cuts, is_pipe_split, node_cost, stage_graphs
from lpcompile.runtime.pipeline import (
    PipelinedTrainer,
    PipelineSGD,
    capture_graph,
    partition_graph,
    stage_delays,
)

# Batch-1 steps gain nothing from threads, and lose much on a busy machine.
pytestmark = pytest.mark.usefixtures("single_thread")


class Marked(nn.Module):
    """Three stages marked by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        lpcompile.pipe_split()
        h = torch.relu(self.b(h))
        pipe_split()
        return self.c(h)


def compile_once(model: nn.Module, x: torch.Tensor, **options):
    compiled = torch.compile(model, backend="lowprec", options={"executor": "eager", **options})
    out = compiled(x)
    return compiled, out, REGISTRY.records[-1]


# -- the op ------------------------------------------------------------------------------


def test_predict_weight_op():
    w, v = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.25])
    lr = torch.tensor(0.5)
    assert torch.equal(predict_weight(w, v, lr, 4, "lwp_v"), torch.tensor([0.0, -2.5]))  # w - 0.5*4*v
    prev = torch.tensor([1.5, -1.0])
    assert torch.equal(predict_weight(w, prev, lr, 2, "lwp_w"), torch.tensor([0.0, -4.0]))  # w + 2(w - prev)
    # the gradient goes to w unchanged, none to the buffer or lr
    w.requires_grad_()
    predict_weight(w, v, lr, 3, "lwp_v").mul(torch.tensor([2.0, 3.0])).sum().backward()
    assert torch.equal(w.grad, torch.tensor([2.0, 3.0]))
    torch.library.opcheck(
        torch.ops.lowprec.predict_weight.default, (torch.randn(3, 2), torch.randn(3, 2), lr, 2, "lwp_v")
    )
    from torch._inductor.decomposition import decompositions

    assert PREDICT_WEIGHT in decompositions
    with pytest.raises(ValueError, match="mode"):
        predict_weight_reference(w, v, lr, 1, "lwp")


def test_pipeline_config():
    assert LowPrecConfig.from_options({}).pipeline is None
    assert LowPrecConfig.from_options({"pipeline": True}).pipeline == PipelineConfig()
    config = LowPrecConfig.from_options({"pipeline": {"stages": "layer", "prediction": "lwp_w"}})
    assert config.pipeline == PipelineConfig("layer", "lwp_w")
    with pytest.raises(ValueError, match=r"valid keys: \['prediction', 'stages'\]"):
        LowPrecConfig.from_options({"pipeline": {"stage": 2}})
    with pytest.raises(ValueError, match="prediction must be one of"):
        PipelineConfig(prediction="lwp")
    with pytest.raises(ValueError, match="stages must be"):
        PipelineConfig(stages=0)


# -- partition -----------------------------------------------------------------------------


def test_balanced_cuts_is_optimal():
    costs = [5, 1, 1, 1, 6, 2, 2, 3]
    for stages in range(1, len(costs) + 1):
        starts = balanced_cuts(costs, stages)
        bounds = [0, *starts, len(costs)]
        worst = max(sum(costs[lo:hi]) for lo, hi in itertools.pairwise(bounds))
        best = min(
            max(sum(costs[lo:hi]) for lo, hi in itertools.pairwise([0, *cut, len(costs)]))
            for cut in itertools.combinations(range(1, len(costs)), stages - 1)
        )
        assert len(starts) == stages - 1 and worst == best


def test_balanced_partition_by_cost_model():
    # Layers cost 2*64*256 + bytes(w, b) ... the big middle layer gets a stage of its own.
    model = MLP(64, 256, 256, 16, 10)
    gm = capture_graph(model, torch.rand(1, 64))
    partition = partition_graph(gm, 2)
    assert partition.source == "balanced" and partition.num_stages == 2
    linear = [n for n in gm.graph.nodes if n.target is torch._C._nn.linear]
    flops = [2 * n.meta["example_value"].numel() * n.args[1].meta["example_value"].shape[1] for n in linear]
    assert [node_cost(n) for n in linear][0] == flops[0] + (256 * 64 + 256) * 4
    assert [n.meta[STAGE] for n in linear] == [0, 1, 1, 1]
    assert sum(partition.costs) == sum(node_cost(n) for n in gm.graph.nodes)
    assert len([n for n in gm.graph.nodes if is_pipe_split(n)]) == 1
    # every node is tagged, parameters with the stage that reads them, the input with stage 0
    assert all(STAGE in n.meta for n in gm.graph.nodes)
    param_stages = [n.meta[STAGE] for n in gm.graph.find_nodes(op="placeholder") if "weight" in n.name]
    assert param_stages == [0, 1, 1, 1]
    layer = partition_graph(capture_graph(model, torch.rand(1, 64)), "layer")
    assert layer.num_stages == 4 and layer.source == "layer" and layer.delays == [6, 4, 2, 0]


def test_markers_tag_the_graphs_and_stages_extract():
    torch.manual_seed(0)
    model = Marked()
    x = torch.randn(4, 6)
    _, out, record = compile_once(model, x, pipeline={})
    out.sum().backward()
    partition = record.partition
    assert partition.source == "pipe_split" and partition.num_stages == 3
    split = next(r for r in record.records if r.name == "split_stages")
    assert split.code_after.count("pippy._pipe_split") == 2  # the boundaries stay visible nodes
    for kind in ("forward", "backward"):
        gm = record.aten_graphs[kind]
        assert all(STAGE in n.meta for n in gm.graph.nodes), kind
        assert {n.meta[STAGE] for n in gm.graph.nodes} == {0, 1, 2}
    graphs = stage_graphs(record)
    assert sorted(graphs) == [(k, s) for k in ("backward", "forward") for s in range(3)]
    # the forward stages, chained, compute the model; each has its own layer's matmul
    fwd = record.aten_graphs["forward"]
    for s in range(3):
        stage_gm = graphs[("forward", s)]
        assert sum(n.target is torch.ops.aten.addmm.default for n in stage_gm.graph.nodes) == 1
        assert not any(is_pipe_split(n) for n in stage_gm.graph.nodes)
        assert all(n.meta[STAGE] == s for n in stage_gm.graph.nodes if n.op == "call_function")
    assert sum(1 for n in fwd.graph.nodes if n.meta.get(BOUNDARY)) == 2


def test_batchnorm_with_pipeline_option_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    compiled = torch.compile(
        model, backend="lowprec", options={"executor": "eager", "pipeline": {"stages": 2}}
    )
    with pytest.raises(Exception, match="GroupNorm"):
        compiled(torch.randn(3, 4))


# -- weight prediction in the graph ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["lwp_v", "lwp_w"])
def test_compiled_prediction_reads_the_optimizer(mode):
    torch.manual_seed(0)
    model = Marked()
    x = torch.randn(4, 6)
    delays = stage_delays(3)  # [4, 2, 0]
    stages = [model.a, model.b, model.c]
    groups = [{"params": list(m.parameters()), "delay": d} for m, d in zip(stages, delays, strict=True)]
    optimizer = PipelineSGD(groups, lr=0.125, momentum=0.5, prediction=mode)
    compiled, out, record = compile_once(model, x, pipeline={"prediction": mode})
    # no step yet: the predictions are the weights themselves
    assert torch.equal(out, model(x))
    dynamo = next(r for r in record.records if r.name == "insert_predict_weight").code_after
    assert dynamo.count("lowprec.predict_weight") == 4  # weight and bias of stages 0 and 1 (D > 0)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    out = compiled(x)
    predicted = {name: optimizer.predicted_weight(p) for name, p in model.named_parameters()}
    assert not torch.equal(predicted["a.weight"], model.a.weight)
    expected = torch.func.functional_call(model, predicted, (x,))
    assert torch.equal(out, expected)
    # gradients reach the weights as gradients w.r.t. the predicted weights
    for p in model.parameters():
        p.grad = None
    out.square().sum().backward()
    leaves = {k: v.detach().requires_grad_() for k, v in predicted.items()}
    torch.func.functional_call(model, leaves, (x,)).square().sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, leaves[name].grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("options", [{"recipe": "fp8-e5m2", "pipeline": {"prediction": "lwp_v"}}, {}])
def test_inductor_compiles_stage_markers(options):
    """Inductor cannot lower ``pippy._pipe_split``: it crashed on every pipeline graph
    and every model with markers. The markers are erased from the graph it gets; the
    numbers are the eager executor's (``options={}``: FP32, markers only)."""
    torch.manual_seed(0)
    models = [Marked(), Marked()]
    models[1].load_state_dict(models[0].state_dict())
    groups = [[{"params": list(m.parameters()), "delay": 2}] for m in models]
    optimizers = [PipelineSGD(g, lr=0.125, momentum=0.5, prediction="lwp_v") for g in groups]
    runs = [
        torch.compile(m, backend="lowprec", options={**options, "executor": executor})
        for m, executor in zip(models, ("inductor", "eager"), strict=True)
    ]
    x = torch.randn(4, 6)
    for _ in range(3):
        outs = []
        for run, optimizer in zip(runs, optimizers, strict=True):
            optimizer.zero_grad()
            out = run(x)
            out.square().sum().backward()
            optimizer.step()
            outs.append(out)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    record = next(r for r in reversed(REGISTRY.records) if r.config.executor == "inductor")
    assert any(r.name == "remove_pipe_splits" and r.nodes_removed == 2 for r in record.records)


def test_fp8_quantize_sits_next_to_the_prediction():
    torch.manual_seed(0)
    model = MLP(6, 8, 8, 3)
    _, _, record = compile_once(
        model, torch.randn(2, 6), recipe="fp8-e5m2", pipeline={"stages": "layer", "prediction": "lwp_v"}
    )
    # every predicted matmul weight feeds the weight's quantize chain directly
    dynamo = next(r for r in record.records if r.name == "insert_predict_weight")
    assert dynamo.nodes_added == 4 * 3  # per predicted parameter: the node and its two inputs
    forward = record.aten_graphs["forward"]
    predicts = [n for n in forward.graph.nodes if n.target is PREDICT_WEIGHT]
    weights = [n for n in predicts if len(n.meta["val"].shape) == 2]
    assert len(predicts) == 4 and len(weights) == 2
    for node in weights:
        assert {u.target for u in node.users} <= {
            torch.ops.lowprec.quantize_grad.default,
            torch.ops.lowprec.quantize.default,
        }, node.users


def test_the_fp32_casts_of_a_16_bit_layer_stay_in_its_stage():
    """A scaled 16-bit product casts its operands to FP32 before rounding them: the casts
    stay in the layer's stage, with its weight, and no FP32 operand crosses a boundary."""
    torch.manual_seed(0)
    model = MLP(6, 8, 3).to(torch.bfloat16)
    x = torch.randn(2, 6, dtype=torch.bfloat16)
    options = {"recipe": "fp8-tensorwise", "pipeline": {"stages": "layer", "prediction": "lwp_v"}}
    _, _, record = compile_once(model, x, **options)
    forward = record.aten_graphs["forward"]
    # the first stage's weight and bias only: the last stage has no delay
    assert sum(n.target is PREDICT_WEIGHT for n in forward.graph.nodes) == 2
    for node in forward.graph.nodes:
        if node.target is torch.ops.aten.mm.default:
            operands = [a for a in node.args if a.meta["val"].dtype == torch.float32]
            assert len(operands) == 2 and all(a.meta[STAGE] == node.meta[STAGE] for a in operands)
    # two layers in a row: the first's result is cast back in its own stage, the second's
    # operand cast up in the second's; the boundary carries a bfloat16 tensor
    chained = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Linear(8, 3, bias=False)).to(torch.bfloat16)
    _, _, record = compile_once(chained, x, **options)
    nodes = record.aten_graphs["forward"].graph.nodes
    casts = [n for n in nodes if n.target is torch.ops.aten._to_copy.default]
    f32, bf16 = torch.float32, torch.bfloat16
    expected = [(f32, 0), (f32, 0), (bf16, 0), (f32, 1), (f32, 1), (bf16, 1)]
    assert [(n.meta["val"].dtype, n.meta[STAGE]) for n in casts] == expected


def test_a_product_run_in_fp32_under_autocast_stays_in_its_stage():
    """Under autocast, a scaled product runs in a region with autocast off: its entry stays
    in the layer's stage with the operands' roundings, and the boundary carries autocast's
    bfloat16 result."""
    torch.manual_seed(0)
    options = {"recipe": "fp8-tensorwise", "pipeline": {"stages": "layer", "prediction": "lwp_v"}}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, out, record = compile_once(MLP(6, 8, 3), torch.randn(2, 6), **options)
    assert out.dtype == torch.bfloat16
    forward = record.aten_graphs["forward"]
    assert sum(n.target is PREDICT_WEIGHT for n in forward.graph.nodes) == 2
    products = [n for n in forward.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert [n.meta[STAGE] for n in products] == [0, 1]
    for node in products:
        assert all(a.meta["val"].dtype == torch.float32 for a in node.args)
        assert all(a.meta[STAGE] == node.meta[STAGE] for a in node.all_input_nodes)
    split = next(n for n in forward.graph.nodes if is_pipe_split(n))
    assert [a.meta["val"].dtype for a in split.next.all_input_nodes] == [torch.bfloat16]


# -- the trainer with compiled stages ------------------------------------------------------------


def test_trainer_with_lowprec_stages():
    torch.manual_seed(0)
    xs, ys = torch.rand(12, 16), torch.randint(0, 4, (12,))
    eager_model = MLP(16, 12, 12, 4)
    compiled_model = MLP(16, 12, 12, 4)
    compiled_model.load_state_dict(eager_model.state_dict())
    kwargs = dict(stages="layer", lr=0.05, momentum=0.9, spike_compensation=True, prediction="lwp_v")
    eager = PipelinedTrainer(eager_model, xs[:1], **kwargs)
    before = REGISTRY.graph_count
    compiled = PipelinedTrainer(compiled_model, xs[:1], compile={"executor": "eager"}, **kwargs)
    eager.fit(xs, ys)
    compiled.fit(xs, ys)
    assert REGISTRY.graph_count - before == 3  # one graph per stage: the slot ring does not recompile
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
    fp8 = PipelinedTrainer(
        MLP(16, 12, 12, 4), xs[:1], compile={"executor": "eager", "recipe": "fp8-e5m2"}, **kwargs
    )
    losses = fp8.fit(xs, ys)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert any(r.name == "insert_quantize" and r.nodes_added for r in REGISTRY.records[-1].records)
    with pytest.raises(ValueError, match="must not set 'pipeline'"):
        PipelinedTrainer(MLP(16, 4), xs[:1], lr=0.1, compile={"pipeline": {}})


def test_trainer_crosses_stages_with_skip_connections():
    """A value read two stages later is handed through the stage in between."""

    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 3)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            pipe_split()
            g = torch.tanh(self.b(h))
            pipe_split()
            return self.c(g + h) + x[:, :3]

    torch.manual_seed(0)
    model = Skip()
    xs, ys = torch.randn(6, 5), torch.randint(0, 3, (6,))
    trainer = PipelinedTrainer(model, xs[:1], lr=0.0)
    middle = trainer.stages[1].graph
    assert len(middle.inputs) == 2 and len(middle.outputs) == 3  # x, h in; x, h and g out
    assert set(middle.inputs) < set(middle.outputs)
    trainer.fit(xs, ys, seed=1)
    order = torch.randperm(6, generator=torch.Generator().manual_seed(1)).tolist()
    expected = [F.cross_entropy(model(xs[i : i + 1]), ys[i : i + 1]).item() for i in order]
    assert trainer.losses == pytest.approx(expected, rel=1e-6)
    # and the gradients through the skip reach stage 0: train one step vs autograd
    torch.manual_seed(0)
    one = Skip()
    ref = Skip()
    ref.load_state_dict(one.state_dict())
    single = PipelinedTrainer(one, xs[:1], lr=0.1, weight_stash=True)
    single.step(xs[:1], ys[:1])
    single.drain()
    F.cross_entropy(ref(xs[:1]), ys[:1]).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for p, q in zip(one.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)


class ActivationStage(nn.Module):
    """A second stage without parameters that multiplies activations only."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale  # no product
        pipe_split()
        return (h.mT @ h)[:1, :3]


def test_a_stage_without_parameters_draws_new_bits_at_each_step():
    """Its graph was keyed by its input, a new leaf at every step: it counted from call 0
    each time, and the same sample, with unchanged weights, took the same bits."""
    torch.manual_seed(0)
    x, y = torch.randn(1, 8) * 0.37, torch.tensor([1])
    options = {"executor": "eager", "recipe": "fp8-e5m2-sr", "activation": {"rounding": "stochastic"}}
    trainer = PipelinedTrainer(ActivationStage(), x, lr=0.0, compile=options)
    for _ in range(4):
        trainer.step(x, y)
    trainer.drain()
    assert len(set(trainer.losses)) > 1


class ActivationMiddle(nn.Module):
    """Three stages, the middle one without parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        pipe_split()
        h = h @ (h.mT @ h) * 0.1
        pipe_split()
        return self.c(h)


def test_a_stage_without_parameters_resumes_in_a_trainer_beside_the_one_that_saved():
    """Its counts, keyed by no weights, went to the saving trainer's stage, still alive,
    where a model's go to the copy whose weights match."""
    import copy

    options = {"executor": "eager", "recipe": "fp8-e5m2-sr", "activation": {"rounding": "stochastic"}}
    data = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(10, 1, 8, generator=data), torch.randint(0, 4, (10, 1), generator=data)

    def make() -> tuple[nn.Module, PipelinedTrainer]:
        torch.manual_seed(0)
        model = ActivationMiddle()
        return model, PipelinedTrainer(model, xs[0], lr=0.05, momentum=0.9, compile=options, seed=1)

    def feed(trainer: PipelinedTrainer, xs: torch.Tensor, ys: torch.Tensor) -> list[float]:
        done = len(trainer.losses)
        for x, y in zip(xs, ys, strict=True):
            trainer.step(x, y)
        trainer.drain()
        return trainer.losses[done:]

    first_model, first = make()
    feed(first, xs[:5], ys[:5])
    saved, weights = copy.deepcopy(first.state_dict()), copy.deepcopy(first_model.state_dict())
    continued = feed(first, xs[5:], ys[5:])
    model, resumed = make()
    model.load_state_dict(weights)
    resumed.load_state_dict(saved)
    assert feed(resumed, xs[5:], ys[5:]) == continued
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), first_model.parameters(), strict=True))
    # a state dict saved before it held the stages' counts restarts them (they stayed)
    first.load_state_dict({key: value for key, value in saved.items() if key != "stage_streams"})
    assert REGISTRY.steps_state(first.stages[1].key) == []


def test_symbolic_shapes_give_symbolic_costs():
    model = MLP(16, 32, 32, 4)
    options = {"executor": "eager", "pipeline": {"stages": 2}}
    compiled = torch.compile(model, backend="lowprec", options=options, dynamic=True)
    compiled(torch.randn(3, 16))
    partition = REGISTRY.records[-1].partition
    assert partition.num_stages == 2
    # FLOPs grow with the batch size (a sympy symbol); parameter bytes do not
    flops = (1072, 2336)
    assert all(e.startswith(f"{f}*s") for e, f in zip(partition.cost_exprs, flops, strict=True))
    batch = 3
    assert partition.costs == [1072 * batch + 2176, 2336 * batch + 4752]


def test_a_reused_graph_reads_the_buffers_of_its_own_parameters():
    """Dynamo may run one compiled graph for two modules of a class: each call's
    prediction must read the optimizer state of the parameters it was given."""
    torch.manual_seed(0)
    first, second = Marked(), Marked()
    options = {"executor": "eager", "pipeline": {"prediction": "lwp_v"}}
    x = torch.randn(3, 6)
    optimizers = []
    for model in (first, second):
        groups = [
            {"params": list(m.parameters()), "delay": d}
            for m, d in zip((model.a, model.b, model.c), stage_delays(3), strict=True)
        ]
        optimizers.append(PipelineSGD(groups, lr=0.25, momentum=0.5, prediction="lwp_v"))
    for model, optimizer in zip((first, second), optimizers, strict=True):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    before = REGISTRY.graph_count
    outs = [torch.compile(m, backend="lowprec", options=options)(x) for m in (first, second)]
    for model, optimizer, out in zip((first, second), optimizers, outs, strict=True):
        predicted = {name: optimizer.predicted_weight(p) for name, p in model.named_parameters()}
        assert torch.equal(out, torch.func.functional_call(model, predicted, (x,)))
    assert REGISTRY.graph_count - before >= 1


def test_trainer_stages_share_one_adaptive_state_per_model():
    """FP8 with per-layer adaptive loss scaling inside pipelined stages: the weight
    slots of in-flight forwards share their model's scales (one state per stage graph)."""
    from lpcompile.backend import stats

    torch.manual_seed(0)
    model = MLP(64, 32, 32, 10)
    x, y = torch.rand(12, 1, 8, 8), torch.randint(0, 10, (12,))
    options = {"recipe": "fp8-e5m2-als", "executor": "eager", "loss_scale_interval": 2}
    trainer = PipelinedTrainer(model, x[:1], stages=3, lr=0.01, momentum=0.9, compile=options)
    trainer.fit(x, y, epochs=1)
    assert [t.layer for t in stats(model)] == ["1", "3", "5"]
    assert len(REGISTRY.adaptive_states(model)) == 3  # one per stage, not one per weight slot
    assert all(len(t.history) >= 2 for t in stats(model))


def test_compiled_stages_compile_when_built_and_leave_no_trace():
    """The trainer compiles its stages (forward and backward) when it is built, so a rank's
    neighbours do not wait for a compile mid-run; those calls leave no trace: each stage's
    stochastic-rounding call count is its number of real forwards, adaptive states start
    at the first real call, and torch's random state is as before."""
    from lpcompile.backend.state import fingerprint

    torch.manual_seed(0)
    model = MLP(16, 12, 12, 4)
    xs, ys = torch.rand(5, 16), torch.randint(0, 4, (5,))
    before = REGISTRY.graph_count
    rng = torch.get_rng_state()
    options = {"recipe": "fp8-e5m2-sr", "executor": "eager"}
    trainer = PipelinedTrainer(model, xs[:1], stages="layer", lr=0.01, compile=options)
    assert REGISTRY.graph_count - before == 3  # compiled while built
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(not REGISTRY.entry(p).steps for p in model.parameters())
    trainer.fit(xs, ys)
    assert REGISTRY.graph_count - before == 3
    counts = [sum(REGISTRY.entry(stage.params[0]).steps.values()) for stage in trainer.stages]
    assert counts == [5, 5, 5]
    digests = {fingerprint(stage.params[0]) for stage in trainer.stages}
    assert digests <= {saved["model"] for saved in REGISTRY.streams_state()}

    adaptive = {"recipe": "fp8-e5m2-als", "executor": "eager"}
    als_model = MLP(16, 12, 12, 4)
    PipelinedTrainer(als_model, xs[:1], stages="layer", lr=0.01, compile=adaptive)
    assert REGISTRY.adaptive_states(als_model) == []  # made at the first real call
