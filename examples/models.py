"""Small models for the demo, tests and benchmarks."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn


class DigitsCNN(nn.Sequential):
    """A small CNN for 8x8 digits, GroupNorm instead of BatchNorm.

    Down-sampling is a strided convolution rather than max-pooling, whose
    backward Inductor compiles slowly for CPUs.
    """

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__(
            nn.Conv2d(1, width, 3, padding=1),
            nn.GroupNorm(4, width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.GroupNorm(4, 2 * width),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(2 * width * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, classes),
        )


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm, added to the input (a 1x1 convolution where
    the shape changes): a ResNet basic block without BatchNorm."""

    def __init__(self, cin: int, cout: int, stride: int = 1, groups: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.skip = None
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride), nn.GroupNorm(groups, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + (x if self.skip is None else self.skip(x)))


class DigitsResNet(nn.Module):
    """A small ResNet for 8x8 digits (GroupNorm): a stem, two residual blocks (the second
    halves the resolution) and a linear classifier on the flattened 4x4 maps (global
    average pooling loses too much of 8x8 digits). Pipelined in four balanced stages, the
    blocks' skip connections cross stage boundaries."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.GroupNorm(4, width), nn.ReLU())
        self.block1 = ResidualBlock(width, width)
        self.block2 = ResidualBlock(width, 2 * width, stride=2)
        self.head = nn.Linear(2 * width * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(self.stem(x)))
        return self.head(x.flatten(1))


class DigitsDeepResNet(nn.Module):
    """A deeper ResNet for 8x8 digits (GroupNorm) for pipelining one stage per layer: a stem,
    ``blocks`` residual blocks at 8x8 with ``width`` channels, ``blocks`` at 4x4 with
    ``2*width`` (the first halves the resolution, with a 1x1 convolution on its skip) and a
    linear classifier on the flattened 4x4 maps. With ``stages="layer"`` every convolution
    and the classifier is a stage: S = 4*blocks + 3, delays up to 2(S-1) (20 for
    ``blocks=2``)."""

    def __init__(self, width: int = 8, blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.GroupNorm(4, width), nn.ReLU())
        wide = [ResidualBlock(2 * width, 2 * width) for _ in range(blocks - 1)]
        self.blocks = nn.Sequential(
            *(ResidualBlock(width, width) for _ in range(blocks)),
            ResidualBlock(width, 2 * width, stride=2),
            *wide,
        )
        self.head = nn.Linear(2 * width * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).flatten(1))


class PlainBlock(nn.Module):
    """``x + conv2(relu(conv1(x)))``: a residual block without normalisation, its second
    convolution's weights scaled by ``branch_gain`` at initialisation and its bias zero."""

    def __init__(self, width: int, branch_gain: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        with torch.no_grad():
            self.conv2.weight.mul_(branch_gain)
            self.conv2.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.relu(self.conv1(x)))


class UnnormalizedResNet(nn.Module):
    """A deep residual CNN for 8x8 digits without normalisation: a stem convolution,
    ``depth`` :class:`PlainBlock` s at full resolution (branches scaled by depth^-1/2 at
    initialisation, which bounds the forward's growth as normalisation would), a strided
    convolution and a linear classifier. Its layers' errors spread over several binades
    by themselves (no artificial decay)."""

    def __init__(self, depth: int = 6, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.blocks = nn.Sequential(*(PlainBlock(width, depth**-0.5) for _ in range(depth)))
        self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.head = nn.Linear(2 * width * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.blocks(self.stem(x)))
        return self.head(torch.relu(self.down(x)).flatten(1))


class MLP(nn.Sequential):
    """A plain ReLU MLP, e.g. ``MLP(784, 1024, 1024, 10)``."""

    def __init__(self, *sizes: int) -> None:
        layers: list[nn.Module] = [nn.Flatten()]
        for fan_in, fan_out in itertools.pairwise(sizes):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        super().__init__(*layers[:-1])


class ScaleBackward(nn.Module):
    """The identity in the forward; multiplies the error by ``factor`` in the backward.

    ``x.detach() + (x - x.detach()) * factor``: the forward adds an exact zero.
    """

    def __init__(self, factor: float) -> None:
        super().__init__()
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fixed = x.detach()
        return fixed + (x - fixed) * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor:g}"


class DeepTanhMLP(nn.Sequential):
    """A deep, narrow tanh MLP whose backward errors shrink layer by layer.

    ``gain`` multiplies PyTorch's default Linear init; below about 1.7 each
    layer shrinks the backward error (about 0.8 per layer at 1.5, 0.6 at 1.2),
    so the lowest layers' errors sit binades below the top ones: the case
    per-layer loss scaling exists for. Adam's updates adapt the weights until the
    forward and backward no longer shrink; ``error_decay`` < 1 keeps the backward
    shrinking by that factor per hidden layer (a :class:`ScaleBackward` after each
    tanh) while the forward, and so FP32 training with Adam (invariant to a
    gradient's scale, up to its ``eps``), stay as they are.
    """

    def __init__(
        self,
        depth: int = 12,
        width: int = 32,
        inputs: int = 64,
        classes: int = 10,
        gain: float = 1.5,
        error_decay: float = 1.0,
    ) -> None:

        def hidden(fan_in: int) -> list[nn.Module]:
            decay = [ScaleBackward(error_decay)] if error_decay != 1.0 else []
            return [nn.Linear(fan_in, width), nn.Tanh(), *decay]

        layers: list[nn.Module] = [nn.Flatten(), *hidden(inputs)]
        for _ in range(depth - 2):
            layers += hidden(width)
        super().__init__(*layers, nn.Linear(width, classes))
        with torch.no_grad():
            for layer in self:
                if isinstance(layer, nn.Linear):
                    layer.weight.mul_(gain)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class GPTBlock(nn.Module):
    """A pre-norm transformer block: attention and a 4x GELU MLP, each on a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A GPT-style language model: token and position embeddings, ``depth`` blocks in
    ``self.blocks`` (the unit FSDP2 shards), a final LayerNorm and an untied output layer
    (an ``nn.Linear``: a product written in the root's ``forward`` would stay FP32 under
    FSDP2, docs/distributed.md). ``ids`` of shape ``(batch, time ≤ context)`` give logits
    of shape ``(batch, time, vocab)``."""

    def __init__(self, vocab: int = 256, width: int = 64, depth: int = 3, heads: int = 4, context: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
