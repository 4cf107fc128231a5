"""LSTM language model, time loop as ``lax.scan`` (a while loop) or unrolled in Python.

Both variants have the same parameter tree (``lstm_<i>/{input,recurrent}``), so the
same arrays feed either step. The cell computes its four gates with two matmuls
(``Dense(4H)`` of the input and of the hidden state) where ``nn.LSTMCell`` uses eight.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import optax

from disco_jax.zoo import common

# XLA:CPU compile time of the unrolled variant grows about quadratically with seq:
# the backward cell-state recurrence is a purely elementwise chain that its fusion
# pass duplicates into every consumer (small: 19 s at seq 24, 31 s at seq 32).
SIZES = {
    "tiny": dict(vocab=64, width=32, layers=2, seq=16, batch=8),
    "small": dict(vocab=256, width=128, layers=2, seq=24, batch=8),
    "medium": dict(vocab=2048, width=384, layers=2, seq=24, batch=8),
}
UNROLLS = ("scan", "python")

# eps=1e-3 instead of Adam's usual 1e-8: round-trip tests compare parameters after
# one step, and with a tiny eps the update m / (sqrt(v) + eps) of a near-zero
# gradient is ~sign(g), so float rounding noise in g becomes a full-size update.
ADAM = dict(learning_rate=1e-2, eps=1e-3)


class LSTMCell(nn.Module):
    """LSTM cell with fused gates.

    Attributes:
        width: hidden width H.
    """

    width: int

    @nn.compact
    def __call__(self, carry, x: jnp.ndarray):
        """One step: carry ``(c, h)`` each ``[B, H]``, input ``[B, H_in]``.

        Returns:
            ``((c, h), h)``.
        """
        c, h = carry
        gates = nn.Dense(4 * self.width, name="input")(x)
        gates = gates + nn.Dense(4 * self.width, use_bias=False, name="recurrent")(h)
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = nn.sigmoid(f + 1.0) * c + nn.sigmoid(i) * jnp.tanh(g)
        h = nn.sigmoid(o) * jnp.tanh(c)
        return (c, h), h


_ScanLSTM = nn.scan(
    LSTMCell,
    variable_broadcast="params",
    split_rngs={"params": False},
    in_axes=1,
    out_axes=1,
)


class LSTMLM(nn.Module):
    """Embedding -> stacked LSTM -> dense logits.

    Attributes:
        vocab: vocabulary size.
        width: embedding and hidden width H.
        layers: stacked LSTM layers.
        unroll: ``"scan"`` (``lax.scan`` over time) or ``"python"`` (one cell call per
            time step in the HLO).
    """

    vocab: int
    width: int
    layers: int
    unroll: str = "scan"

    @nn.compact
    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        """Maps int ``[B, T]`` tokens to ``[B, T, vocab]`` next-token logits."""
        x = nn.Embed(self.vocab, self.width)(tokens)
        for i in range(self.layers):
            zeros = jnp.zeros((x.shape[0], self.width), x.dtype)
            carry = (zeros, zeros)
            if self.unroll == "scan":
                _, x = _ScanLSTM(self.width, name=f"lstm_{i}")(carry, x)
            else:
                cell = LSTMCell(self.width, name=f"lstm_{i}")
                outs = []
                # jnp.split, not x[:, t]: the transpose of split is one concatenate,
                # that of T slices is T pads summed, which XLA:CPU fuses into huge
                # duplicated loops (tiny model: 21 s compile instead of 6 s).
                for x_t in jnp.split(x, x.shape[1], axis=1):
                    carry, h = cell(carry, x_t[:, 0])
                    outs.append(h)
                x = jnp.stack(outs, axis=1)
        return nn.Dense(self.vocab)(x)


def make(num_devices: int, size: str = "tiny", unroll: str = "scan"):
    """Builds a data-parallel LSTM language-model train step.

    Batch: int32 ``inputs`` and ``targets`` (inputs shifted by one), each
    ``[num_devices * batch, seq]``.

    Args:
        num_devices: devices of the 1-D ``"data"`` mesh.
        size: ``"tiny"``, ``"small"`` or ``"medium"``.
        unroll: ``"scan"`` or ``"python"``.

    Returns:
        ``(step_fn, (variables, opt_state, batch))``.
    """
    if unroll not in UNROLLS:
        raise ValueError(f"unknown unroll {unroll!r}; valid: {UNROLLS}")
    cfg = common.select(SIZES, size)
    model = LSTMLM(cfg["vocab"], cfg["width"], cfg["layers"], unroll)
    n = common.global_batch(num_devices, cfg["batch"])
    text = common.rng(5).integers(0, cfg["vocab"], (n, cfg["seq"] + 1), dtype="int32")
    batch = {"inputs": text[:, :-1], "targets": text[:, 1:]}
    variables = common.init_variables(model, batch["inputs"][:1])

    def loss_fn(v, b):
        return common.cross_entropy(model.apply(v, b["inputs"]), b["targets"]), {}

    optimizer = optax.adam(**ADAM)
    return common.build(common.make_mesh(num_devices), loss_fn, optimizer, variables, batch)


def make_unrolled(num_devices: int, size: str = "tiny"):
    """:func:`make` with ``unroll="python"``."""
    return make(num_devices, size, unroll="python")
