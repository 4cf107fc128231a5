"""Transformer building blocks shared by the transformer, BERT and Reformer models.

All projections are ``nn.Dense`` with 2-D kernels (``[d_in, d_out]``) so that every
weight is a plain matrix in the HLO.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

__all__ = ["Attention", "FeedForward", "PositionalEmbedding", "causal_mask"]


def causal_mask(length: int) -> jnp.ndarray:
    """Returns a ``[1, 1, length, length]`` bool mask, True where key <= query."""
    return jnp.tril(jnp.ones((length, length), bool))[None, None]


def split_heads(x: jnp.ndarray, heads: int) -> jnp.ndarray:
    """``[..., T, D]`` -> ``[..., T, heads, D / heads]``."""
    return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def attend(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray | None):
    """Scaled dot-product attention over the second-to-last-but-one axis.

    Args:
        q: ``[..., Tq, H, Dh]`` queries.
        k: ``[..., Tk, H, Dh]`` keys.
        v: ``[..., Tk, H, Dh]`` values.
        mask: bool, broadcastable to ``[..., H, Tq, Tk]``; True = may attend.

    Returns:
        ``[..., Tq, H * Dh]``.
    """
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    out = jnp.einsum("...hqk,...khd->...qhd", nn.softmax(logits, axis=-1), v)
    return out.reshape(*out.shape[:-2], -1)


class Attention(nn.Module):
    """Multi-head attention with separate q/k/v/out projections.

    Attributes:
        heads: number of heads (must divide the model width).
    """

    heads: int

    @nn.compact
    def __call__(self, x: jnp.ndarray, kv: jnp.ndarray, mask: jnp.ndarray | None = None):
        """Attends ``x`` ``[B, Tq, D]`` to ``kv`` ``[B, Tk, D]``; returns ``[B, Tq, D]``.

        ``mask`` is bool, broadcastable to ``[B, heads, Tq, Tk]``.
        """
        d = x.shape[-1]
        q = split_heads(nn.Dense(d, name="query")(x), self.heads)
        k = split_heads(nn.Dense(d, name="key")(kv), self.heads)
        v = split_heads(nn.Dense(d, name="value")(kv), self.heads)
        return nn.Dense(d, name="out")(attend(q, k, v, mask))


class FeedForward(nn.Module):
    """Position-wise MLP ``Dense(hidden) -> GELU -> Dense(D)``.

    Attributes:
        hidden: inner width.
    """

    hidden: int

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """Maps ``[..., D]`` to ``[..., D]``."""
        return nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(self.hidden)(x)))


class PositionalEmbedding(nn.Module):
    """Token embedding plus learned absolute position embedding.

    Attributes:
        vocab: vocabulary size.
        width: model width D.
        max_len: maximum sequence length.
    """

    vocab: int
    width: int
    max_len: int

    def setup(self):
        self.tokens = nn.Embed(self.vocab, self.width)
        self.positions = self.param(
            "pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.width)
        )

    def __call__(self, ids: jnp.ndarray) -> jnp.ndarray:
        """Maps int ``[B, T]`` ids to ``[B, T, D]``."""
        return self.tokens(ids) + self.positions[: ids.shape[-1]]

    def attend(self, x: jnp.ndarray) -> jnp.ndarray:
        """Tied output projection: ``[..., D]`` -> ``[..., vocab]`` logits."""
        return self.tokens.attend(x)
