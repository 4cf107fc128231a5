"""Reformer-style causal LM: chunked local attention and reversible residual layers, Adam.

Each layer couples two activation streams (RevNet): ``y1 = x1 + F(x2)``,
``y2 = x2 + G(y1)`` with ``F`` = LayerNorm + chunked causal attention (each chunk
attends to itself and the previous chunk) and ``G`` = LayerNorm + MLP. The stack is
a ``jax.custom_vjp`` whose backward pass keeps only the stack's outputs and
reconstructs each layer's inputs from its outputs (``x2 = y2 - G(y1)``,
``x1 = y1 - F(x2)``) while back-propagating, as in the Reformer paper.

Params: ``{"embed": ..., "layer_<i>": {"f": ..., "g": ...}, "head": ...}``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from disco_jax.zoo import common
from disco_jax.zoo.layers import FeedForward, PositionalEmbedding, attend, split_heads

SIZES = {
    "tiny": dict(vocab=64, width=32, heads=2, hidden=64, layers=2, seq=16, chunk=4, batch=8),
    "small": dict(vocab=256, width=64, heads=4, hidden=256, layers=4, seq=64, chunk=16, batch=8),
    "medium": dict(vocab=2048, width=256, heads=4, hidden=1024, layers=4, seq=64, chunk=16,
                   batch=8),
}

# eps=1e-3 instead of Adam's usual 1e-8: round-trip tests compare parameters after
# one step, and with a tiny eps the update m / (sqrt(v) + eps) of a near-zero
# gradient is ~sign(g), so float rounding noise in g becomes a full-size update.
ADAM = dict(learning_rate=1e-3, eps=1e-3)


def _previous_chunk(a: jnp.ndarray) -> jnp.ndarray:
    """``[B, N, C, ...]`` -> the same chunks shifted by one along N (zeros first)."""
    return jnp.concatenate([jnp.zeros_like(a[:, :1]), a[:, :-1]], axis=1)


def _chunk_mask(chunks: int, chunk: int) -> jnp.ndarray:
    """``[N, 1, C, 2C]`` bool: query i of chunk n may see key j of (chunk n-1, chunk n)."""
    i = jnp.arange(chunk)[:, None]
    j = jnp.arange(2 * chunk)[None, :]
    causal = j <= i + chunk
    first = jnp.arange(chunks)[:, None, None] > 0
    return (causal & (first | (j >= chunk)))[:, None]


class ChunkedAttention(nn.Module):
    """``F``: LayerNorm + causal attention within a chunk and its predecessor.

    Attributes:
        heads: attention heads.
        chunk: chunk length C (must divide the sequence length).
    """

    heads: int
    chunk: int

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """Maps ``[B, T, D]`` to ``[B, T, D]``."""
        b, t, d = x.shape
        n = t // self.chunk
        h = nn.LayerNorm()(x)

        def proj(name):
            y = split_heads(nn.Dense(d, name=name)(h), self.heads)
            return y.reshape(b, n, self.chunk, self.heads, -1)

        q, k, v = proj("query"), proj("key"), proj("value")
        k = jnp.concatenate([_previous_chunk(k), k], axis=2)
        v = jnp.concatenate([_previous_chunk(v), v], axis=2)
        out = attend(q, k, v, _chunk_mask(n, self.chunk))
        return nn.Dense(d, name="out")(out.reshape(b, t, d))


class MLPBlock(nn.Module):
    """``G``: LayerNorm + MLP.

    Attributes:
        hidden: MLP inner width.
    """

    hidden: int

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """Maps ``[B, T, D]`` to ``[B, T, D]``."""
        return FeedForward(self.hidden)(nn.LayerNorm()(x))


class Head(nn.Module):
    """LayerNorm of the concatenated streams, then the vocabulary projection.

    Attributes:
        vocab: vocabulary size.
    """

    vocab: int

    @nn.compact
    def __call__(self, x1: jnp.ndarray, x2: jnp.ndarray) -> jnp.ndarray:
        """Maps two ``[B, T, D]`` streams to ``[B, T, vocab]`` logits."""
        return nn.Dense(self.vocab)(nn.LayerNorm()(jnp.concatenate([x1, x2], axis=-1)))


def reversible_stack(f, g):
    """Builds ``stack(layers, x1, x2) -> (y1, y2)`` with a reconstructing backward pass.

    Args:
        f: ``f(params, x) -> F(x)`` for ``[B, T, D]`` activations.
        g: ``g(params, x) -> G(x)``.

    Returns:
        A ``jax.custom_vjp`` function; ``layers`` is a tuple of ``{"f": ..., "g": ...}``.
    """

    @jax.custom_vjp
    def stack(layers, x1, x2):
        for p in layers:
            x1 = x1 + f(p["f"], x2)
            x2 = x2 + g(p["g"], x1)
        return x1, x2

    def fwd(layers, x1, x2):
        y1, y2 = stack(layers, x1, x2)
        return (y1, y2), (layers, y1, y2)

    def bwd(res, cotangents):
        layers, y1, y2 = res
        dy1, dy2 = cotangents
        grads = []
        for p in reversed(layers):
            g_out, g_vjp = jax.vjp(g, p["g"], y1)
            x2 = y2 - g_out
            dg, dy1_g = g_vjp(dy2)
            dy1 = dy1 + dy1_g
            f_out, f_vjp = jax.vjp(f, p["f"], x2)
            y1, y2 = y1 - f_out, x2
            df, dx2_f = f_vjp(dy1)
            dy2 = dy2 + dx2_f
            grads.append({"f": df, "g": dg})
        return tuple(grads[::-1]), dy1, dy2

    stack.defvjp(fwd, bwd)
    return stack


class Reformer:
    """The model as three Flax modules glued by the reversible stack.

    Args:
        cfg: a size config of :data:`SIZES`.
    """

    def __init__(self, cfg: dict):
        self.layers = cfg["layers"]
        self.embed = PositionalEmbedding(cfg["vocab"], cfg["width"], cfg["seq"])
        self.f = ChunkedAttention(cfg["heads"], cfg["chunk"])
        self.g = MLPBlock(cfg["hidden"])
        self.head = Head(cfg["vocab"])
        self.stack = reversible_stack(
            lambda p, x: self.f.apply({"params": p}, x),
            lambda p, x: self.g.apply({"params": p}, x),
        )

    def init(self, ids: np.ndarray, width: int) -> dict:
        """Returns ``{"params": ...}`` for int ``[B, T]`` ids (host arrays, fixed seed)."""
        x = jnp.zeros((*ids.shape, width), jnp.float32)
        params = {"embed": common.init_variables(self.embed, ids, tag=0)["params"]}
        for i in range(self.layers):
            params[f"layer_{i}"] = {
                "f": common.init_variables(self.f, x, tag=2 * i + 1)["params"],
                "g": common.init_variables(self.g, x, tag=2 * i + 2)["params"],
            }
        params["head"] = common.init_variables(self.head, x, x, tag=99)["params"]
        return {"params": params}

    def apply(self, variables: dict, ids: jnp.ndarray) -> jnp.ndarray:
        """Maps int ``[B, T]`` ids to ``[B, T, vocab]`` next-token logits."""
        p = variables["params"]
        x = self.embed.apply({"params": p["embed"]}, ids)
        layers = tuple(p[f"layer_{i}"] for i in range(self.layers))
        y1, y2 = self.stack(layers, x, x)
        return self.head.apply({"params": p["head"]}, y1, y2)


def make(num_devices: int, size: str = "tiny"):
    """Builds a data-parallel Reformer language-model train step.

    Batch: int32 ``inputs`` and ``targets`` (inputs shifted by one), each
    ``[num_devices * batch, seq]``.

    Args:
        num_devices: devices of the 1-D ``"data"`` mesh.
        size: ``"tiny"``, ``"small"`` or ``"medium"``.

    Returns:
        ``(step_fn, (variables, opt_state, batch))``.
    """
    cfg = common.select(SIZES, size)
    model = Reformer(cfg)
    n = common.global_batch(num_devices, cfg["batch"])
    text = common.rng(6).integers(0, cfg["vocab"], (n, cfg["seq"] + 1), dtype="int32")
    batch = {"inputs": text[:, :-1], "targets": text[:, 1:]}
    variables = model.init(batch["inputs"][:1], cfg["width"])

    def loss_fn(v, b):
        return common.cross_entropy(model.apply(v, b["inputs"]), b["targets"]), {}

    optimizer = optax.adam(**ADAM)
    return common.build(common.make_mesh(num_devices), loss_fn, optimizer, variables, batch)
