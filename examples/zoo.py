"""The model zoo: third-party and torch.nn models as users build them, from tiny
configs with random weights, each with one batch of inputs. The zoo tests
(tests/zoo/) and ``benchmarks/bench_zoo.py`` use it; HF models need ``transformers``,
diffusion models ``diffusers``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

HF_MODELS = ("gpt2", "bert", "llama", "mixtral", "t5", "longformer", "vit", "resnet", "mobilenet_v2")
# Other families' attention and mixing layers (the slow tier's): sliding windows, QK norms,
# disentangled relative attention, ALiBi in baddbmm, encoder-decoders over text and audio,
# shifted windows, convolutional audio features, state-space scans
HF_ARCHITECTURES = (
    "qwen3",
    "gemma3",
    "mistral",
    "deberta_v2",
    "bloom",
    "bart",
    "whisper",
    "swin",
    "wav2vec2",
    "mamba",
    "mamba2",
)


def hf_model(name: str) -> tuple[nn.Module, dict]:
    """An HF ``transformers`` model from a tiny config with random weights, and its inputs."""
    import transformers as T

    ids = torch.randint(0, 100, (2, 8))
    images = torch.randn(2, 3, 32, 32)
    small = dict(vocab_size=100, max_position_embeddings=16)
    if name == "gpt2":
        config = T.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0
        )
        return T.GPT2LMHeadModel(config), {"input_ids": ids}
    if name == "bert":
        layers = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
        config = T.BertConfig(**layers, **small)
        return T.BertForMaskedLM(config), {"input_ids": ids}
    if name == "llama":
        layers = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        config = T.LlamaConfig(**layers, intermediate_size=64, **small)
        return T.LlamaForCausalLM(config), {"input_ids": ids}
    if name == "mixtral":  # mixture of experts: the experts' grouped matmuls
        layers = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        config = T.MixtralConfig(
            **layers, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **small
        )
        return T.MixtralForCausalLM(config), {"input_ids": ids}
    if name == "t5":
        config = T.T5Config(
            vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
        )
        return T.T5ForConditionalGeneration(config), {"input_ids": ids, "decoder_input_ids": ids}
    if name == "longformer":  # sliding-window attention: einsum of an operand list, bmm
        layers = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
        config = T.LongformerConfig(**layers, attention_window=4, vocab_size=100, max_position_embeddings=32)
        return T.LongformerForMaskedLM(config), {"input_ids": ids % 98 + 2}  # not 0, 1 (start, padding)
    if name == "vit":
        layers = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
        config = T.ViTConfig(image_size=32, patch_size=8, num_labels=10, **layers)
        return T.ViTForImageClassification(config), {"pixel_values": images}
    if name == "resnet":
        config = T.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
        return T.ResNetForImageClassification(config), {"pixel_values": images}
    if name == "mobilenet_v2":
        config = T.MobileNetV2Config(image_size=32, depth_multiplier=0.25, num_labels=10)
        return T.MobileNetV2ForImageClassification(config), {"pixel_values": images}
    return _hf_architecture(name, ids, images)


def _hf_architecture(name: str, ids: torch.Tensor, images: torch.Tensor) -> tuple[nn.Module, dict]:
    """One of :data:`HF_ARCHITECTURES`, as :func:`hf_model` builds it."""
    import transformers as T

    small = dict(vocab_size=100, max_position_embeddings=16)
    layers = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    decoder = dict(num_key_value_heads=2, head_dim=8, sliding_window=4, **layers, **small)
    if name == "qwen3":  # QK norms, grouped-query attention
        return T.Qwen3ForCausalLM(T.Qwen3Config(**decoder)), {"input_ids": ids}
    if name == "gemma3":  # a sliding-window layer and a global one, QK norms
        config = T.Gemma3TextConfig(**decoder, layer_types=["sliding_attention", "full_attention"])
        return T.Gemma3ForCausalLM(config), {"input_ids": ids}
    if name == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**decoder)), {"input_ids": ids}
    if name == "deberta_v2":  # disentangled attention: content-to-position products, gathered
        relative = dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=4)
        config = T.DebertaV2Config(**layers, **small, **relative, max_relative_positions=16)
        return T.DebertaV2ForMaskedLM(config), {"input_ids": ids}
    if name == "bloom":  # ALiBi added by baddbmm
        config = T.BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4)
        return T.BloomForCausalLM(config), {"input_ids": ids}
    seq2seq = dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4)
    seq2seq.update(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100)
    if name == "bart":
        config = T.BartConfig(**seq2seq, max_position_embeddings=16)
        return T.BartForConditionalGeneration(config), {"input_ids": ids, "decoder_input_ids": ids}
    if name == "whisper":  # log-mel frames through two convolutions, then an encoder-decoder
        tokens = dict(decoder_start_token_id=0, pad_token_id=0, bos_token_id=0, eos_token_id=0)
        config = T.WhisperConfig(
            **seq2seq, **tokens, num_mel_bins=8, max_source_positions=8, max_target_positions=16
        )
        inputs = {"input_features": torch.randn(2, 8, 16), "decoder_input_ids": ids}
        return T.WhisperForConditionalGeneration(config), inputs
    if name == "swin":  # attention in shifted windows, relative position bias
        stages = dict(depths=[2, 2], num_heads=[2, 2], window_size=4)  # each stage's second block shifts
        config = T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, **stages, num_labels=10)
        return T.SwinForImageClassification(config), {"pixel_values": images}
    if name == "wav2vec2":  # convolutional feature encoder, grouped positional convolution, CTC head
        config = T.Wav2Vec2Config(
            **layers,
            vocab_size=32,
            conv_dim=(16, 16),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=4,
            mask_time_prob=0.0,
        )
        return T.Wav2Vec2ForCTC(config), {"input_values": torch.randn(2, 400)}
    ssm = dict(vocab_size=100, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    if name == "mamba":  # selective scan (associative under compile), depthwise convolution
        return T.MambaForCausalLM(T.MambaConfig(**ssm, time_step_rank=4)), {"input_ids": ids}
    if name == "mamba2":  # chunked state-space duality: einsum products within and across chunks
        config = T.Mamba2Config(**ssm, head_dim=8, num_heads=8, n_groups=1, chunk_size=4, time_step_rank=4)
        return T.Mamba2ForCausalLM(config), {"input_ids": ids}
    raise ValueError(name)


DIFFUSERS_MODELS = ("unet2d", "flux")


def diffusers_model(name: str) -> tuple[nn.Module, dict]:
    """A ``diffusers`` denoiser from a tiny config with random weights, and its inputs."""
    import diffusers as D

    timesteps = torch.tensor([3, 7])
    if name == "unet2d":  # DDPM's UNet: convolutions, group norms, self-attention blocks
        model = D.UNet2DModel(
            sample_size=16,
            block_out_channels=(8, 16),
            layers_per_block=1,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=4,
            attention_head_dim=8,
        )
        return model, {"sample": torch.randn(2, 3, 16, 16), "timestep": timesteps}
    if name == "flux":  # a rectified-flow transformer: joint text-image attention, rotary tables in float64
        model = D.FluxTransformer2DModel(
            in_channels=8,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            pooled_projection_dim=8,
            axes_dims_rope=(2, 2, 4),
        )
        inputs = {
            "hidden_states": torch.randn(2, 16, 8),
            "encoder_hidden_states": torch.randn(2, 5, 16),
            "pooled_projections": torch.randn(2, 8),
            "timestep": timesteps / 10,
            "img_ids": torch.zeros(16, 3),
            "txt_ids": torch.zeros(5, 3),
        }
        return model, inputs
    raise ValueError(name)


def output_tensor(out: object) -> torch.Tensor:
    """The tensor a zoo model's output holds: HF's ``logits``, diffusers' ``sample``, or itself."""
    for field in ("logits", "sample"):
        if hasattr(out, field):
            return getattr(out, field)
    return out


class EinsumAttention(nn.Module):
    """Attention written with einsum and baddbmm, as some research code does."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        bias = torch.zeros(x.shape[0], x.shape[1], x.shape[1])
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=0.25)
        return self.out(torch.einsum("bij,bjd->bid", scores.softmax(-1), v))


class RecurrentLM(nn.Module):
    def __init__(self, cell: type[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.rnn = cell(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(ids))[0])


class CheckpointedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(3)
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


TORCH_MODELS: dict[str, Callable[[], tuple[nn.Module, dict]]] = {
    "transformer_encoder": lambda: (
        # no dropout: with dropout, torch runs CPU attention as its math decomposition, whose
        # inner products (probabilities) attention="operands" leaves alone by definition
        nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True), 2),
        {"src": torch.randn(2, 8, 32)},
    ),
    "einsum_attention": lambda: (EinsumAttention(), {"x": torch.randn(2, 8, 16)}),
    "lstm_lm": lambda: (RecurrentLM(nn.LSTM), {"ids": torch.randint(0, 50, (4, 6))}),
    "gru_lm": lambda: (RecurrentLM(nn.GRU), {"ids": torch.randint(0, 50, (4, 6))}),
    "checkpointed_mlp": lambda: (CheckpointedMLP(), {"x": torch.randn(8, 16)}),
}


def zoo_model(name: str) -> tuple[nn.Module, dict]:
    """Any zoo model by name (HF, diffusers or torch.nn), with its inputs."""
    if name in HF_MODELS:
        return hf_model(name)
    return diffusers_model(name) if name in DIFFUSERS_MODELS else TORCH_MODELS[name]()


ZOO: tuple[str, ...] = (*HF_MODELS, *DIFFUSERS_MODELS, *sorted(TORCH_MODELS))
