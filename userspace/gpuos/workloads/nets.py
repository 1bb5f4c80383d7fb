"""The suite's PyTorch models: ResNet-50 (torchvision's, or a copy of its shape) and a GPT.

Imported only by the suite's PyTorch workloads, so that the CuPy ones never load torch.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GlobalAvgPool(nn.Module):
    """ResNet's final pooling as a mean: the backward of nn.AdaptiveAvgPool2d has no
    deterministic CUDA implementation (torch.use_deterministic_algorithms refuses it);
    a mean over H and W computes the same thing and its backward is an expand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3), keepdim=True)


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 block (v1.5: the stride is on the 3x3 convolution)."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)), inplace=True)
        y = F.relu(self.bn2(self.conv2(y)), inplace=True)
        return F.relu(self.bn3(self.conv3(y)) + identity, inplace=True)


class ResNet50(nn.Module):
    """The same layers, shapes and initialisation as torchvision.models.resnet50()."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        self.blocks = nn.Sequential(*blocks)
        self.avgpool = GlobalAvgPool()
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.avgpool(self.blocks(self.stem(x))), 1))


def resnet50() -> tuple[nn.Module, str]:
    """A randomly initialised ResNet-50 and which implementation it is."""
    try:
        from torchvision.models import resnet50 as tv_resnet50
    except (ImportError, RuntimeError):  # RuntimeError: a torchvision built for another torch
        return ResNet50(), "builtin"
    model = tv_resnet50()
    model.avgpool = GlobalAvgPool()
    return model, "torchvision"


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-2-style decoder-only transformer (learned positions, tied embeddings)."""

    def __init__(self, vocab: int, seq: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Logits for every position, or (inference, a prefill) for the next token only."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.head(x[:, -1] if last_only else x)
