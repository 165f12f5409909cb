"""Small image classifiers defined in the project (torchvision cannot be used beside the pinned CPU torch),
their training loop, and structured channel pruning that rebuilds layers smaller.

Every model here is rebuilt from its constructor arguments (`config()`), so a pruned model is the same
class with narrower widths, saved as a state dict plus those arguments like any other torch-module source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F


def _conv_bn(cin: int, cout: int, stride: int = 1, k: int = 3) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False), nn.BatchNorm2d(cout)


class SmallCNN(nn.Module):
    """Plain CNN: per width a 3x3 conv, batch norm, ReLU and 2x2 max pool; global average pool; linear."""

    def __init__(self, n_classes: int = 10, in_channels: int = 1, widths: tuple[int, ...] | list[int] = (16, 32, 64)) -> None:
        super().__init__()
        self.n_classes, self.in_channels, self.widths = n_classes, in_channels, [int(w) for w in widths]
        convs, bns = [], []
        cin = in_channels
        for w in self.widths:
            c, b = _conv_bn(cin, w)
            convs.append(c)
            bns.append(b)
            cin = w
        self.convs, self.bns = nn.ModuleList(convs), nn.ModuleList(bns)
        self.fc = nn.Linear(cin, n_classes)

    def config(self) -> dict[str, Any]:
        return {"n_classes": self.n_classes, "in_channels": self.in_channels, "widths": list(self.widths)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, bn in zip(self.convs, self.bns):
            x = F.max_pool2d(F.relu(bn(conv(x))), 2)
        return self.fc(x.mean(dim=(2, 3)))

    def prune_channels(self, keep_ratio: float) -> "SmallCNN":
        """A new, narrower SmallCNN: each conv keeps its `keep_ratio` highest-L1 output channels."""
        keeps = [_top_l1(conv.weight, keep_ratio) for conv in self.convs]
        small = SmallCNN(self.n_classes, self.in_channels, [len(k) for k in keeps])
        prev = torch.arange(self.in_channels)
        for i, keep in enumerate(keeps):
            _copy_conv(self.convs[i], small.convs[i], keep, prev)
            _copy_bn(self.bns[i], small.bns[i], keep)
            prev = keep
        small.fc.weight.data = self.fc.weight.data[:, prev].clone()
        small.fc.bias.data = self.fc.bias.data.clone()
        return small


class _Block(nn.Module):
    """Residual basic block; `inner` is the width between its two convs (what pruning narrows)."""

    def __init__(self, cin: int, cout: int, inner: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, inner, stride)
        self.conv2, self.bn2 = _conv_bn(inner, cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            conv, bn = _conv_bn(cin, cout, stride, k=1)
            self.short = nn.Sequential(conv, bn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class SmallResNet(nn.Module):
    """Residual network: a 3x3 stem, one stride-2 basic block per width, average pool, linear.

    `inner` (the widths between each block's two convs) and `stem` (the stem's width) default to `widths`
    and `widths[0]`; pruning narrows them."""

    def __init__(
        self,
        n_classes: int = 10,
        in_channels: int = 1,
        widths: tuple[int, ...] | list[int] = (16, 32, 64),
        inner: tuple[int, ...] | list[int] | None = None,
        stem: int | None = None,
    ) -> None:
        super().__init__()
        self.n_classes, self.in_channels, self.widths = n_classes, in_channels, [int(w) for w in widths]
        self.inner = [int(w) for w in (inner or self.widths)]
        self.stem_width = int(stem or self.widths[0])
        self.stem, self.stem_bn = _conv_bn(in_channels, self.stem_width)
        blocks = []
        cin = self.stem_width
        for w, m in zip(self.widths, self.inner):
            blocks.append(_Block(cin, w, m, 2))
            cin = w
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, n_classes)

    def config(self) -> dict[str, Any]:
        return {"n_classes": self.n_classes, "in_channels": self.in_channels, "widths": list(self.widths), "inner": list(self.inner), "stem": self.stem_width}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))

    def prune_channels(self, keep_ratio: float) -> "SmallResNet":
        """A new, narrower SmallResNet: the stem, every block's inner channels and every block's outputs keep
        their `keep_ratio` highest-L1 channels.

        A block's output is the sum of its second conv and its shortcut, so both are cut to the same channels
        (ranked by the L1 norm of the two convs' rows together), and the next block's two input convs, or the
        classifier, read only those. This works because every block here has a projection shortcut (each
        has stride 2): an identity shortcut would tie a block's outputs to its inputs."""
        stem_keep = _top_l1(self.stem.weight, keep_ratio)
        inner_keeps = [_top_l1(b.conv1.weight, keep_ratio) for b in self.blocks]
        out_keeps = [_top_l1(torch.cat([b.conv2.weight.flatten(1), b.short[0].weight.flatten(1)], 1), keep_ratio) for b in self.blocks]
        small = SmallResNet(self.n_classes, self.in_channels, [len(k) for k in out_keeps], [len(k) for k in inner_keeps], stem=len(stem_keep))
        _copy_conv(self.stem, small.stem, stem_keep, torch.arange(self.in_channels))
        _copy_bn(self.stem_bn, small.stem_bn, stem_keep)
        prev = stem_keep
        for big, sm, inner, out in zip(self.blocks, small.blocks, inner_keeps, out_keeps):
            _copy_conv(big.conv1, sm.conv1, inner, prev)
            _copy_bn(big.bn1, sm.bn1, inner)
            _copy_conv(big.conv2, sm.conv2, out, inner)
            _copy_bn(big.bn2, sm.bn2, out)
            _copy_conv(big.short[0], sm.short[0], out, prev)
            _copy_bn(big.short[1], sm.short[1], out)
            prev = out
        small.fc.weight.data = self.fc.weight.data[:, prev].clone()
        small.fc.bias.data = self.fc.bias.data.clone()
        return small


CHANNEL_ALIGN = 8


def kept_channels(n: int, keep_ratio: float) -> int:
    """How many of `n` channels pruning keeps: `keep_ratio` of them rounded to a multiple of CHANNEL_ALIGN (8).

    ONNX Runtime's CPU convolutions work on blocks of 8 or 16 channels. Measured side by side here (SmallResNet,
    1 thread): widths [13, 26, 51] ran 69 µs at batch 1 and 1,907 µs at batch 32 in fp32 (int8: 58 / 1,253),
    slower than the larger [16, 32, 64] (50 / 1,299; int8 41 / 796); [16, 24, 48] was the fastest (47 / 1,223;
    int8 40 / 749). A count of 4 or fewer, or a layer narrower than 8 channels, stays as rounded: aligning it
    would double it."""
    k = max(1, int(round(n * keep_ratio)))
    if n >= CHANNEL_ALIGN and k > CHANNEL_ALIGN // 2:
        k = max(CHANNEL_ALIGN, int(round(k / CHANNEL_ALIGN)) * CHANNEL_ALIGN)
    return min(n, k)


def _top_l1(weight: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """Indices (ascending) of the output channels with the largest L1 norm (how many: kept_channels)."""
    n = weight.shape[0]
    k = kept_channels(n, keep_ratio)
    norms = weight.detach().abs().reshape(n, -1).sum(1)
    return torch.sort(torch.topk(norms, k).indices).values


def _copy_conv(src: nn.Conv2d, dst: nn.Conv2d, out_idx: torch.Tensor, in_idx: torch.Tensor) -> None:
    dst.weight.data = src.weight.data[out_idx][:, in_idx].clone()


def _copy_bn(src: nn.BatchNorm2d, dst: nn.BatchNorm2d, idx: torch.Tensor) -> None:
    for name in ("weight", "bias"):
        getattr(dst, name).data = getattr(src, name).data[idx].clone()
    for name in ("running_mean", "running_var"):
        getattr(dst, name).data = getattr(src, name).data[idx].clone()


def n_parameters(model: nn.Module) -> int:
    return int(sum(p.numel() for p in model.parameters()))


# --- training ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainData:
    """Training images already preprocessed to float32 [N, C, H, W], and their labels."""

    x: torch.Tensor
    y: torch.Tensor


def _shift(x: torch.Tensor, gen: torch.Generator, max_shift: int = 2) -> torch.Tensor:
    """Random translation by up to `max_shift` pixels (zero padding): cheap augmentation for small images."""
    dx, dy = (int(v) for v in torch.randint(-max_shift, max_shift + 1, (2,), generator=gen))
    return torch.roll(x, shifts=(dy, dx), dims=(2, 3))


def train(
    model: nn.Module,
    data: TrainData,
    epochs: int,
    lr: float,
    *,
    teacher: Callable[[torch.Tensor], torch.Tensor] | None = None,
    temperature: float = 4.0,
    soft_weight: float = 0.0,
    batch_size: int = 32,
    seed: int = 0,
    threads: int = 2,
) -> nn.Module:
    """Adam with a cosine schedule and random shifts; with a `teacher` (preprocessed images -> logits), the loss mixes
    the KL divergence to the softened teacher outputs on the same shifted batch (Hinton et al.) with cross-entropy."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train(model, data, epochs, lr, teacher, temperature, soft_weight, batch_size, seed)
    finally:
        torch.set_num_threads(previous)


def _train(model, data, epochs, lr, teacher, temperature, soft_weight, batch_size, seed):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * ((len(data.x) + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, steps))
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(data.x), generator=gen)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            xb = _shift(data.x[idx], gen)
            logits = model(xb)
            loss = F.cross_entropy(logits, data.y[idx])
            if teacher is not None and soft_weight > 0:
                t = temperature
                with torch.no_grad():  # the teacher sees the same shifted images as the student
                    target = F.softmax(teacher(xb) / t, 1)
                soft = F.kl_div(F.log_softmax(logits / t, 1), target, reduction="batchmean") * t * t
                loss = soft_weight * soft + (1 - soft_weight) * loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    return model


@torch.no_grad()
def logits_of(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch: int = 256) -> torch.Tensor:
    return torch.cat([model(x[i : i + batch]) for i in range(0, len(x), batch)])
