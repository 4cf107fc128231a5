"""BERT-style encoder with a masked-LM head (tied output embedding), AdamW."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

from disco_jax.zoo import common
from disco_jax.zoo.layers import Attention, FeedForward, PositionalEmbedding

SIZES = {
    "tiny": dict(vocab=64, width=32, heads=2, hidden=64, layers=2, seq=16, batch=8),
    "small": dict(vocab=512, width=64, heads=4, hidden=256, layers=4, seq=32, batch=8),
    "medium": dict(vocab=4096, width=256, heads=4, hidden=1024, layers=4, seq=32, batch=8),
}

MASK_ID = 1  # id 0 is padding/unused, 1 is [MASK]
MASK_RATE = 0.15

# eps=1e-3 instead of the usual 1e-6..1e-8: round-trip tests compare parameters after
# one step, and with a tiny eps the update m / (sqrt(v) + eps) of a near-zero
# gradient is ~sign(g), so float rounding noise in g becomes a full-size update.
ADAMW = dict(learning_rate=1e-3, eps=1e-3, weight_decay=0.01)


class BertLayer(nn.Module):
    """Post-LN encoder layer (as in BERT).

    Attributes:
        heads: attention heads.
        hidden: MLP inner width.
    """

    heads: int
    hidden: int

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """Maps ``[B, T, D]`` to ``[B, T, D]``."""
        x = nn.LayerNorm()(x + Attention(self.heads)(x, x))
        return nn.LayerNorm()(x + FeedForward(self.hidden)(x))


class Bert(nn.Module):
    """Token + position + segment embeddings, encoder layers, masked-LM head.

    Attributes:
        vocab: vocabulary size.
        width: model width D.
        heads: attention heads.
        hidden: MLP inner width.
        layers: encoder layers.
        max_len: maximum sequence length.
    """

    vocab: int
    width: int
    heads: int
    hidden: int
    layers: int
    max_len: int

    @nn.compact
    def __call__(self, tokens: jnp.ndarray, segments: jnp.ndarray) -> jnp.ndarray:
        """Maps int ``[B, T]`` tokens and segment ids (0/1) to ``[B, T, vocab]`` logits."""
        embed = PositionalEmbedding(self.vocab, self.width, self.max_len, name="embed")
        x = embed(tokens) + nn.Embed(2, self.width, name="segment_embed")(segments)
        x = nn.LayerNorm()(x)
        for _ in range(self.layers):
            x = BertLayer(self.heads, self.hidden)(x)
        h = nn.LayerNorm()(nn.gelu(nn.Dense(self.width, name="mlm_transform")(x)))
        bias = self.param("mlm_bias", nn.initializers.zeros, (self.vocab,))
        return embed.attend(h) + bias


def _batch(n: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    """Masked-LM batch: 15% of the positions replaced by [MASK] and weighted 1."""
    gen = common.rng(4)
    targets = gen.integers(2, vocab, (n, seq), dtype=np.int32)
    weights = (gen.random((n, seq)) < MASK_RATE).astype(np.float32)
    weights[:, 0] = 1.0  # at least one masked position per sequence
    tokens = np.where(weights > 0, MASK_ID, targets).astype(np.int32)
    segments = (np.arange(seq) >= seq // 2).astype(np.int32)[None].repeat(n, axis=0)
    return {"tokens": tokens, "segments": segments, "targets": targets, "weights": weights}


def make(num_devices: int, size: str = "tiny"):
    """Builds a data-parallel BERT masked-LM train step.

    Batch (each ``[num_devices * batch, seq]``): int32 ``tokens``, ``segments``,
    ``targets`` and float32 ``weights`` (1 at masked positions). The loss is the
    per-device weighted mean cross-entropy, averaged over devices.

    Args:
        num_devices: devices of the 1-D ``"data"`` mesh.
        size: ``"tiny"``, ``"small"`` or ``"medium"``.

    Returns:
        ``(step_fn, (variables, opt_state, batch))``.
    """
    cfg = common.select(SIZES, size)
    model = Bert(cfg["vocab"], cfg["width"], cfg["heads"], cfg["hidden"], cfg["layers"], cfg["seq"])
    batch = _batch(common.global_batch(num_devices, cfg["batch"]), cfg["seq"], cfg["vocab"])
    variables = common.init_variables(model, batch["tokens"][:1], batch["segments"][:1])

    def loss_fn(v, b):
        logits = model.apply(v, b["tokens"], b["segments"])
        return common.cross_entropy(logits, b["targets"], b["weights"]), {}

    optimizer = optax.adamw(**ADAMW)
    return common.build(common.make_mesh(num_devices), loss_fn, optimizer, variables, batch)
