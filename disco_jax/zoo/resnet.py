"""ResNet with bottleneck blocks and batch norm, SGD momentum.

Batch-norm statistics of the forward pass are computed per device over the local
batch; the new running averages (``variables["batch_stats"]``) are averaged over
devices (one all-reduce per statistic) so the replicated state stays consistent.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp
import optax

from disco_jax.zoo import common

SIZES = {
    "tiny": dict(image=16, stem=8, widths=(8, 16), blocks=(1, 1), classes=10, batch=8),
    "small": dict(image=32, stem=16, widths=(16, 32, 64), blocks=(2, 2, 2), classes=10, batch=8),
    "medium": dict(image=32, stem=32, widths=(32, 64, 128, 256), blocks=(1, 1, 1, 1), classes=10,
                   batch=8),
}


def _norm() -> nn.BatchNorm:
    """Training-mode batch norm (statistics of the local batch)."""
    return nn.BatchNorm(use_running_average=False, momentum=0.9)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 -> 1x1 expand (x4) with a projection shortcut when needed.

    Attributes:
        width: channels of the 3x3 conv; the block outputs ``4 * width``.
        stride: stride of the 3x3 conv.
    """

    width: int
    stride: int = 1

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """Maps ``[B, H, W, C]`` to ``[B, H/stride, W/stride, 4*width]``."""
        s = (self.stride, self.stride)
        y = nn.relu(_norm()(nn.Conv(self.width, (1, 1), use_bias=False)(x)))
        y = nn.relu(_norm()(nn.Conv(self.width, (3, 3), s, use_bias=False)(y)))
        y = _norm()(nn.Conv(4 * self.width, (1, 1), use_bias=False)(y))
        if x.shape[-1] != 4 * self.width or self.stride != 1:
            x = _norm()(nn.Conv(4 * self.width, (1, 1), s, use_bias=False)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """Stem conv + stages of bottleneck blocks + global average pool + dense.

    Attributes:
        stem: channels of the 3x3 stem conv.
        widths: bottleneck width of each stage (stages after the first downsample x2).
        blocks: number of blocks of each stage.
        classes: number of output classes.
    """

    stem: int
    widths: Sequence[int]
    blocks: Sequence[int]
    classes: int

    @nn.compact
    def __call__(self, images: jnp.ndarray) -> jnp.ndarray:
        """Maps ``[B, H, W, 3]`` images to ``[B, classes]`` logits."""
        x = nn.relu(_norm()(nn.Conv(self.stem, (3, 3), use_bias=False)(images)))
        for i, (width, count) in enumerate(zip(self.widths, self.blocks, strict=True)):
            for j in range(count):
                x = Bottleneck(width, 2 if i > 0 and j == 0 else 1)(x)
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


def make(num_devices: int, size: str = "tiny"):
    """Builds a data-parallel ResNet train step.

    Batch: ``images`` float32 ``[num_devices * batch, image, image, 3]``, ``labels``
    int32 ``[num_devices * batch]``. The variables hold ``params`` and ``batch_stats``.

    Args:
        num_devices: devices of the 1-D ``"data"`` mesh.
        size: ``"tiny"``, ``"small"`` or ``"medium"``.

    Returns:
        ``(step_fn, (variables, opt_state, batch))``.
    """
    cfg = common.select(SIZES, size)
    model = ResNet(cfg["stem"], cfg["widths"], cfg["blocks"], cfg["classes"])
    n = common.global_batch(num_devices, cfg["batch"])
    batch = common.image_batch(2, n, cfg["image"], cfg["classes"])
    variables = common.init_variables(model, batch["images"][:1])

    def loss_fn(v, b):
        logits, state = model.apply(v, b["images"], mutable=["batch_stats"])
        return common.cross_entropy(logits, b["labels"]), state

    optimizer = optax.sgd(0.05, momentum=0.9)
    return common.build(common.make_mesh(num_devices), loss_fn, optimizer, variables, batch)
