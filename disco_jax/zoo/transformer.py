"""Transformer encoder-decoder (seq2seq) on a synthetic sequence-reversal task, Adam."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

from disco_jax.zoo import common
from disco_jax.zoo.layers import Attention, FeedForward, PositionalEmbedding, causal_mask

SIZES = {
    "tiny": dict(vocab=64, width=32, heads=2, hidden=64, layers=2, seq=16, batch=8),
    "small": dict(vocab=256, width=64, heads=4, hidden=256, layers=3, seq=32, batch=8),
    "medium": dict(vocab=2048, width=256, heads=4, hidden=1024, layers=3, seq=32, batch=8),
}

# eps=1e-3 instead of Adam's usual 1e-8: round-trip tests compare parameters after
# one step, and with a tiny eps the update m / (sqrt(v) + eps) of a near-zero
# gradient is ~sign(g), so float rounding noise in g becomes a full-size update.
ADAM = dict(learning_rate=1e-3, eps=1e-3)


class EncoderLayer(nn.Module):
    """Pre-LN encoder layer: self-attention and MLP, each with a residual.

    Attributes:
        heads: attention heads.
        hidden: MLP inner width.
    """

    heads: int
    hidden: int

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """Maps ``[B, S, D]`` to ``[B, S, D]``."""
        h = nn.LayerNorm()(x)
        x = x + Attention(self.heads)(h, h)
        return x + FeedForward(self.hidden)(nn.LayerNorm()(x))


class DecoderLayer(nn.Module):
    """Pre-LN decoder layer: causal self-attention, cross-attention, MLP.

    Attributes:
        heads: attention heads.
        hidden: MLP inner width.
    """

    heads: int
    hidden: int

    @nn.compact
    def __call__(self, x: jnp.ndarray, memory: jnp.ndarray) -> jnp.ndarray:
        """Maps ``[B, T, D]`` (and encoder output ``[B, S, D]``) to ``[B, T, D]``."""
        h = nn.LayerNorm()(x)
        x = x + Attention(self.heads, name="self_attention")(h, h, causal_mask(x.shape[1]))
        x = x + Attention(self.heads, name="cross_attention")(nn.LayerNorm()(x), memory)
        return x + FeedForward(self.hidden)(nn.LayerNorm()(x))


class Seq2Seq(nn.Module):
    """Encoder-decoder with separate source/target embeddings and an output layer.

    Attributes:
        vocab: vocabulary size (shared by source and target).
        width: model width D.
        heads: attention heads.
        hidden: MLP inner width.
        layers: encoder layers (and decoder layers).
        max_len: maximum sequence length.
    """

    vocab: int
    width: int
    heads: int
    hidden: int
    layers: int
    max_len: int

    @nn.compact
    def __call__(self, src: jnp.ndarray, tgt_in: jnp.ndarray) -> jnp.ndarray:
        """Maps int ``[B, S]`` source and ``[B, T]`` target ids to ``[B, T, vocab]``."""
        x = PositionalEmbedding(self.vocab, self.width, self.max_len, name="src_embed")(src)
        for _ in range(self.layers):
            x = EncoderLayer(self.heads, self.hidden)(x)
        memory = nn.LayerNorm()(x)
        y = PositionalEmbedding(self.vocab, self.width, self.max_len, name="tgt_embed")(tgt_in)
        for _ in range(self.layers):
            y = DecoderLayer(self.heads, self.hidden)(y, memory)
        return nn.Dense(self.vocab, name="logits")(nn.LayerNorm()(y))


def _batch(n: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    """Reversal task: ``tgt_out`` is ``src`` reversed; ``tgt_in`` is it shifted (BOS=0)."""
    src = common.rng(3).integers(1, vocab, (n, seq), dtype=np.int32)
    tgt_out = src[:, ::-1].copy()
    tgt_in = np.concatenate([np.zeros((n, 1), np.int32), tgt_out[:, :-1]], axis=1)
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}


def make(num_devices: int, size: str = "tiny"):
    """Builds a data-parallel seq2seq Transformer train step.

    Batch: int32 ``src``, ``tgt_in`` and ``tgt_out``, each ``[num_devices * batch, seq]``.

    Args:
        num_devices: devices of the 1-D ``"data"`` mesh.
        size: ``"tiny"``, ``"small"`` or ``"medium"``.

    Returns:
        ``(step_fn, (variables, opt_state, batch))``.
    """
    cfg = common.select(SIZES, size)
    model = Seq2Seq(
        cfg["vocab"], cfg["width"], cfg["heads"], cfg["hidden"], cfg["layers"], cfg["seq"]
    )
    batch = _batch(common.global_batch(num_devices, cfg["batch"]), cfg["seq"], cfg["vocab"])
    variables = common.init_variables(model, batch["src"][:1], batch["tgt_in"][:1])

    def loss_fn(v, b):
        return common.cross_entropy(model.apply(v, b["src"], b["tgt_in"]), b["tgt_out"]), {}

    optimizer = optax.adam(**ADAM)
    return common.build(common.make_mesh(num_devices), loss_fn, optimizer, variables, batch)
