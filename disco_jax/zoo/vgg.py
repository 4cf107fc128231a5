"""VGG-style CNN (conv3x3+ReLU blocks with max-pool, then dense layers), SGD momentum."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp
import optax

from disco_jax.zoo import common

SIZES = {
    "tiny": dict(image=16, channels=(8, 16), convs_per_block=2, dense=(32,), classes=10, batch=8),
    "small": dict(
        image=32, channels=(16, 32, 64), convs_per_block=2, dense=(128, 64), classes=10, batch=8
    ),
    "medium": dict(
        image=32, channels=(32, 64, 128), convs_per_block=2, dense=(512, 256), classes=10, batch=8
    ),
}


class VGG(nn.Module):
    """VGG: blocks of 3x3 convs + ReLU, each block ending in a 2x2 max-pool.

    Attributes:
        channels: output channels of each block.
        convs_per_block: conv layers per block.
        dense: widths of the hidden dense layers.
        classes: number of output classes.
    """

    channels: Sequence[int]
    convs_per_block: int
    dense: Sequence[int]
    classes: int

    @nn.compact
    def __call__(self, images: jnp.ndarray) -> jnp.ndarray:
        """Maps ``[B, H, W, 3]`` float32 images to ``[B, classes]`` logits."""
        x = images
        for ch in self.channels:
            for _ in range(self.convs_per_block):
                x = nn.relu(nn.Conv(ch, (3, 3))(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        for width in self.dense:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.classes)(x)


def make(num_devices: int, size: str = "tiny"):
    """Builds a data-parallel VGG train step.

    Batch: ``images`` float32 ``[num_devices * batch, image, image, 3]`` and
    ``labels`` int32 ``[num_devices * batch]``.

    Args:
        num_devices: devices of the 1-D ``"data"`` mesh.
        size: ``"tiny"``, ``"small"`` or ``"medium"``.

    Returns:
        ``(step_fn, (variables, opt_state, batch))``.
    """
    cfg = common.select(SIZES, size)
    model = VGG(cfg["channels"], cfg["convs_per_block"], cfg["dense"], cfg["classes"])
    n = common.global_batch(num_devices, cfg["batch"])
    batch = common.image_batch(1, n, cfg["image"], cfg["classes"])
    variables = common.init_variables(model, batch["images"][:1])

    def loss_fn(v, b):
        return common.cross_entropy(model.apply(v, b["images"]), b["labels"]), {}

    optimizer = optax.sgd(0.05, momentum=0.9)
    return common.build(common.make_mesh(num_devices), loss_fn, optimizer, variables, batch)
