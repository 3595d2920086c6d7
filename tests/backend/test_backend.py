"""Tests of the lowprec backend's graph rewriting (executor "eager", or Inductor's graphs without its C++)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from models import (
    RECIPE_SPECS,
    Records,
    Ref,
    assert_close_through_rounding,
    assert_same_step,
    capture_dynamo_graphs,
    convnet,
    convnet_input,
    inductor_runs_fx,
    lowprec_nodes,
    mlp,
    mlp_input,
    mlp_ref,
    stand_in_for_inductor,
    step,
)
from torch import nn

import lpcompile
from lpcompile.backend import step_seed, uses_cpp_wrapper
from lpcompile.backend.cache import SourceStamp, package_hash, without_donated_buffers
from lpcompile.backend.state import LayerCoverage
from lpcompile.backend.watch import names_in_model
from lpcompile.kernels.cpu import gemm

EAGER = {"executor": "eager"}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_(model: nn.Module, recipe: str, **options) -> nn.Module:
    return torch.compile(model, backend="lowprec", options={"recipe": recipe, **EAGER, **options})


def summary(nodes: list[torch.fx.Node]) -> Counter:
    """(op, role, phase) of each lowprec node, from its meta."""
    return Counter(
        (str(n.target).split(".")[1], n.meta["lowprec"]["role"], n.meta["lowprec"].get("phase"))
        for n in nodes
    )


def test_backend_by_name_in_a_fresh_process():
    """The torch_dynamo_backends entry point finds the backend without ``import lpcompile``."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        assert "lpcompile" not in sys.modules
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        compiled = torch.compile(
            model, backend="lowprec", options={"recipe": "fp8-e5m2", "executor": "eager"}
        )
        x = torch.randn(2, 4)
        y = compiled(x)
        y.sum().backward()
        from lpcompile.backend import REGISTRY
        assert REGISTRY.graph_count == 1 and len(REGISTRY.records[0].sites) == 4
        assert not torch.equal(y, model(x)), "the output was not quantized"
        print("OK")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "OK"


@pytest.mark.slow
def test_inductor_fuses_lowprec_ops_after_a_plain_inductor_compile(tmp_path):
    """Inductor copies its decomposition table at its first compile in a process. A
    plain ``torch.compile`` before lpcompile is imported (it comes in through the
    entry point) must not leave lowprec's operators out of it: they would run as
    the reference ops, unfused, and the slow graph would go into Inductor's cache."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        from torch.profiler import profile

        def step(run, x):
            run(x).square().sum().backward()

        torch.manual_seed(0)
        x = torch.randn(4, 8)
        step(torch.compile(torch.nn.Linear(8, 8)), x)  # Inductor's table is copied here
        assert "lpcompile" not in sys.modules
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        run = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr"})
        step(run, x)
        with profile() as prof:
            step(run, x)
        calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("lowprec::")}
        print(calls)
        """
    )
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),  # a real compile, not a cache hit
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
    }
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "{}", f"lowprec ops called unfused: {done.stdout}"


@pytest.mark.slow
def test_quantize_compiled_without_the_backend_fuses_after_a_plain_compile():
    """The same for ``torch.compile`` of ``lpcompile.quantize`` itself (e.g. in a compiled
    optimizer step), imported after another compile."""
    code = textwrap.dedent(
        """
        import torch
        from torch.profiler import profile

        torch.compile(torch.nn.Linear(4, 4))(torch.randn(2, 4))  # Inductor's table is copied here
        import lpcompile

        f = torch.compile(lambda x: lpcompile.quantize(x, "e5m2", "stochastic", seed=1) * 2)
        x = torch.randn(64)
        f(x)
        with profile() as prof:
            f(x)
        print({e.key: e.count for e in prof.key_averages() if e.key.startswith("lowprec::")})
        """
    )
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "{}", f"lowprec ops called unfused: {done.stdout}"


def test_a_mode_is_refused_by_name():
    model = mlp()
    with pytest.raises(Exception, match="backend='lowprec' takes no mode"):
        torch.compile(model, backend="lowprec", mode="reduce-overhead")(mlp_input())


def test_bf16_model_under_inductor_quantizes_what_eager_quantizes():
    """A fused BF16 intermediate (GELU's output) is rounded to BF16 before its quantize
    reads it, as eager stores it: without that, Inductor quantized the FP32 value."""
    outputs = {}
    for executor in ("inductor", "eager"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8)).to(torch.bfloat16)
        options = {"recipe": "fp8-e5m2", "matmul": "fp32", "executor": executor}
        y = torch.compile(model, backend="lowprec", options=options)(
            torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        )
        y.float().sum().backward()
        outputs[executor] = (y.detach(), model[0].weight.grad)
    assert torch.equal(outputs["inductor"][0], outputs["eager"][0])
    assert torch.equal(outputs["inductor"][1], outputs["eager"][1])


def test_fp32_rewrites_nothing_and_matches_eager(monkeypatch):
    graphs = capture_dynamo_graphs(monkeypatch)
    records = Records()
    model = convnet()
    x = convnet_input()
    expected = step(model, lambda: model(x))
    got = step(model, lambda: compile_(model, "fp32")(x))
    record = records.only()
    assert record.sites == {} and [r.graph for r in record.records] == ["forward", "backward"]
    assert set(record.aten_graphs) == {"forward", "backward"}
    for gm in [*graphs, *record.aten_graphs.values()]:
        assert lowprec_nodes(gm) == []
        assert not any("lowprec" in n.meta for n in gm.graph.nodes)
        assert "lowprec_seed" not in gm.code
    assert_same_step(got, expected)


def test_sr_mlp_node_counts_roles_and_phases(monkeypatch):
    graphs = capture_dynamo_graphs(monkeypatch)
    records = Records()
    model = mlp()
    compile_(model, "fp8-e5m2-sr")(mlp_input()).sum().backward()
    record = records.only()
    base = record.stream << 16
    # Per layer, in order: activation, weight_grad, weight, error.
    roles = ["activation", "weight_grad", "weight", "error"]
    assert {o - base: (s.layer, s.role) for o, s in record.sites.items()} == {
        i: (layer, role) for i, (layer, role) in enumerate((lay, r) for lay in "02" for r in roles)
    }
    for site in record.sites.values():
        backward = site.role in ("error", "weight_grad")
        assert site.op == ("quantize_grad" if backward else "quantize")
        assert (site.fmt, site.rounding, site.overflow) == RECIPE_SPECS["fp8-e5m2-sr"][backward]

    (dynamo,) = graphs
    nodes = lowprec_nodes(dynamo)
    assert summary(nodes) == Counter(
        {
            ("quantize", "activation", None): 2,
            ("quantize", "weight", None): 2,
            ("quantize_grad", "weight_grad", None): 2,
            ("quantize_grad", "error", None): 2,
        }
    )
    # Stochastic sites read the seed placeholder; nearest ones take no seed.
    (seed,) = [n for n in dynamo.graph.nodes if n.op == "placeholder" and n.name == "lowprec_seed"]
    assert {n.meta["lowprec"]["offset"] for n in seed.users} == {
        o for o, s in record.sites.items() if s.rounding == "stochastic"
    }
    # Each linear reads quantized operands and only the error node reads its output.
    for linear in [n for n in dynamo.graph.nodes if n.target is torch._C._nn.linear]:
        assert [a.target for a in linear.args[:2]] == [torch.ops.lowprec.quantize.default] * 2
        assert [u.target for u in linear.users] == [torch.ops.lowprec.quantize_grad.default]

    forward, backward = record.aten_graphs["forward"], record.aten_graphs["backward"]
    # quantize_grad stays in the forward as an identity; its rounding is in the backward.
    assert summary(lowprec_nodes(forward)) == Counter(
        {
            ("quantize", "activation", "forward"): 2,
            ("quantize", "weight", "forward"): 2,
            ("quantize_grad", "weight_grad", "forward"): 2,
            ("quantize_grad", "error", "forward"): 2,
        }
    )
    back_nodes = lowprec_nodes(backward)
    assert summary(back_nodes) == Counter(
        {("quantize", "error", "backward"): 2, ("quantize", "weight_grad", "backward"): 2}
    )
    for node in back_nodes:
        assert node.args[1:4] == ("e5m2", "stochastic", "inf") and node.args[4].op == "placeholder"
        assert node.args[5] in record.sites
    # Backward runs layer "2" before layer "0", error before weight gradient.
    assert [n.meta["lowprec"]["offset"] - base for n in back_nodes] == [7, 5, 3, 1]
    passes = {(r.name, r.graph): r for r in record.records}
    assert {("annotate_lowprec_nodes", "forward"), ("annotate_lowprec_nodes", "backward")} <= set(passes)
    assert passes["insert_quantize", "dynamo"].nodes_added == 9  # 8 lowprec nodes and the seed input


def test_fp8_hybrid_e4m3_forward_e5m2_backward():
    records = Records()
    compile_(mlp(), "fp8-hybrid")(mlp_input()).sum().backward()
    record = records.only()
    assert {s.role: s.fmt for s in record.sites.values()} == {
        "activation": "e4m3",
        "weight": "e4m3",
        "error": "e5m2",
        "weight_grad": "e5m2",
    }
    forward = [
        n for n in lowprec_nodes(record.aten_graphs["forward"]) if "quantize_grad" not in str(n.target)
    ]
    backward = lowprec_nodes(record.aten_graphs["backward"])
    assert len(forward) == 4 and {n.args[1] for n in forward} == {"e4m3"}
    assert len(backward) == 4 and {n.args[1] for n in backward} == {"e5m2"}
    # Nothing is stochastic, so no seed input at all.
    assert all(n.args[4] is None for n in forward + backward)


@pytest.mark.parametrize(
    ("options", "layers"),
    [
        ({"exclude": ["0"]}, {"2"}),
        ({"exclude": "2"}, {"0"}),
        ({"exclude": ["*"]}, set()),
        ({"keep_first_last": True}, set()),
    ],
)
def test_exclude_and_keep_first_last_on_mlp(options, layers):
    records = Records()
    compile_(mlp(), "fp8-e5m2", **options)(mlp_input()).sum().backward()
    record = records.only()
    assert {s.layer for s in record.sites.values()} == layers
    assert len(record.sites) == 4 * len(layers)
    assert len(lowprec_nodes(record.aten_graphs["backward"])) == 2 * len(layers)


@pytest.mark.parametrize(
    ("method", "kept"), [("forward", {"0": None, "2": "exclude"}), ("__call__", {"0": None, "2": None})]
)
def test_a_compiled_bound_method_names_layers_from_its_module(method, kept):
    """``model.forward = torch.compile(model.forward, ...)``: Dynamo reads the parameters
    through the bound method (``L['fn'].__self__``); names still start at the model. Of
    ``torch.compile(model.__call__)`` Dynamo compiles each Linear's frame apart (it skips
    torch.nn's own frames), a graph lowprec names from the model all the same."""
    model = mlp()
    options = {"recipe": "fp8-e5m2", **EAGER, "exclude": [name for name, why in kept.items() if why]}
    compiled = torch.compile(getattr(model, method), backend="lowprec", options=options)
    if method == "forward":
        model.forward = compiled  # what model(x) calls
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (model if method == "forward" else compiled)(mlp_input()).sum().backward()
    assert not [w for w in caught if "lowprec" in str(w.message)]  # as an exclude matching nothing
    assert {c.layer: c.kept for c in lpcompile.coverage(model)} == kept


@pytest.mark.parametrize(
    ("options", "warning"),
    [
        (
            {"exclude": ["fc1.weight", "2"]},
            r"exclude patterns \['fc1.weight'\] match no layer of a graph with layers \['0', '2'\]",
        ),
        (
            {"keep_first_last": True},
            r"keep_first_last leaves every layer of a graph unquantized \(its layers: \['0', '2'\]\)",
        ),
    ],
)
def test_settings_without_effect_on_a_graph_warn(options, warning):
    model = compile_(mlp(), "fp8-e5m2", **options)
    with pytest.warns(UserWarning, match=warning):
        model(mlp_input()).sum().backward()  # a pattern naming nothing in the model: at once


class _BrokenMLP(nn.Module):
    """``inp``, a graph break, ``mid.lin`` and ``out``: two graphs of one model."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)
        self.mid = nn.Module()
        self.mid.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        torch._dynamo.graph_break()
        return self.out(torch.relu(self.mid.lin(x)))


def test_an_exclude_pattern_matching_a_layer_of_another_graph_of_the_model_does_not_warn():
    model = compile_(_BrokenMLP(), "fp8-e5m2", exclude=["mid.lin", "out*"])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lowprec")
        for _ in range(3):
            model(mlp_input()).sum().backward()
    kept = {row.layer: row.kept for row in lpcompile.coverage(model) if row.kept}
    assert kept == {"mid.lin": "exclude", "out": "exclude"}, kept
    # a typo warns at once; a module without layers of its own at the end of the watched
    # forward (the second call), naming every graph's layers; each once
    torch._dynamo.reset()
    model = compile_(_BrokenMLP(), "fp8-e5m2", exclude=["mid.lin", "mid.lni", "mid"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unmatched = []
        for _ in range(3):
            model(mlp_input()).sum().backward()
            unmatched.append([str(w.message) for w in caught if "match no layer" in str(w.message)])
    assert (
        len(unmatched[0]) == 1
        and "['mid.lni'] match no layer of a graph with layers ['inp']" in unmatched[0][0]
    )
    assert len(unmatched[1]) == len(unmatched[2]) == 2, unmatched
    assert "['mid'] match no layer of the graphs of _BrokenMLP" in unmatched[1][1], unmatched
    assert "['inp']" in unmatched[1][1] and "'mid.lin', 'out'" in unmatched[1][1], unmatched


def test_settings_with_effect_do_not_warn():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lowprec")
        compile_(convnet(), "fp8-e5m2", exclude="0", keep_first_last=True)(convnet_input()).sum().backward()
        # a call in the root module, its weight passed by keyword: named after the weight
        compile_(_KeywordLinear("weight="), "fp8-e5m2", exclude="w")(torch.randn(4, 8)).sum().backward()


def test_keep_first_last_keeps_the_middle_layer_of_three():
    records = Records()
    compile_(convnet(), "fp8-e5m2", keep_first_last=True)(convnet_input()).sum().backward()
    assert {s.layer for s in records.only().sites.values()} == {"4"}


def test_matmul_of_two_activations_gets_two_activation_sites():
    class AttentionScores(nn.Module):
        def forward(self, q, k):
            return torch.matmul(q, k.transpose(-1, -2)).softmax(-1)

    records = Records()
    q = torch.randn(2, 3, 4, requires_grad=True)
    k = torch.randn(2, 5, 4, requires_grad=True)
    y = compile_(AttentionScores(), "fp8-e5m2-sr")(q, k)
    (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
    record = records.only()
    assert [s.role for s in record.sites.values()] == ["activation", "activation", "error"]
    assert summary(lowprec_nodes(record.aten_graphs["backward"])) == Counter(
        {("quantize", "error", "backward"): 1}
    )
    # Against the hand-written reference: both operands quantized, error SR-rounded.
    ref = Ref.for_recipe("fp8-e5m2-sr", step_seed(0, 0), record.stream)
    q2, k2 = q.detach().requires_grad_(), k.detach().requires_grad_()
    y2 = ref.qg(torch.matmul(ref.q(q2), ref.q(k2.transpose(-1, -2)))).softmax(-1)
    (y2 * torch.randn(y.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
    assert torch.equal(y, y2)
    assert torch.equal(q.grad, q2.grad) and torch.equal(k.grad, k2.grad)


class _Scores(nn.Module):
    """Attention's two products of activations, in one submodule."""

    def forward(self, q, k, v):
        return torch.matmul(torch.matmul(q, k.transpose(-1, -2)).softmax(-1), v)


class _WithScores(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.attn = nn.Linear(6, 6), _Scores()

    def forward(self, x):
        h = self.proj(x)
        return self.attn(h, h, h)


def test_several_layer_calls_of_one_module_are_numbered():
    """Both products of an attention block were named after the block: ``exclude`` kept
    both or neither, and per-layer telemetry showed one name twice."""
    records = Records()
    x = torch.randn(2, 3, 6)
    compile_(_WithScores(), "fp8-e5m2-sr")(x).sum().backward()
    assert Counter(s.layer for s in records.new[-1].sites.values()) == {"proj": 4, "attn#0": 3, "attn#1": 3}
    compile_(_WithScores(), "fp8-e5m2-sr", exclude=["attn#1"])(x).sum().backward()
    assert {s.layer for s in records.new[-1].sites.values()} == {"proj", "attn#0"}


class _PermuteThenMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(6, 3))

    def forward(self, x):
        return torch.linalg.matmul(torch.einsum("bi->ib", x).t(), self.w)


def test_linalg_matmul_is_a_layer_and_a_permuting_einsum_no_product():
    records = Records()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="lowprec")
        compile_(_PermuteThenMatmul(), "fp8-e5m2-sr")(mlp_input()).sum().backward()
    roles = Counter(s.role for s in records.only().sites.values())
    assert roles == {"activation": 1, "weight": 1, "weight_grad": 1, "error": 1}, roles


def test_transposed_convolutions_are_quantized_layers():
    """A ConvTranspose2d gets a convolution's four sites, bit-identical to the
    hand-written reference over two calls (two seeds)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 10 * 10, 4),
    )
    up, out = model[0], model[3]
    x = convnet_input()

    def reference(ref: Ref) -> torch.Tensor:
        h = ref.layer(F.conv_transpose2d, x, up.weight, up.bias, up.stride, up.padding, up.output_padding)
        return ref.layer(F.linear, h.relu().flatten(1), out.weight, out.bias)

    records = Records()
    compiled = compile_(model, "fp8-e5m2-sr")
    for call in range(2):
        got = step(model, lambda: compiled(x))  # noqa: B023
        record = records.only()
        ref = Ref.for_recipe("fp8-e5m2-sr", step_seed(0, call), record.stream)
        assert_same_step(got, step(model, lambda ref=ref: reference(ref)), f"call {call}")
    assert Counter(s.layer for s in record.sites.values()) == {"0": 4, "3": 4}
    fp32 = step(model, lambda: model(x))
    assert not torch.equal(got[0], fp32[0]) and not torch.equal(got[1][0], fp32[1][0])


class TwoGraphs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(h)


def test_graph_break_rewrites_both_graphs_and_trains():
    records = Records()
    model = TwoGraphs()
    compiled = compile_(model, "fp8-e5m2-sr")
    x = mlp_input()
    for call in range(2):
        got = step(model, lambda: compiled(x))
        first, second = records.new
        assert {s.layer for s in first.sites.values()} == {"a"} and len(first.sites) == 4
        assert {s.layer for s in second.sites.values()} == {"b"} and len(second.sites) == 4
        seed = step_seed(0, call)  # each graph counts its model's calls (first parameters a.*, b.*)

        def reference(first=first, second=second, seed=seed):
            ref_a = Ref.for_recipe("fp8-e5m2-sr", seed, first.stream)
            ref_b = Ref.for_recipe("fp8-e5m2-sr", seed, second.stream)
            return ref_b.layer(
                F.linear, ref_a.layer(F.linear, x, *model.a.parameters()).relu(), *model.b.parameters()
            )

        expected = step(model, reference)
        assert_same_step(got, expected, f"call {call}")
    assert len(records.new) == 2


def test_no_grad_inference_is_quantized_and_recorded():
    records = Records()
    model = mlp()
    x = mlp_input()
    with torch.no_grad():
        y = compile_(model, "fp8-e5m2-sr")(x)
        expected = mlp_ref(model, x, Ref.for_recipe("fp8-e5m2-sr", step_seed(0, 0), records.only().stream))
    record = records.only()
    assert set(record.aten_graphs) == {"inference"}
    nodes = lowprec_nodes(record.aten_graphs["inference"])
    assert {n.meta["lowprec"]["phase"] for n in nodes} == {"forward"}
    assert Counter(
        n.meta["lowprec"]["role"] for n in nodes if "quantize_grad" not in str(n.target)
    ) == Counter({"activation": 2, "weight": 2})
    assert torch.equal(y, expected)
    assert not torch.equal(y, model(x))


@pytest.mark.parametrize(
    "executor, compile_threads, steps_before", [("inductor", 1, 0), ("inductor", 2, 0), ("eager", 2, 1)]
)
def test_a_second_backward_through_a_kept_graph(executor, compile_threads, steps_before):
    """``backward(retain_graph=True)`` then ``backward()`` (GAN and multi-task training):
    the second adds the same gradients, also where two compile threads have Inductor lower
    the backward with the forward. Inductor, like torch's own, keeps a graph where the
    first backward keeps it; the eager executor also after steps without."""
    model = mlp()
    options = {"recipe": "fp8-e5m2-sr", "executor": executor}
    with torch._inductor.config.patch(compile_threads=compile_threads):
        compiled = torch.compile(model, backend="lowprec", options=options)
        for _ in range(steps_before):
            compiled(mlp_input()).sum().backward()
        model.zero_grad()
        loss = compiled(mlp_input()).square().sum()
        loss.backward(retain_graph=True)
        first = {name: p.grad.clone() for name, p in model.named_parameters()}
        loss.backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, 2 * first[name]), name


def test_inductor_keys_a_graph_compiled_without_donated_buffers_apart():
    """Inductor's cache key holds no donated buffer: a backward that writes into them must
    not serve one compiled to run again."""
    stamp = SourceStamp()
    with without_donated_buffers():
        kept = stamp.uuid()
    assert kept != stamp.uuid() and stamp.uuid() == package_hash()


@pytest.mark.parametrize("dynamic", [False, None])
def test_recompile_for_a_new_batch_size(dynamic):
    """A recompile (static shapes, or Dynamo's automatic dynamic ones) keeps the random
    stream, which hashes the layers, not the code, and continues the model's call count:
    no step's bits repeat an earlier step's."""
    records = Records()
    model = mlp()
    compiled = torch.compile(
        model, backend="lowprec", dynamic=dynamic, options={"recipe": "fp8-e5m2-sr", **EAGER}
    )
    # (batch size, which compiled graph runs, the model's call count)
    for batch, graph, call in [(4, 0, 0), (5, 1, 1), (4, 0 if dynamic is False else 1, 2)]:
        x = mlp_input(batch)
        got = step(model, lambda: compiled(x))  # noqa: B023
        record = records.new[graph]
        assert len(record.sites) == 8
        ref = Ref.for_recipe("fp8-e5m2-sr", step_seed(0, call), record.stream)
        expected = step(model, lambda: mlp_ref(model, x, ref))  # noqa: B023
        assert_same_step(got, expected, str((batch, graph, call)))
    assert len(records.new) == 2 and records.new[0].stream == records.new[1].stream


def test_stochastic_rounding_does_not_depend_on_what_ran_before():
    """Two fresh models of one class, same seed, same inputs, one after the other in one
    process: the same bits. The second used to continue the first's call count (Dynamo
    shares the compiled graph), and a recompile to dynamic shapes changed the stream."""
    results = []
    for _ in range(2):
        model = mlp()
        compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr", **EAGER})
        results.append([step(model, lambda: compiled(mlp_input(b)))[1] for b in (4, 5, 4)])  # noqa: B023
    for first, second in zip(*results, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_functional_code_counts_per_trained_input():
    """Weights as plain tensors (no Parameter): the first input that requires grad names
    the model. The count was per compiled graph: a recompile reused step 0's seed, and a
    second run continued the first's count."""

    def f(x, w1, w2):
        return F.linear(F.linear(x, w1).relu(), w2)

    compiled = torch.compile(f, backend="lowprec", options={"recipe": "fp8-e5m2-sr", **EAGER})
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        w1, w2 = torch.randn(8, 6, requires_grad=True), torch.randn(3, 8, requires_grad=True)
        grads = []
        for batch in (4, 5, 4):
            compiled(mlp_input(batch), w1, w2).sum().backward()
            grads.append(w1.grad)
            w1.grad = w2.grad = None
        runs.append(grads)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert not torch.equal(runs[0][0], runs[0][2])  # batch 4 twice: steps 0 and 2, not one seed


class ActivationProduct(nn.Module):
    """A frame after a graph break whose products multiply activations only: no parameter
    names its model, and its first input requiring grad is computed at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.scale  # no product: the same values at every call
        torch._dynamo.graph_break()
        return h @ h.T


def test_a_graph_without_parameters_draws_new_bits_at_each_call():
    """Keyed by its activation, new at every call, it counted from call 0 each time: the
    same stochastic-rounding bits at every step."""
    torch._dynamo.reset()
    options = {"recipe": "fp8-e5m2-sr", "activation": {"rounding": "stochastic"}, **EAGER}
    run = torch.compile(ActivationProduct(), backend="lowprec", options=options)
    x = torch.randn(4, 8) * 3.3
    outputs = [run(x) for _ in range(3)]
    assert not any(torch.equal(outputs[0], later) for later in outputs[1:])


def test_evaluation_under_no_grad_does_not_shift_the_training_bits():
    results = []
    for evaluate in (False, True):
        model = mlp()
        compiled = torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2-sr", **EAGER})
        grads = []
        for _ in range(3):
            grads.append(step(model, lambda: compiled(mlp_input()))[1])  # noqa: B023
            if evaluate:
                with torch.no_grad():
                    compiled(mlp_input())
        results.append(grads)
    for first, second in zip(*results, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_inductor_cache_keys_follow_the_operator_sources(tmp_path):
    """Editing the lowprec ops' Python must change Inductor's cache key (SourceStamp.uuid)."""
    import shutil
    from pathlib import Path

    from lpcompile import backend
    from lpcompile.backend import SourceStamp, source_hash

    package = Path(backend.__file__).parents[1]
    copy = tmp_path / "lpcompile"
    shutil.copytree(package, copy)
    assert source_hash(copy) == source_hash(package) == SourceStamp().uuid()
    with open(copy / "numerics" / "quantize.py", "a") as f:
        f.write("\n# a change to the numerics\n")
    assert source_hash(copy) != source_hash(package)
    with open(copy / "tools" / "report.py", "a") as f:  # not traced: not part of the key
        f.write("\n# unrelated\n")
    (copy / "numerics" / "quantize.py").write_bytes((package / "numerics" / "quantize.py").read_bytes())
    assert source_hash(copy) == source_hash(package)
    with open(copy / "passes" / "aot" / "__init__.py", "a") as f:  # the pass lists run inside Inductor
        f.write("\nAOT_PASSES = ()\n")
    assert source_hash(copy) != source_hash(package)


def test_plain_inductor_keys_lowprec_operators_by_their_lowering(tmp_path):
    """A plain ``torch.compile`` of ``lpcompile.quantize`` never passes through the backend's
    cache stamp: the lowerings' source hash in ``cache_key_tag`` keys its graphs."""
    import shutil
    from pathlib import Path

    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    from lpcompile import numerics
    from lpcompile.numerics import lowering_tag

    folder = Path(numerics.__file__).parent
    copy = tmp_path / "numerics"
    shutil.copytree(folder, copy)
    tag = torch.compiler.config.cache_key_tag
    assert lowering_tag(folder) == lowering_tag(copy) in tag
    with open(copy / "quantize.py", "a") as f:  # an upgraded lowering
        f.write("\n# a change to the rounding\n")
    assert lowering_tag(copy) != lowering_tag(folder)

    def compile_once() -> None:
        torch._dynamo.reset()
        torch.compile(lambda x: lpcompile.quantize(x, "e4m3"))(torch.randn(64))

    counters.clear()
    with fresh_cache():
        compile_once()
        compile_once()
        assert counters["inductor"]["fxgraph_cache_hit"] == 1, dict(counters["inductor"])
        edited = tag.replace(lowering_tag(folder), lowering_tag(copy))
        with torch.compiler.config.patch(cache_key_tag=edited):
            compile_once()
        assert counters["inductor"]["fxgraph_cache_miss"] == 2, dict(counters["inductor"])
    # a config patch that dropped the tag: the backend's next compile puts it back
    with torch.compiler.config.patch(cache_key_tag=""):
        torch._dynamo.reset()
        torch.compile(nn.Linear(4, 4), backend="lowprec")(torch.randn(2, 4))
        assert torch.compiler.config.cache_key_tag == lowering_tag(folder)


def test_joint_warnings_are_kept_by_graph_inputs_and_modes(tmp_path, monkeypatch):
    """What the joint passes warned, kept beside Inductor's cache for compiles it serves."""
    from lpcompile.backend.cache import joint_warnings_key, load_joint_warnings, save_joint_warnings

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    gm = torch.fx.symbolic_trace(nn.ReLU())
    key = joint_warnings_key(gm, [torch.randn(2)], "stamp")
    assert key == joint_warnings_key(gm, [torch.randn(2)], "stamp")
    assert key != joint_warnings_key(gm, [torch.randn(3)], "stamp")
    assert key != joint_warnings_key(gm, [torch.randn(2)], "other stamp")
    with torch.no_grad():
        assert key != joint_warnings_key(gm, [torch.randn(2)], "stamp")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key != joint_warnings_key(gm, [torch.randn(2)], "stamp")
    # no address in the key: the same in every process
    generators = [joint_warnings_key(gm, [torch.Generator()], "stamp") for _ in range(2)]
    assert generators[0] == generators[1]
    csr = torch.eye(2).to_sparse_csr()
    assert joint_warnings_key(gm, [csr], "stamp") is None  # no strides
    assert load_joint_warnings(key) == []
    save_joint_warnings(key, ["a", "b", "a"])
    assert load_joint_warnings(key) == ["a", "b"]
    save_joint_warnings(key, [])  # a compile that warned nothing: nothing to repeat
    assert load_joint_warnings(key) == [] and not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize(
    ("first", "second", "removed"),
    [
        ([1, 0], [1, 0], True),
        ([1, 2, 0], [2, 0, 1], True),
        ([1, 2, 0], [1, 2, 0], False),
        ([-1, 0], [1, 0], True),
    ],
)
def test_remove_permute_pairs(first, second, removed):
    from lpcompile.passes.aot.layout import remove_permute_pairs

    permute = torch.ops.aten.permute.default

    def fn(x):
        t = permute(x, first)
        return t.sum(), permute(t, second)

    gm = torch.fx.symbolic_trace(fn)
    x = torch.randn(2, 3, 4) if len(first) == 3 else torch.randn(2, 3)
    expected = gm(x)
    remove_permute_pairs(gm, None)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(permute) == (1 if removed else 2)
    outputs = gm.graph.output_node().args[0]
    assert (outputs[1].op == "placeholder") is removed
    for got, want in zip(gm(x), expected, strict=True):
        assert torch.equal(got, want) and got.stride() == want.stride()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_realize_transposed_copies_stores_cpu_transposes_once(device):
    """A CPU copy that transposes (``clone`` of a ``permute`` with new strides) is read
    through ``lowprec::realize`` by all its readers; copies that keep their strides or
    copy no permute, and any copy off the CPU, are left to Inductor."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lpcompile.passes.aot.layout import realize_transposed_copies

    aten = torch.ops.aten

    def fn(x, y):
        moved = aten.clone.default(aten.permute.default(x, [0, 2, 1]), memory_format=torch.contiguous_format)
        kept = aten.clone.default(aten.permute.default(y, [1, 0]))  # preserves the permuted strides
        every_other = aten.slice.Tensor(x, 2, 0, 4, 2)
        packed = aten.clone.default(every_other, memory_format=torch.contiguous_format)  # no transpose
        return moved * 2, moved.sum(0), kept + 1, packed

    x, y = torch.randn(2, 3, 4, device=device), torch.randn(3, 5, device=device)
    gm = make_fx(fn)(x, y)
    realize_transposed_copies(gm, None)
    gm.recompile()
    realized = gm.graph.find_nodes(op="call_function", target=torch.ops.lowprec.realize.default)
    if device == "meta":
        assert not realized
        return
    (stored,) = realized
    copy = stored.args[0]
    assert copy.target is aten.clone.default and copy.args[0].target is aten.permute.default
    assert list(copy.users) == [stored] and len(stored.users) == 2  # both readers of `moved`
    for got, want in zip(gm(x, y), fn(x, y), strict=True):
        assert torch.equal(got, want) and got.stride() == want.stride()


def test_a_mask_of_an_input_mutated_in_place_is_saved_not_recomputed(monkeypatch):
    """Recomputed in the backward, ``buf > 0`` read ``buf`` after ``buf.sub_``: the
    gradient was zero where eager gives one."""

    def f(w, buf):
        mask = buf > 0
        buf.sub_(10.0)
        return (w * mask).sum()

    received = inductor_runs_fx(monkeypatch)
    w = torch.randn(8, requires_grad=True)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(f, backend="lowprec", options={"recipe": "fp8-e5m2"})(w, torch.rand(8) + 0.5).backward()
    assert "backward" in received
    assert torch.equal(w.grad, torch.ones(8))


def test_inference_graphs_get_no_joint_pass_record(monkeypatch):
    """Inductor runs joint-graph passes on inference graphs too; with nothing to
    partition they used to leave a "joint" record (and dump folder) of the inference graph."""
    received = inductor_runs_fx(monkeypatch)
    records = Records()
    model = mlp()
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(model, backend="lowprec", options={"recipe": "fp8-e5m2"})(mlp_input())
    assert "inference" in received
    assert {r.graph for r in records.only().records} == {"dynamo", "inference"}


def test_inductor_gets_the_saved_weight_without_the_transpose_pair(monkeypatch):
    """AOT's partitioner saves layer "2"'s quantized weight as ``permute(permute(w_q))``.

    Under Inductor that pair made the forward write the quantized weight twice
    (one buffer for the matmul, one for the backward). The compiler the backend hands
    Inductor runs ``remove_permute_pairs`` first: the saved output becomes ``w_q``
    itself. Inductor's compiler is stood in for by one that runs the graph it gets
    as FX (and AOT's cache is off: on a hit no compiler runs), so the graphs
    Inductor would receive are checked, and run, without Inductor's C++.
    """
    received = inductor_runs_fx(monkeypatch)
    records = Records()
    model = mlp()
    x = mlp_input()
    options = {"recipe": "fp8-e5m2-sr", "executor": "inductor"}
    with torch._functorch.config.patch(enable_autograd_cache=False):
        got = step(model, lambda: torch.compile(model, backend="lowprec", options=options)(x))
    record = records.only()
    # lowprec's bf16 matmul kernel runs only on CPUs with AVX512-BF16; elsewhere its pass is skipped
    bf16 = {("use_bf16_matmuls", "joint"): 0} if gemm.unavailable() is None else {}
    assert {(r.name, r.graph): r.nodes_removed for r in record.records if r.graph != "dynamo"} == {
        **bf16,  # matmuls this small stay ATen's
        ("recompute_bool_masks", "joint"): 0,
        ("remove_permute_pairs", "forward"): 1,
        ("remove_permute_pairs", "backward"): 0,
        ("use_channels_last_conv_backward", "forward"): 0,  # no convolution
        ("use_channels_last_conv_backward", "backward"): 0,
        ("count_histograms_serially", "forward"): 0,  # no adaptive scaling, no histograms
        ("count_histograms_serially", "backward"): 0,
        ("realize_transposed_copies", "backward"): 0,  # adds, removes nothing
    }
    forward = received["forward"]
    permutes = forward.graph.find_nodes(op="call_function", target=torch.ops.aten.permute.default)
    assert not any(p.args[0] in permutes for p in permutes)
    # recompute_bool_masks: the ReLU's mask is recomputed in the backward, not saved as bool.
    saved = [n.meta["val"].dtype for n in forward.graph.output_node().args[0] if isinstance(n, torch.fx.Node)]
    assert torch.bool not in saved, saved
    backward = received["backward"]
    assert backward.graph.find_nodes(op="call_function", target=torch.ops.aten.le.Scalar)
    ref = Ref.for_recipe("fp8-e5m2-sr", step_seed(0, 0), record.stream)
    assert_same_step(got, step(model, lambda: mlp_ref(model, x, ref)))


def test_recompute_bool_masks_tags_forward_comparisons_the_backward_reads():
    """Only a comparison computed before the tangents and read after them is tagged."""
    from torch.utils.checkpoint import CheckpointPolicy

    from lpcompile.passes.joint.masks import masks_apply, recompute_bool_masks

    aten = torch.ops.aten

    def joint(primals_1, tangents_1):
        mask = aten.le.Scalar(primals_1, 0.0)  # forward, read by the backward: tagged
        only_forward = aten.gt.Scalar(primals_1, 1.0)  # never read by the backward
        out = aten.where.self(only_forward, primals_1, 0.0)
        in_backward = aten.lt.Scalar(tangents_1, 0.0)  # computed from a tangent
        grad = aten.where.self(mask, 0.0, aten.where.self(in_backward, 0.0, tangents_1))
        return out, grad

    gm = torch.fx.symbolic_trace(joint)
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta["val"] = torch.empty(3)
    recompute_bool_masks(gm, None)
    tags = {n.target: n.meta.get("recompute") for n in gm.graph.nodes}
    assert tags[aten.le.Scalar] is CheckpointPolicy.MUST_RECOMPUTE
    assert tags[aten.gt.Scalar] is None and tags[aten.lt.Scalar] is None
    le = gm.graph.find_nodes(op="call_function", target=aten.le.Scalar)[0]
    le.meta["recompute"] = CheckpointPolicy.MUST_SAVE  # a user's checkpointing policy wins
    recompute_bool_masks(gm, None)
    assert le.meta["recompute"] is CheckpointPolicy.MUST_SAVE
    assert masks_apply(gm, None, "joint")
    for node in gm.graph.find_nodes(op="placeholder"):  # a graph on another device is left alone
        node.meta["val"] = torch.empty(3, device="meta")
    assert not masks_apply(gm, None, "joint")


class _KeywordLinear(nn.Module):
    """One linear layer, its operands passed by position or by keyword."""

    def __init__(self, style: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 8))
        self.b = nn.Parameter(torch.randn(4))
        self.style = style

    def forward(self, x):
        if self.style == "positional":
            return F.linear(x, self.w, self.b)
        if self.style == "weight=":
            return F.linear(x, weight=self.w, bias=self.b)
        return F.linear(input=x, weight=self.w, bias=self.b)


@pytest.mark.parametrize("loss_scale", ["none", "adaptive"])
def test_operands_passed_by_keyword_are_quantized_too(loss_scale):
    """``F.linear(x, weight=w)`` used to leave the weight in FP32 (the passes read
    positions only), and adaptive scaling crashed on ``input=x``."""
    x = torch.randn(3, 8)
    grads = {}
    for style in ("positional", "weight=", "input="):
        torch._dynamo.reset()
        records = Records()
        model = _KeywordLinear(style)
        compile_(model, "fp8-e5m2", loss_scale=loss_scale)(x).square().sum().backward()
        roles = sorted(site.role for site in records.only().sites.values())
        assert roles == ["activation", "error", "weight", "weight_grad"], style
        # a call in the root module's forward is named after its weight, not a local variable
        assert {site.layer for site in records.only().sites.values()} == {"w"}
        grads[style] = (model.w.grad, model.b.grad)
    for style, (w, b) in grads.items():  # round to nearest: no stream differs between the graphs
        assert torch.equal(w, grads["positional"][0]) and torch.equal(b, grads["positional"][1]), style
    torch._dynamo.reset()
    records = Records()
    compile_(_KeywordLinear("weight="), "fp8-e5m2", exclude="w")(x).sum().backward()
    assert records.only().sites == {}


@pytest.mark.parametrize("size, contiguous", [(8, True), (16, True), (32, False)])
def test_small_cpu_convolutions_run_without_inductors_channels_last_layout(monkeypatch, size, contiguous):
    """Channels-last conversions cost more than they gain for small images (see
    ``lpcompile.passes.aot.layout``): the backend turns Inductor's layout optimization off
    for graphs whose convolutions all read at most 16x16 pixels (ATen's convolutions:
    ``conv="aten"``, else these small ones become matmuls)."""
    from functorch.compile import make_boxed_func

    seen = []

    def inner(gm, example_inputs, *args, **kwargs):
        seen.append(torch._inductor.config.layout_optimization)  # as compile_fx patched it
        return make_boxed_func(gm)

    stand_in_for_inductor(monkeypatch, inner)
    records = Records()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * size * size, 2)
    )
    x = torch.randn(2, 3, size, size)
    options = {"recipe": "fp8-e5m2-sr", "executor": "inductor", "conv": "aten"}
    with torch._functorch.config.patch(enable_autograd_cache=False):
        step(model, lambda: torch.compile(model, backend="lowprec", options=options)(x))
    assert seen == [not contiguous] * 2  # forward and backward
    expected = {"layout_optimization": False} if contiguous else {}
    assert records.only().inductor_options == {**expected, "cpp_wrapper": True}


@pytest.mark.slow
def test_wrapper_option_sets_inductors_cpp_wrapper_and_changes_no_number(monkeypatch):
    from torch._inductor.compile_fx import compile_fx_inner

    seen = []

    def inner(gm, example_inputs, *args, **kwargs):
        seen.append(torch._inductor.config.cpp_wrapper)  # as compile_fx patched it
        return compile_fx_inner(gm, example_inputs, *args, **kwargs)

    stand_in_for_inductor(monkeypatch, inner)
    results = {}
    for wrapper in ("python", "auto"):  # "auto": C++ on the CPU
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, x = convnet(), convnet_input()
        options = {"recipe": "fp8-e5m2-sr", "executor": "inductor", "wrapper": wrapper}
        with torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(model, backend="lowprec", options=options)
            results[wrapper] = step(model, lambda c=compiled, x=x: c(x))
    assert seen == [False, False, True, True]  # forward and backward of each
    assert_same_step(results["auto"], results["python"], "the same kernels called from C++")


@pytest.mark.slow
def test_cpp_opt_level_is_the_level_the_compiler_builds_at_and_changes_no_number(monkeypatch):
    """Forward and backward build at the level (on GCC with the alias walk bounded);
    compiled again from the caches (as in a new process), the graphs load those builds
    instead of building with Inductor's own flags."""
    import re

    import torch._inductor.cpp_builder as cpp_builder
    from torch._inductor.utils import clear_caches, fresh_cache

    from lpcompile.backend.compile import GCC_ALIAS_WALK_BOUND

    commands = []
    run_compile_cmd = cpp_builder.run_compile_cmd

    def spy(cmd_line, cwd):
        commands.append(cmd_line)
        return run_compile_cmd(cmd_line, cwd)

    monkeypatch.setattr(cpp_builder, "run_compile_cmd", spy)
    results, levels = [], {}
    for level in ("O1", "O3"):  # another level, and the default
        options = {"recipe": "fp8-e5m2-sr", "executor": "inductor", "cpp_opt_level": level}
        with fresh_cache():  # no build of an earlier test's
            for compile_ in ("cold", "cached"):
                torch._dynamo.reset()
                clear_caches()  # the loaded graphs and libraries: only the caches on disk stay
                commands.clear()
                torch.manual_seed(0)
                model, x = mlp(), mlp_input()
                compiled = torch.compile(model, backend="lowprec", options=options)
                results.append(step(model, lambda c=compiled, x=x: c(x)))
                # a graph's build (C++ wrapper); not Inductor's probes of the CPU's vector ISA
                builds = [cmd for cmd in commands if cmd.split()[1].endswith(".main.cpp")]
                # the compiler takes the last level of its command line
                levels[level, compile_] = [re.findall(r"(?<!\S)-(O\d)\b", cmd)[-1] for cmd in builds]
                if cpp_builder.is_gcc():
                    assert all(GCC_ALIAS_WALK_BOUND in cmd for cmd in builds), builds
    assert levels == {
        ("O1", "cold"): ["O1", "O1"],  # forward and backward
        ("O1", "cached"): [],
        ("O3", "cold"): ["O3", "O3"],
        ("O3", "cached"): [],
    }
    for got in results[1:]:
        assert_same_step(got, results[0], "the same kernels built at another level")


@pytest.mark.slow
@pytest.mark.parametrize("threads", [2, 1])
def test_cpp_wrapper_lowers_the_backward_with_the_forward_and_builds_both_off_the_main_thread(
    monkeypatch, threads
):
    """With the C++ wrapper and Inductor's compile threads, the backward is lowered
    before the forward first runs (not at its own first call), and each graph's build runs
    on a compile thread, so that one graph's build overlaps the other's lowering. With
    one compile thread, Inductor's own order: all on the main thread, the backward lowered
    at its first call."""
    import threading

    import torch._inductor.cpp_builder as cpp_builder
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import clear_caches, fresh_cache

    from lpcompile.backend.compile import inductor_graph_kind

    events = []
    run_compile_cmd = cpp_builder.run_compile_cmd

    def spy(cmd_line, cwd):
        if cmd_line.split()[1].endswith(".main.cpp"):  # a graph's build, not a probe of the CPU
            events.append(("built", threading.current_thread() is threading.main_thread()))
        return run_compile_cmd(cmd_line, cwd)

    def inner(gm, example_inputs, *args, **kwargs):
        events.append(("lowered", inductor_graph_kind(kwargs)))
        return compile_fx_inner(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(cpp_builder, "run_compile_cmd", spy)
    stand_in_for_inductor(monkeypatch, inner)
    torch.manual_seed(0)
    model, x = mlp(), mlp_input()
    with torch._inductor.config.patch(compile_threads=threads), fresh_cache():  # no earlier test's builds
        clear_caches()
        compiled = torch.compile(
            model, backend="lowprec", options={"recipe": "fp8-e5m2-sr", "executor": "inductor"}
        )
        loss = compiled(x).square().mean()
        events.append(("forward", "ran"))
        loss.backward()
    assert [what for event, what in events if event == "lowered"] == ["forward", "backward"]
    background = threads > 1
    lowered_first = events.index(("lowered", "backward")) < events.index(("forward", "ran"))
    assert lowered_first == background, events
    assert [event for event in events if event[0] == "built"] == [("built", not background)] * 2, events
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_auto_wrapper_is_cpp_for_cpu_graphs_only():
    cpu, meta = torch.ones(2), torch.ones(2, device="meta")
    assert uses_cpp_wrapper("auto", [cpu, 3]) and not uses_cpp_wrapper("auto", [cpu, meta])
    assert uses_cpp_wrapper("cpp", [meta]) and not uses_cpp_wrapper("python", [cpu])


def two_convs(size: int) -> nn.Sequential:
    """Two convolutions (the second strided, so it computes an input gradient) and a linear."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * (size // 2) ** 2, 3),
    )


@pytest.mark.parametrize(("size", "rewritten"), [(8, True), (32, False)])
def test_conv_input_gradients_read_channels_last_copies_where_inductors_layout_is_off(
    monkeypatch, size, rewritten
):
    """At 8x8 (Inductor's channels-last layout off) the second convolution's backward,
    which computes an input gradient, reads channels-last copies of its error and input;
    the first one (no input gradient) and every one at 32x32 are left alone. The graphs
    Inductor would get, run as FX, give the eager executor's gradients: bit for bit
    where nothing was rewritten, else up to the oneDNN kernel's order of FP32 sums.
    ATen's convolutions (``conv="aten"``): else these small ones become matmuls."""
    received = inductor_runs_fx(monkeypatch)
    model = two_convs(size)
    x = torch.randn(2, 2, size, size, generator=torch.Generator().manual_seed(3))
    options = {"recipe": "fp8-e5m2-sr", "executor": "inductor", "conv": "aten"}
    with torch._functorch.config.patch(enable_autograd_cache=False):
        got = step(model, lambda: torch.compile(model, backend="lowprec", options=options)(x))
    aten = torch.ops.aten

    def channels_last_copy(operand: torch.fx.Node) -> bool:
        memory_format = operand.kwargs.get("memory_format")
        return operand.target is aten.clone.default and memory_format == torch.channels_last

    readers = {
        node.args[10][0]: [channels_last_copy(operand) for operand in node.args[:2]]
        for node in received["backward"].graph.find_nodes(
            op="call_function", target=aten.convolution_backward.default
        )
    }
    assert readers == {False: [False, False], True: [rewritten, rewritten]}
    torch._dynamo.reset()
    expected = step(model, lambda: torch.compile(model, backend="lowprec", options={**options, **EAGER})(x))
    if not rewritten:
        assert_same_step(got, expected)
        return
    assert torch.equal(got[0], expected[0])  # the forward is untouched
    for name, a, b in zip([n for n, _ in model.named_parameters()], got[1], expected[1], strict=True):
        assert_close_through_rounding(a, b, f"grad of {name}")


def test_channels_last_conv_backward_under_inductor_keeps_gradient_layouts():
    """Under Inductor's C++ the rewritten backward gives the eager executor's gradients
    (up to the order of FP32 sums), and the input and weight gradients come back in
    the layout eager gives them, not channels-last."""
    model = two_convs(8)
    x = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(4))
    results = {}
    for executor in ("eager", "inductor"):
        torch._dynamo.reset()
        options = {"recipe": "fp8-e5m2-sr", "executor": executor}
        compiled = torch.compile(model, backend="lowprec", options=options)
        x_in = x.clone().requires_grad_()
        out, grads = step(model, lambda c=compiled, x_in=x_in: c(x_in))
        results[executor] = out, [x_in.grad, *grads]
    assert torch.equal(results["inductor"][0], results["eager"][0])
    for got, want in zip(results["inductor"][1], results["eager"][1], strict=True):
        assert got.stride() == want.stride()
        assert_close_through_rounding(got, want, f"gradient of shape {tuple(got.shape)}")


@pytest.mark.parametrize(
    ("model_dtype", "input_dtype", "message"),
    [
        (torch.float64, torch.float64, r"layer '0' \(linear\) computes in torch.float64; lowprec quantizes"),
        (torch.float32, torch.float16, r"layer '0' \(linear\) multiplies torch.float16 by torch.float32"),
    ],
)
def test_dtypes_lowprec_cannot_compile_are_refused_by_layer(model_dtype, input_dtype, message, capfd):
    """A float64 model's error came after pages of fake-tensor logging; an FP16 input into
    an FP32 model failed inside Inductor with an empty AssertionError."""
    model = mlp().to(model_dtype)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=message):
        compile_(model, "fp8-e5m2-sr", executor="inductor")(mlp_input().to(input_dtype))
    assert "fake_tensor" not in capfd.readouterr().err


def test_no_recipe_compiles_in_fp32_and_says_so():
    """``backend="lowprec"`` without options (as a trainer that passes none compiles) ran
    the model in FP32 silently."""
    with pytest.warns(UserWarning, match=r"no recipe given \(options=.*\): the graph compiles in FP32"):
        torch.compile(mlp(), backend="lowprec")(mlp_input())
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        compile_(mlp(), "fp32")(mlp_input())  # asked for
        torch._dynamo.reset()
        torch.compile(mlp(), backend="lowprec", options={"activation": "e5m2"})(mlp_input())  # rounds


class RotaryTable(nn.Module):
    """Rotary angles computed in float64, as diffusers' Flux computes them."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[0], dtype=torch.float64) + 9  # 9, 11, 13: off the E5M2 grid
        frequencies = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
        angles = torch.outer(positions, frequencies.to(x.device))
        return self.proj(x * torch.cat([angles.cos(), angles.sin()], -1).float())


@pytest.mark.parametrize("executor", ["eager", "inductor"])
def test_a_float64_table_without_gradient_stays_float64_and_is_reported(executor):
    """A float64 product of no parameter and no gradient compiled as written (lowprec refused
    the whole model), with a warning and a coverage row; the model's layers are rounded."""
    model, x = RotaryTable(), torch.randn(6, 8)
    torch._dynamo.reset()
    with pytest.warns(
        UserWarning, match=r"left in float64: outer in 'angles': the model computes it in float64"
    ):
        out = compile_(model, "fp8-e5m2-sr", executor=executor, exclude=["proj"])(x)
    torch.testing.assert_close(out, model(x))  # the angles unrounded (E5M2 would move them by 1e-1)
    rows = lpcompile.coverage(model)
    assert [(r.layer, "float64" in r.kept) for r in rows if r.op == "outer"] == [("angles", True)]
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_(model, "fp8-e5m2-sr", executor=executor)(x).sum().backward()
    assert {r.layer: sorted(r.quantized) for r in lpcompile.coverage(model) if r.quantized} == {
        "proj": ["activation", "error", "weight", "weight_grad"]
    }


def test_a_float64_product_in_the_trained_path_is_still_refused():
    """The float64 operand gets a gradient: the product is part of what trains."""
    model, x = RotaryTable(), torch.randn(6, 8)
    table = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)

    def angles_from(t: torch.Tensor) -> torch.Tensor:
        return model(x) + torch.outer(t.sum(-1), t.sum(0)).sum().float()

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"layer 'outer_1' \(outer\) computes in torch.float64"):
        torch.compile(angles_from, backend="lowprec", options={"recipe": "fp8-e5m2-sr"})(table)


class _Kernel(nn.Module):
    """A product wrapped as a module that a library keeps in a global, outside any model (as
    transformers wraps its kernel functions)."""

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.T


class _Apply(nn.Module):
    """A module kept in a global that calls a module it is given."""

    def forward(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x)


_KERNEL, _APPLY = _Kernel(), _Apply()


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _APPLY(self.out, _KERNEL(self.proj(x), self.w))


def _coverage(model: nn.Module, exclude: list[str]) -> dict[str, LayerCoverage]:
    torch._dynamo.reset()
    options = {"recipe": "fp8-e5m2-sr", "exclude": exclude}
    torch.compile(model, backend="lowprec", options=options)(torch.randn(4, 8)).sum().backward()
    return {row.layer: row for row in lpcompile.coverage(model)}


def test_a_module_held_outside_the_model_is_named_after_the_models_module_that_calls_it():
    """Names match ``named_modules()``, so ``exclude`` patterns of them apply: a global
    module's product is its caller's, a model's module a global module calls is its own;
    in the compiled module's own ``forward``, the product is named after its weight."""
    torch.manual_seed(0)
    model = nn.Sequential(_Mixer(), nn.ReLU(), nn.Linear(8, 4))
    rows = _coverage(model, ["0"])
    assert set(rows) == {"0", "0.proj", "0.out", "2"}
    assert rows["0"].kept and all(rows[name].quantized for name in ("0.proj", "0.out", "2"))
    rows = _coverage(_Mixer(), ["w"])
    assert set(rows) == {"w", "proj", "out"} and rows["w"].kept and rows["out"].quantized


def test_exclude_patterns_that_may_name_a_layer_of_another_graph():
    """What waits for the end of the watched forward: module and parameter names, also from
    a module of the model (a block's graph names its layers from the block), and the calls
    of ``nn.MultiheadAttention``; not a typo."""
    model = torch.compile(nn.Sequential(_BrokenMLP(), nn.MultiheadAttention(8, 2)))
    for pattern in ("0.mid.lin", "mid.lin", "0.*", "1.in_proj_q", "1.attention#1", "out.weight"):
        assert names_in_model(model, pattern), pattern
    for pattern in ("mid.lni", "0.mid.lin.foo", "in_proj_x"):
        assert not names_in_model(model, pattern), pattern
