"""Third-party model code, built from tiny configs with random weights: one training step
under ``fp8-e5m2-sr`` with every matmul-class ATen call's float operands checked on the
E5M2 grid by tests/grid.py (independent of lowprec's records), and layer names that are
the models' own module names."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from grid import (
    GridCheck,
    grid_step,
    on_blockwise,
    on_e5m2_grid,
    on_mx_blocks,
    on_nvfp4_blocks,
    on_scaled_fp8_grid,
    on_scaled_fp8_rows,
    watched_backend,
)
from models import Records

import lpcompile
from examples.zoo import (
    DIFFUSERS_MODELS,
    HF_ARCHITECTURES,
    HF_MODELS,
    TORCH_MODELS,
    diffusers_model,
    hf_model,
    zoo_model,
)
from lpcompile.runtime.pipeline import PipelinedTrainer
from lpcompile.runtime.scaler import LossScaleConfig

pytest.importorskip("transformers")

EAGER = {"recipe": "fp8-e5m2-sr", "executor": "eager"}


def full_step(model: torch.nn.Module, inputs: dict) -> tuple[GridCheck, list[str], set[str]]:
    """One watched step (``attention="full"``): the grid check, lowprec's warnings, and the
    names of the layers rounded (their call numbers dropped)."""
    records = Records()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = grid_step(model, inputs, {**EAGER, "attention": "full"})
    warned = [str(w.message) for w in caught if "lowprec" in str(w.message)]
    return check, warned, {s.layer.split("#")[0] for r in records.new for s in r.sites.values()}


@pytest.mark.parametrize(
    "name", [*HF_MODELS, *(pytest.param(name, marks=pytest.mark.slow) for name in HF_ARCHITECTURES)]
)
def test_hf_model_step_runs_every_product_on_the_grid(name):
    torch.manual_seed(0)
    model, inputs = hf_model(name)
    check, warned, layers = full_step(model, inputs)
    assert check.count > 0 and check.off_grid == {}, check.products
    assert not check.unknown, check.unknown
    assert not warned, warned
    modules = {n for n, _ in model.named_modules()}
    reported = {row.layer.split("#")[0] for row in lpcompile.coverage(model)}
    assert reported and reported <= modules, sorted(reported - modules)
    # wav2vec 2.0's LayerDrop breaks the encoder's loop over its layers: each layer is a frame
    # of its own, whose graph names its layers from it (the reports name them from the model)
    if name != "wav2vec2":
        assert layers and layers <= modules, sorted(layers - modules)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_hf_model_with_dynamic_shapes_runs_every_product_on_the_grid(name):
    """``dynamic=True``: the sequence length and HF's float dropout rates are symbolic;
    at two sequence lengths every product is on the grid."""
    torch.manual_seed(0)
    model, inputs = hf_model(name)
    check = GridCheck()
    torch._dynamo.reset()
    backend = watched_backend({**EAGER, "attention": "full"}, check)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for length in (8, 5):
        out = compiled(**{key: ids[:, :length] for key, ids in inputs.items()})
        with check:
            out.logits.float().square().mean().backward()
    assert check.count > 0 and check.off_grid == {} and not check.unknown, (check.products, check.unknown)


# What a diffusers model computes beyond FP32 on purpose: Flux's rotary angles, per position axis.
FLOAT64_TABLES = {"unet2d": [], "flux": ["pos_embed#0", "pos_embed#1", "pos_embed#2"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", DIFFUSERS_MODELS)
def test_diffusers_model_step_runs_every_product_on_the_grid(name):
    """A diffusion UNet (convolutions, attention blocks) and a Flux transformer (joint
    attention; rotary tables computed in float64, which stay float64)."""
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model, inputs = diffusers_model(name)
    check, warned, layers = full_step(model, inputs)
    assert check.count > 0 and check.off_grid == {} and not check.unknown, check.products
    tables = FLOAT64_TABLES[name]
    found = ", ".join(f"outer in {t!r}" for t in tables)
    said = f"lowprec: products left in float64: {found}: the model computes it in float64, and no gradient"
    assert [w.startswith(said) for w in warned] == ([True] if tables else []), warned
    assert sorted(r.layer for r in lpcompile.coverage(model) if r.kept) == tables
    modules = {n for n, _ in model.named_modules()}
    assert layers and layers <= modules, sorted(layers - modules)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_hf_activation_checkpointing_runs_every_product_on_the_grid(name):
    """``gradient_checkpointing_enable()``: transformers' layers set a context variable in
    their forward, a side effect that made Dynamo run them uncompiled, and their
    recomputation in FP32. With the cache on (the default), transformers logs a warning,
    which Dynamo cannot trace: the layers after it compile as a frame of their own, and
    are still named from the model's root."""
    torch.manual_seed(0)
    model, inputs = hf_model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers: use activation_checkpointing_enable
        model.gradient_checkpointing_enable()
    records = Records()
    check = grid_step(model, inputs, {**EAGER, "attention": "full"})
    assert check.count > 0 and check.off_grid == {} and not check.unknown, check.products
    layers = {s.layer.split("#")[0] for r in records.new for s in r.sites.values()}
    modules = {n for n, _ in model.named_modules()}
    assert layers <= modules and len(layers) > 10, sorted(layers - modules)


def test_exclude_matches_hf_module_names():
    """transformers wraps ``forward`` in decorators; names still start at the model."""
    torch.manual_seed(0)
    model, inputs = hf_model("llama")
    records = Records()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # an exclude pattern that matches nothing warns
        grid_step(model, inputs, {**EAGER, "exclude": ["lm_head"]})
    layers = {s.layer for r in records.new for s in r.sites.values()}
    assert "lm_head" not in layers and "model.layers.0.mlp.up_proj" in layers


@pytest.mark.parametrize("encoder", [False, True], ids=["model", "model-and-encoder"])
def test_an_encoder_decoders_generate_rounds_the_encoder_compiled_in_place(encoder):
    """``generate`` calls the encoder itself, before the model's ``forward``: compiled in place
    with the model, the encoder runs in lowprec graphs, and the model's watch leaves it to
    the encoder's own; without it, the warning names the encoder."""
    torch._dynamo.reset()  # compiled afresh: the watches start at a compile
    torch.manual_seed(0)
    model, inputs = hf_model("t5")
    model.eval().compile(backend="lowprec", options=EAGER)
    if encoder:
        model.get_encoder().compile(backend="lowprec", options=EAGER)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(inputs["input_ids"], max_new_tokens=3, min_new_tokens=3, do_sample=False)
        model.generate(inputs["input_ids"], max_new_tokens=3, min_new_tokens=3, do_sample=False)
    unread = [str(w.message) for w in caught if "no lowprec graph read" in str(w.message)]
    rounded = {row.layer.split(".")[0] for row in lpcompile.coverage(model)}
    if encoder:
        assert not unread and rounded == {"encoder", "decoder", "lm_head"}, (unread, rounded)
    else:
        assert len(unread) == 1 and "encoder.block.0" in unread[0] and rounded == {"decoder", "lm_head"}


@pytest.mark.slow
def test_hf_trainer_trains_a_model_compiled_before_it(tmp_path):
    """HF's Trainer compiles only with the backends accelerate lists: the model is compiled
    in place first (docs/fp8.md), which keeps the ``forward`` whose arguments name the
    columns and labels. Each step's weight gradients, as the optimizer gets them, are on
    the E5M2 grid, and evaluation reports its loss."""
    import transformers as T

    torch.manual_seed(0)
    model, _ = hf_model("gpt2")
    model.compile(backend="lowprec", options={"recipe": "fp8-e5m2-sr"})
    ids = torch.randint(0, 100, (8, 8))
    trained = ("c_attn.weight", "c_fc.weight")  # Conv1D layers (tied embeddings sum two gradients)
    weights = {name: p for name, p in model.named_parameters() if name.endswith(trained)}
    seen = []

    class CheckGradients(T.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen.append({name: on_e5m2_grid(p.grad) for name, p in weights.items()})

    args = T.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        max_grad_norm=0.0,  # clipping would scale the rounded gradients off the grid
        use_cpu=True,
        report_to=[],
        save_strategy="no",
    )
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = T.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:2])
    trainer.add_callback(CheckGradients())
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert len(seen) == 2 and all(all(step.values()) for step in seen) and len(seen[0]) == 4, seen
    assert math.isfinite(trainer.evaluate()["eval_loss"])
    assert lpcompile.coverage(model)  # the model's graphs are lowprec's


def test_peft_lora_runs_on_the_grid_with_peft_module_names():
    """PEFT's LoRA adapters on HF Llama: base layers and adapters on the grid, layer names
    the PeftModel's own (PEFT reaches its modules through a ``__getattr__`` of its own),
    and no weight gradient to round for a frozen base weight; nor an error in the first
    layer, where nothing before the base layer is trained."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model, inputs = hf_model("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(model, lora)
    records = Records()
    check = grid_step(model, inputs, EAGER)
    assert check.count > 0 and check.off_grid == {} and not check.unknown, check.products
    sites = [s for r in records.new for s in r.sites.values()]
    layers = {s.layer.split("#")[0] for s in sites}
    modules = {n for n, _ in model.named_modules()}
    assert layers <= modules, sorted(layers - modules)
    q_proj = "base_model.model.model.layers.{}.self_attn.q_proj"
    roles = {layer: {s.role for s in sites if s.layer == layer} for layer in layers}
    assert roles[f"{q_proj.format(0)}.base_layer"] == {"activation", "weight"}
    assert roles[f"{q_proj.format(1)}.base_layer"] == {"activation", "weight", "error"}
    assert roles[f"{q_proj.format(0)}.lora_A.default"] == {"activation", "weight", "error", "weight_grad"}


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_mixture_of_experts_weights_are_weights_rounded_whole(implementation):
    """Mixtral's experts as grouped matmuls, or with their weights picked per token: the
    expert weights are weights, their gradients rounded."""
    torch.manual_seed(0)
    model, inputs = hf_model("mixtral")
    model.set_experts_implementation(implementation)
    records = Records()
    check = grid_step(model, inputs, EAGER)
    assert check.count > 0 and check.off_grid == {} and not check.unknown, check.products
    roles = {s.role for r in records.new for s in r.sites.values() if ".mlp.experts" in s.layer}
    assert roles == {"activation", "weight", "weight_grad", "error"}
    for layer in model.model.layers:
        assert on_e5m2_grid(layer.mlp.experts.gate_up_proj.grad) and on_e5m2_grid(
            layer.mlp.experts.down_proj.grad
        )


@pytest.mark.parametrize("attention", ["operands", "full"])
@pytest.mark.parametrize("name", sorted(TORCH_MODELS))
def test_torch_model_step_runs_every_product_on_the_grid(name, attention):
    torch.manual_seed(0)
    model, inputs = TORCH_MODELS[name]()
    check = grid_step(model, inputs, {**EAGER, "attention": attention})
    assert check.count > 0 and check.off_grid == {}, check.products


@pytest.mark.parametrize("name", ["gpt2", "llama", "lstm_lm", "checkpointed_mlp"])
def test_adaptive_loss_scaling_step_on_the_grid(name):
    """Per-layer scaling wraps every product's operands: Conv1D's addmm, attention, cells."""
    torch.manual_seed(0)
    model, inputs = zoo_model(name)
    check = grid_step(model, inputs, {"recipe": "fp8-e5m2-als", "executor": "eager", "attention": "full"})
    assert check.count > 0 and check.off_grid == {}, check.products
    layers = [t.layer for t in lpcompile.stats(model)]
    assert len(layers) >= 4 and len(set(layers)) == len(layers), layers


TENSORWISE_FAST = ["gpt2", "llama", "lstm_lm", "checkpointed_mlp"]
TENSORWISE_SLOW = [name for name in [*HF_MODELS, *sorted(TORCH_MODELS)] if name not in TENSORWISE_FAST]


def tensorwise_step_on_the_scaled_grid(model: torch.nn.Module, inputs: dict) -> None:
    options = {"executor": "eager", "attention": "full"}
    check = grid_step(model, inputs, {**options, "recipe": "fp8-tensorwise"}, GridCheck(on_scaled_fp8_grid))
    assert check.count > 0 and check.off_grid == {}, check.products
    assert not check.unknown, check.unknown
    # unscaled E4M3 operands are not on it (so the check can fail)
    check = grid_step(model, inputs, {**options, "recipe": "fp8-hybrid"}, GridCheck(on_scaled_fp8_grid))
    assert check.off_grid, check.products


@pytest.mark.parametrize("name", TENSORWISE_FAST)
def test_tensorwise_scaling_step_runs_every_product_on_the_scaled_grid(name):
    """Each operand scaled to its format's range: Conv1D's addmm, attention, cells, checkpoints."""
    torch.manual_seed(0)
    tensorwise_step_on_the_scaled_grid(*zoo_model(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", TENSORWISE_SLOW + list(DIFFUSERS_MODELS))
def test_tensorwise_scaling_step_of_every_zoo_model_on_the_scaled_grid(name):
    """The rest of the zoo: mixture of experts, T5, Longformer, convolutional models, GRU,
    einsum attention, nn.TransformerEncoder, diffusers' UNet and Flux."""
    if name in DIFFUSERS_MODELS:
        pytest.importorskip("diffusers")
    torch.manual_seed(0)
    tensorwise_step_on_the_scaled_grid(
        *(diffusers_model(name) if name in DIFFUSERS_MODELS else zoo_model(name))
    )


# fp8-rowwise with factors that are not powers of two, which the check tells from per-tensor ones
ROWWISE = {
    "recipe": "fp8-rowwise",
    "executor": "eager",
    "attention": "full",
    **{role: {"scaling": "rowwise"} for role in ("weight", "activation", "error")},
}


def rowwise_step_on_the_row_grid(model: torch.nn.Module, inputs: dict) -> None:
    check = grid_step(model, inputs, ROWWISE, GridCheck(on_operand=on_scaled_fp8_rows))
    assert check.count > 0 and check.off_grid == {}, check.products
    assert not check.unknown, check.unknown
    # per-tensor factors are not per row (so the check can fail)
    options = {**ROWWISE, **{role: {"scaling": "tensorwise"} for role in ("weight", "activation", "error")}}
    check = grid_step(model, inputs, options, GridCheck(on_operand=on_scaled_fp8_rows))
    assert check.off_grid, check.products


@pytest.mark.parametrize("name", TENSORWISE_FAST)
def test_rowwise_scaling_step_runs_every_matmul_on_its_rows(name):
    """Each matmul's operands scaled per row of the dimension it sums over, forward and
    backward: Conv1D's addmm, attention written out, cells, checkpoint bodies."""
    torch.manual_seed(0)
    rowwise_step_on_the_row_grid(*zoo_model(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", TENSORWISE_SLOW + list(DIFFUSERS_MODELS))
def test_rowwise_scaling_step_of_every_zoo_model_on_the_row_grid(name):
    """The rest of the zoo: mixture of experts (grouped matmuls), T5, Longformer, GRU, einsum
    attention, nn.TransformerEncoder; convolutions per tensor (ResNet, MobileNetV2, the UNet)."""
    if name in DIFFUSERS_MODELS:
        pytest.importorskip("diffusers")
    torch.manual_seed(0)
    rowwise_step_on_the_row_grid(*(diffusers_model(name) if name in DIFFUSERS_MODELS else zoo_model(name)))


# recipe -> the check of a model's operands
BLOCK_CHECKS = {
    "mxfp8": lambda model: on_mx_blocks,
    "nvfp4": lambda model: on_nvfp4_blocks,
    "fp8-blockwise": on_blockwise,
}


# (fp8-blockwise's blocks and tiles are checked on layers wider than 128 in the fast tier)
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4", pytest.param("fp8-blockwise", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["gpt2", "llama", "lstm_lm", "mixtral"])
def test_block_scaled_step_runs_every_matmul_on_its_blocks(name, recipe):
    """Each matmul's operands in MX blocks of 32, NVFP4 blocks of 16 or DeepSeek's blocks of
    128 (its weights in tiles of 128 x 128) along the dimension it sums over, forward and
    backward (the experts' grouped matmuls too); unrounded operands are not on them, nor
    (DeepSeek's) activations scaled per tensor."""
    torch.manual_seed(0)
    model, inputs = zoo_model(name)
    options = {"recipe": recipe, "executor": "eager", "attention": "full"}
    on_blocks = BLOCK_CHECKS[recipe](model)
    check = grid_step(model, inputs, options, GridCheck(on_operand=on_blocks))
    assert check.count > 0 and check.off_grid == {}, check.products
    assert not check.unknown, check.unknown
    check = grid_step(model, inputs, {**options, "recipe": "fp32"}, GridCheck(on_operand=on_blocks))
    assert check.off_grid, check.products
    if recipe == "fp8-blockwise":
        per_tensor = {**options, "activation": {"scaling": "tensorwise"}}
        check = grid_step(model, inputs, per_tensor, GridCheck(on_operand=on_blocks))
        assert check.off_grid, check.products


# option -> what its warning says of Mixtral's first experts
EXPERTS_SAID = {
    "wgrad_hadamard": (
        r"wgrad_hadamard: .*'model\.layers\.0\.mlp\.experts#0' \(inside transformers::grouped_mm_fallback"
    ),
    "fp8-rowwise-gw-hp": (
        r"per-matmul options reach no matmul of 'model\.layers\.0\.mlp\.experts#0'"
        r" \(transformers\.grouped_mm_fallback_backward\.default; activation_for_weight_grad"
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"recipe": "nvfp4-2d", "wgrad_hadamard": True}, EXPERTS_SAID["wgrad_hadamard"]),
        ({"recipe": "fp8-rowwise-gw-hp"}, EXPERTS_SAID["fp8-rowwise-gw-hp"]),
    ],
)
def test_options_for_weight_gradients_name_experts_whose_backward_transformers_computes(options, said):
    """Mixtral's experts on the CPU run transformers' own grouped-matmul operator, whose
    backward computes their gradients inside: no Hadamard transform, no per-matmul
    roundings, and a warning naming them; none for experts kept out by ``exclude``."""
    options = {**options, "executor": "eager"}
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=said):
        grid_step(*zoo_model("mixtral"), options)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grid_step(*zoo_model("mixtral"), {**options, "exclude": ["*experts*"]})
    assert not [w for w in caught if "grouped_mm_fallback" in str(w.message)]


class Logits(torch.nn.Module):
    """An HF language model's logits for token ids, its output embedding untied from its input
    one: a pipeline stage owns each weight it reads."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        if (head := model.get_output_embeddings()) is not None:
            head.weight = torch.nn.Parameter(head.weight.detach().clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def watch_pipeline(monkeypatch, forward: GridCheck, backward: GridCheck) -> None:
    """Run the pipeline trainer's lowprec stages under ``forward``, its backward passes
    under ``backward``."""
    compile_, autograd_backward = torch.compile, torch.autograd.backward

    def compile_watched(model, *, backend=None, options=None, **kwargs):
        if backend == "lowprec":
            backend, options = watched_backend(options, forward), None
        return compile_(model, backend=backend, options=options, **kwargs)

    def backward_watched(*args, **kwargs):
        with backward:
            return autograd_backward(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_watched)
    monkeypatch.setattr(torch.autograd, "backward", backward_watched)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_pipelined_backprop_runs_every_product_of_an_hf_model_on_the_grid(monkeypatch, name):
    """Pipelined backpropagation in three FP8 stages with dynamic loss scales per stage,
    from a scale whose errors overflow E5M2 at the loss: every product of every stage,
    forward and backward, on the grid, the loss finite at every step, and the weights
    finite after the updates the overflows let through."""
    forward, backward = GridCheck(), GridCheck()
    watch_pipeline(monkeypatch, forward, backward)
    torch.manual_seed(0)
    model = Logits(hf_model(name)[0])
    ids = torch.randint(0, 100, (8, 8))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    options = {**EAGER, "attention": "full"}  # GPT-2's attention dropout: the math path on the CPU
    scaling = LossScaleConfig("dynamic", init_scale=2.0**24, growth_interval=2)
    trainer = PipelinedTrainer(
        model, ids[:1], stages=3, lr=0.01, loss_fn=loss_fn, compile=options, loss_scale=scaling
    )
    losses = trainer.fit(ids, ids.roll(-1, dims=1))
    assert len(losses) == 8 and all(map(math.isfinite, losses)), losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.skipped_samples[2] > 0 and trainer.loss_scales[2] < 2.0**24, trainer.loss_scales
    for check in (forward, backward):
        assert check.count > 0 and check.off_grid == {} and not check.unknown, check.products
