"""Structured channel pruning rebuilds layers smaller: which channels go, how many, and training on the result."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from scorestack.compile.vision_models import SmallCNN, SmallResNet, kept_channels, n_parameters


def _silence(bn: torch.nn.BatchNorm2d, conv: torch.nn.Conv2d, channels: torch.Tensor) -> None:
    """Make `channels` dead (ReLU output 0 for every input) and the lowest in L1, so pruning must drop exactly them."""
    with torch.no_grad():
        conv.weight[channels] *= 1e-3
        bn.weight[channels] = 0.0
        bn.bias[channels] = -1.0


def _dead_half(n: int, seed: int) -> torch.Tensor:
    return torch.sort(torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: n // 2]).values


def test_pruned_resnet_drops_the_dead_channels_of_every_layer_and_computes_the_same(tmp_path) -> None:
    torch.manual_seed(0)
    big = SmallResNet(10, 1, [32, 64, 128]).eval()
    _silence(big.stem_bn, big.stem, _dead_half(32, 1))
    for i, block in enumerate(big.blocks):
        _silence(block.bn1, block.conv1, _dead_half(block.conv1.out_channels, 10 + i))
        out = _dead_half(block.conv2.out_channels, 20 + i)
        # A block's output channel is dead when both its conv path and its shortcut are: the sum is -2 before the ReLU.
        _silence(block.bn2, block.conv2, out)
        _silence(block.short[1], block.short[0], out)
    small = big.prune_channels(0.5).eval()
    assert small.config() == {"n_classes": 10, "in_channels": 1, "widths": [16, 32, 64], "inner": [16, 32, 64], "stem": 16}
    assert n_parameters(small) < 0.3 * n_parameters(big)
    # Rebuilt from its config and state dict like any torch-module source.
    again = SmallResNet(**small.config())
    again.load_state_dict(small.state_dict())
    x = torch.randn(8, 1, 32, 32)
    with torch.no_grad():
        expected = big(x)
        np.testing.assert_allclose(small(x).numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(again.eval()(x).numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)


def test_pruned_cnn_drops_the_dead_channels_and_computes_the_same() -> None:
    torch.manual_seed(0)
    big = SmallCNN(10, 1, [32, 64, 128]).eval()
    for i, (conv, bn) in enumerate(zip(big.convs, big.bns)):
        _silence(bn, conv, _dead_half(conv.out_channels, i))
    small = big.prune_channels(0.5).eval()
    assert small.widths == [16, 32, 64]
    x = torch.randn(8, 1, 32, 32)
    with torch.no_grad():
        np.testing.assert_allclose(small(x).numpy(), big(x).numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("n", "ratio", "kept"),
    [(32, 0.5, 16), (32, 0.4, 16), (64, 0.4, 24), (128, 0.4, 48), (128, 0.25, 32), (12, 0.5, 8), (16, 0.25, 4), (6, 0.5, 3), (32, 0.1, 3), (8, 0.9, 8)],
)
def test_kept_channels_round_to_multiples_of_8(n: int, ratio: float, kept: int) -> None:
    assert kept_channels(n, ratio) == kept


def test_fine_tuning_odd_widths_on_hwc_images_with_two_threads_completes(tmp_path) -> None:
    """torch 2.13 aborted this process ("double free or corruption", "free(): invalid next size") before to_float
    copied HWC images to NCHW memory."""
    script = textwrap.dedent(
        """
        import numpy as np, torch
        from scorestack.compile.spec import ImageSpec
        from scorestack.compile.vision import to_float
        from scorestack.compile.vision_models import SmallResNet, TrainData, train
        rng = np.random.default_rng(0)
        images = rng.integers(0, 256, (41, 32, 32, 1), dtype=np.uint8)  # a batch of 32 and one of 9: aborted 4 of 4 runs
        labels = torch.from_numpy(rng.integers(0, 10, 41))
        spec = ImageSpec(layout="HWC", height=32, width=32, channels=1, scale=1 / 255, mean=[0.5], std=[0.25])
        model = SmallResNet(10, 1, [11, 22, 45], [11, 22, 45], stem=11)
        before = [p.detach().clone() for p in model.parameters()]
        train(model, TrainData(to_float(spec, images), labels), 1, 3e-3, threads=2)
        print("changed", sum(int(not torch.equal(a, b)) for a, b in zip(before, model.parameters())), len(before))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    changed, total = (int(v) for v in done.stdout.split()[1:3])
    assert changed == total  # every parameter was trained
