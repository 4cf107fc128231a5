"""A small MLP trained with SGD, written for automatic partitioning (no shard_map).

The step is a global-view program: the loss is the mean over the whole batch and
the inputs carry ``NamedSharding`` s (batch split along ``"data"``, params
replicated). The pre-optimization HLO therefore holds only sharding annotations
and no ``all-reduce``; XLA's SPMD partitioner inserts the gradient all-reduces
during compilation.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from disco_jax.zoo import common

SIZES = {
    "tiny": dict(features=32, hidden=(64, 64), classes=10, batch=8),
    "small": dict(features=128, hidden=(256, 256, 256), classes=10, batch=8),
    "medium": dict(features=512, hidden=(1024, 1024, 1024), classes=10, batch=8),
}
LEARNING_RATE = 0.1


class MLP(nn.Module):
    """Dense + ReLU layers, then a dense classifier.

    Attributes:
        hidden: widths of the hidden layers.
        classes: number of output classes.
    """

    hidden: Sequence[int]
    classes: int

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """Maps ``[B, features]`` to ``[B, classes]`` logits."""
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.classes)(x)


def make(num_devices: int, size: str = "tiny"):
    """Builds an automatically partitioned MLP train step.

    Batch: float32 ``inputs`` ``[num_devices * batch, features]`` and int32 ``labels``
    ``[num_devices * batch]``, sharded along ``"data"``; variables and optimizer
    state replicated. The new params are constrained to stay replicated.

    Args:
        num_devices: devices of the 1-D ``"data"`` mesh.
        size: ``"tiny"``, ``"small"`` or ``"medium"``.

    Returns:
        ``(step_fn, (variables, opt_state, batch))``; ``step_fn`` is a plain function
        (``jax.jit`` it to lower or run).
    """
    cfg = common.select(SIZES, size)
    model = MLP(cfg["hidden"], cfg["classes"])
    mesh = common.make_mesh(num_devices)
    n = common.global_batch(num_devices, cfg["batch"])
    gen = common.rng(7)
    batch = {
        "inputs": gen.standard_normal((n, cfg["features"]), dtype="float32"),
        "labels": gen.integers(0, cfg["classes"], (n,), dtype="int32"),
    }
    variables = common.init_variables(model, batch["inputs"][:1])
    optimizer = optax.sgd(LEARNING_RATE)
    opt_state = jax.device_get(jax.jit(optimizer.init)(variables["params"]))
    replicated = NamedSharding(mesh, P())

    def step(variables, opt_state, batch):
        def loss_of(p):
            logits = model.apply({"params": p}, batch["inputs"])
            return common.cross_entropy(logits, batch["labels"])

        params = variables["params"]
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), replicated)
        return {"params": params}, opt_state, loss

    return step, common.place_args(mesh, variables, opt_state, batch)
