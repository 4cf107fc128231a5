"""Held-out train steps: data-parallel programs that are *not* zoo models, to check the
cost model on programs it was never tuned on (``benchmarks/heldout_accuracy.py``).

Each is ``make(num_devices, size) -> (step, (variables, opt_state, batch))`` like a zoo
entry (built with the zoo's generic ``shard_map`` + ``pmean`` helper), with layer kinds,
optimizers and shapes the zoo does not use:

* ``autoencoder``: a dense autoencoder (tanh, MSE loss), SGD with Nesterov momentum;
* ``conv1d``: a 1-D convolutional sequence classifier (GELU, global mean pool), AdamW;
* ``mixer``: an MLP-mixer (token-mixing and channel-mixing MLPs, LayerNorm), LAMB;
* ``gru``: a GRU language model unrolled in Python (no scan), RMSProp.

Sizes: ``tiny`` (tests) and ``small`` (the benchmark: 5-50 ms per iteration here).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

from disco_jax.zoo import common

STEPS = ("autoencoder", "conv1d", "mixer", "gru")


def job_spec(name: str, size: str) -> dict[str, str]:
    """The ``disco bench`` job spec of the held-out step ``name`` at ``size``
    (:func:`disco_jax.pipeline.bench.make_step` builds it by its ``step``)."""
    return {"model": name, "step": f"benchmarks.heldout_steps:{name}", "size": size}

_SIZES = {
    "autoencoder": {"tiny": dict(features=32, hidden=(24, 8), batch=8),
                    "small": dict(features=512, hidden=(384, 256, 64), batch=16)},
    "conv1d": {"tiny": dict(length=16, channels=(8, 16), kernel=3, classes=5, batch=8),
               "small": dict(length=64, channels=(32, 64, 96), kernel=5, classes=10,
                             batch=8)},
    "mixer": {"tiny": dict(patches=8, width=16, token_hidden=16, channel_hidden=32,
                           blocks=1, classes=5, batch=8),
              "small": dict(patches=16, width=96, token_hidden=64, channel_hidden=256,
                            blocks=3, classes=10, batch=8)},
    "gru": {"tiny": dict(vocab=32, width=16, seq=6, batch=8),
            "small": dict(vocab=256, width=96, seq=10, batch=8)},
}


def _data(tag: int, *shape: int) -> np.ndarray:
    return common.rng(tag).standard_normal(shape).astype(np.float32)


def _labels(tag: int, n: int, classes: int, *shape: int) -> np.ndarray:
    return common.rng(tag).integers(0, classes, size=(n, *shape)).astype(np.int32)


def _classifier(num_devices: int, model: nn.Module, batch: dict, optimizer):
    """The data-parallel step of ``model`` trained on ``batch["x"] -> batch["y"]`` with
    softmax cross-entropy (the zoo's generic shard_map + pmean helper)."""
    variables = common.init_variables(model, batch["x"][:1])

    def loss_fn(v, b):
        return common.cross_entropy(model.apply(v, b["x"]), b["y"]), {}

    return common.build(common.make_mesh(num_devices), loss_fn, optimizer, variables, batch)


class _AutoEncoder(nn.Module):
    hidden: tuple[int, ...]
    features: int

    @nn.compact
    def __call__(self, x):
        for width in (*self.hidden, *reversed(self.hidden[:-1])):
            x = jnp.tanh(nn.Dense(width)(x))
        return nn.Dense(self.features)(x)


def autoencoder(num_devices: int, size: str = "tiny"):
    """Dense autoencoder, MSE, SGD with Nesterov momentum."""
    cfg = common.select(_SIZES["autoencoder"], size)
    model = _AutoEncoder(tuple(cfg["hidden"]), cfg["features"])
    n = common.global_batch(num_devices, cfg["batch"])
    batch = {"x": _data(1, n, cfg["features"])}
    variables = common.init_variables(model, batch["x"][:1])

    def loss_fn(v, b):
        return jnp.mean((model.apply(v, b["x"]) - b["x"]) ** 2), {}

    return common.build(common.make_mesh(num_devices), loss_fn,
                        optax.sgd(0.01, momentum=0.9, nesterov=True), variables, batch)


class _Conv1D(nn.Module):
    channels: tuple[int, ...]
    kernel: int
    classes: int

    @nn.compact
    def __call__(self, x):
        for c in self.channels:
            x = nn.gelu(nn.Conv(c, (self.kernel,))(x))
        return nn.Dense(self.classes)(jnp.mean(x, axis=1))


def conv1d(num_devices: int, size: str = "tiny"):
    """1-D conv sequence classifier, AdamW."""
    cfg = common.select(_SIZES["conv1d"], size)
    model = _Conv1D(tuple(cfg["channels"]), cfg["kernel"], cfg["classes"])
    n = common.global_batch(num_devices, cfg["batch"])
    batch = {"x": _data(2, n, cfg["length"], 4), "y": _labels(3, n, cfg["classes"])}
    return _classifier(num_devices, model, batch, optax.adamw(1e-3, eps=1e-3))


class _MixerBlock(nn.Module):
    token_hidden: int
    channel_hidden: int

    @nn.compact
    def __call__(self, x):  # [batch, patches, width]
        y = nn.LayerNorm()(x).swapaxes(1, 2)
        y = nn.Dense(x.shape[1])(nn.gelu(nn.Dense(self.token_hidden)(y)))
        x = x + y.swapaxes(1, 2)
        y = nn.LayerNorm()(x)
        return x + nn.Dense(x.shape[2])(nn.gelu(nn.Dense(self.channel_hidden)(y)))


class _Mixer(nn.Module):
    width: int
    token_hidden: int
    channel_hidden: int
    blocks: int
    classes: int

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        for _ in range(self.blocks):
            x = _MixerBlock(self.token_hidden, self.channel_hidden)(x)
        return nn.Dense(self.classes)(jnp.mean(nn.LayerNorm()(x), axis=1))


def mixer(num_devices: int, size: str = "tiny"):
    """MLP-mixer classifier, LAMB."""
    cfg = common.select(_SIZES["mixer"], size)
    model = _Mixer(cfg["width"], cfg["token_hidden"], cfg["channel_hidden"], cfg["blocks"],
                   cfg["classes"])
    n = common.global_batch(num_devices, cfg["batch"])
    batch = {"x": _data(4, n, cfg["patches"], 12), "y": _labels(5, n, cfg["classes"])}
    return _classifier(num_devices, model, batch, optax.lamb(1e-3, eps=1e-3))


class _GRULM(nn.Module):
    vocab: int
    width: int

    @nn.compact
    def __call__(self, tokens):  # [batch, seq]
        x = nn.Embed(self.vocab, self.width)(tokens)
        cell = nn.GRUCell(self.width)
        h = jnp.zeros((tokens.shape[0], self.width), x.dtype)
        outs = []
        for t in range(tokens.shape[1]):  # unrolled: one cell per step in the HLO
            h, y = cell(h, x[:, t])
            outs.append(y)
        return nn.Dense(self.vocab)(jnp.stack(outs, axis=1))


def gru(num_devices: int, size: str = "tiny"):
    """GRU language model unrolled in Python, RMSProp."""
    cfg = common.select(_SIZES["gru"], size)
    model = _GRULM(cfg["vocab"], cfg["width"])
    n = common.global_batch(num_devices, cfg["batch"])
    tokens = _labels(6, n, cfg["vocab"], cfg["seq"] + 1)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    return _classifier(num_devices, model, batch, optax.rmsprop(1e-3, eps=1e-3))
