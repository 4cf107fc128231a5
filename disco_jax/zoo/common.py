"""Shared helpers of the model zoo: mesh, init, data-parallel step, placement.

Every shard_map model of the zoo is built the same way:

* ``variables`` is a Flax variable dict: ``{"params": ...}`` plus, for models with
  mutable state, other collections (e.g. ``"batch_stats"``). It is passed as the
  first argument of the step ("params" in the zoo's ``(params, opt_state, batch)``).
* The loss function has the signature ``loss_fn(variables, batch) -> (loss, state)``
  where ``state`` holds the new values of the non-trainable collections (``{}`` if
  none). Only ``variables["params"]`` is differentiated and seen by the optimizer.
* :func:`data_parallel_step` wraps it in ``jax.shard_map`` over the 1-D mesh axis
  ``"data"``: the batch is split along its leading axis, the variables and the
  optimizer state are replicated.

All-reduce rule (pre-optimization HLO): exactly one ``all-reduce`` per leaf of
``variables`` (the gradient of every ``params`` leaf, and the cross-device mean of
every other state leaf, e.g. batch-norm running statistics) plus one for the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"
SEED = 0

Pytree = Any
LossFn = Callable[[Pytree, Pytree], tuple[jax.Array, Pytree]]
StepFn = Callable[[Pytree, Pytree, Pytree], tuple[Pytree, Pytree, jax.Array]]

__all__ = [
    "AXIS",
    "SEED",
    "build",
    "count_params",
    "cross_entropy",
    "data_parallel_step",
    "global_batch",
    "init_variables",
    "make_mesh",
    "place_args",
    "rng",
    "select",
]


def make_mesh(num_devices: int) -> Mesh:
    """Returns a 1-D mesh with axis ``"data"`` over ``jax.devices()[:num_devices]``.

    The axis type is ``Auto``: on jax 0.10 ``jax.make_mesh`` defaults to ``Explicit``
    axes, under which ``shard_map`` rejects inputs whose sharding differs from its
    ``in_specs`` (e.g. host numpy arrays) instead of resharding them.

    Args:
        num_devices: number of devices; at most ``len(jax.devices())``.

    Returns:
        The mesh.
    """
    devices = jax.devices()
    if not 1 <= num_devices <= len(devices):
        raise ValueError(
            f"num_devices={num_devices} but {len(devices)} devices are available "
            "(set XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU)"
        )
    return jax.make_mesh(
        (num_devices,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices[:num_devices]
    )


#: The ``"large"`` size is the ``"medium"`` model with this many times its per-device
#: batch: the same gradients, about as much computation as communication over 1 Gbit/s
#: (the regime where overlapping them pays).
LARGE_BATCH_FACTOR = 4


def select(sizes: dict[str, dict[str, Any]], size: str) -> dict[str, Any]:
    """Returns the config ``sizes[size]`` (``"large"``: ``"medium"`` with
    :data:`LARGE_BATCH_FACTOR` times the batch) or raises a ValueError naming the valid
    sizes."""
    if size == "large" and "medium" in sizes:
        cfg = dict(sizes["medium"])
        return {**cfg, "batch": cfg["batch"] * LARGE_BATCH_FACTOR}
    if size not in sizes:
        raise ValueError(f"unknown size {size!r}; valid sizes: {sorted(sizes)} or 'large'")
    return dict(sizes[size])


def rng(tag: int = 0) -> np.random.Generator:
    """Returns a deterministic numpy generator for synthetic data (seeded by SEED, tag)."""
    return np.random.default_rng((SEED, tag))


def global_batch(num_devices: int, per_device: int) -> int:
    """Returns the global batch size ``num_devices * per_device``."""
    return num_devices * per_device


def image_batch(tag: int, n: int, image: int, classes: int) -> dict[str, np.ndarray]:
    """A synthetic classification batch: ``images`` [n, image, image, 3] float32 and
    ``labels`` [n] int32 in ``[0, classes)``, drawn from ``rng(tag)``."""
    gen = rng(tag)
    return {
        "images": gen.standard_normal((n, image, image, 3), dtype="float32"),
        "labels": gen.integers(0, classes, (n,), dtype="int32"),
    }


def _init_leaf(gen: np.random.Generator, name: str, collection: str, shape, dtype):
    """Draws one variable: lecun-normal kernels/embeddings, zero biases/means, unit scales."""
    if name.endswith("bias") or name == "mean":
        return np.zeros(shape, dtype)
    if name in ("scale", "var"):
        return np.ones(shape, dtype)
    if collection == "params" and ("kernel" in name or "embedding" in name):
        fan_in = shape[-1] if "embedding" in name else int(np.prod(shape[:-1]))
        return (gen.standard_normal(shape) / np.sqrt(max(fan_in, 1))).astype(dtype)
    raise ValueError(f"no init rule for variable {collection}/{name} {shape}")


def init_variables(module: Any, *inputs: Any, tag: int = 0, **kwargs: Any) -> Pytree:
    """Initializes a Flax module deterministically from the fixed seed, on the host.

    Flax's initializers are not used: they draw with threefry, whose XLA:CPU compile
    takes about 2 s per distinct shape (5-10 s per model on 2 cores). Only the
    variable shapes come from Flax (``jax.eval_shape``, no compile); the values are
    drawn with numpy from ``SEED``: kernels and embeddings ``N(0, 1/fan_in)``
    (lecun normal), biases and batch-norm means 0, scales and variances 1.

    Args:
        module: a ``flax.linen.Module``.
        *inputs: example inputs (only shapes/dtypes matter).
        tag: stream of the numpy generator; give separately initialized modules of
            one model different tags.
        **kwargs: keyword arguments of ``module.__call__``.

    Returns:
        The variable dict (``{"params": ..., ...}``) of numpy arrays.
    """
    init = lambda key, *xs: module.init(key, *xs, **kwargs)
    shapes = jax.eval_shape(init, jax.random.PRNGKey(SEED), *inputs)
    gen = rng(1000 + tag)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    values = [
        _init_leaf(gen, path[-1].key, path[0].key, leaf.shape, leaf.dtype) for path, leaf in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, values)


def count_params(variables: Pytree) -> int:
    """Returns the number of scalars in ``variables["params"]``."""
    return int(sum(np.size(x) for x in jax.tree.leaves(variables["params"])))


def cross_entropy(logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None):
    """Mean softmax cross-entropy.

    Args:
        logits: ``[..., C]`` float logits.
        labels: ``[...]`` int class ids.
        weights: optional ``[...]`` float weights (e.g. the MLM mask); the mean is
            then ``sum(w * xent) / max(sum(w), 1)``.

    Returns:
        A float32 scalar.
    """
    xent = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    if weights is None:
        return jnp.mean(xent)
    return jnp.sum(xent * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _local_step(loss_fn: LossFn, optimizer: optax.GradientTransformation) -> StepFn:
    """The per-device step: local grads, one pmean per leaf, optimizer update."""

    def step(variables, opt_state, batch):
        params = variables["params"]
        rest = {k: v for k, v in variables.items() if k != "params"}

        def loss_of(p):
            return loss_fn({"params": p, **rest}, batch)

        (loss, state), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        grads = lax.pmean(grads, AXIS)
        state = lax.pmean(state, AXIS)
        loss = lax.pmean(loss.astype(jnp.float32), AXIS)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return {"params": params, **rest, **state}, opt_state, loss

    return step


def data_parallel_step(
    loss_fn: LossFn, optimizer: optax.GradientTransformation, mesh: Mesh
) -> StepFn:
    """Builds a data-parallel train step with ``jax.shard_map`` over axis ``"data"``.

    ``check_vma=False`` matters: with the default ``check_vma=True`` jax 0.10 treats
    the replicated params as device-invariant and inserts a ``psum`` in the transpose
    of their implicit broadcast, so ``pmean(grads)`` would add a second all-reduce per
    gradient (and the values would be summed, then averaged). Without the check the
    local gradient stays local and the explicit ``pmean`` is the only all-reduce.

    Args:
        loss_fn: ``loss_fn(variables, local_batch) -> (loss, new_state)``; ``new_state``
            maps non-trainable collections to their new (per-device) values.
        optimizer: an optax transformation over ``variables["params"]``.
        mesh: a 1-D mesh with axis ``"data"``.

    Returns:
        ``step(variables, opt_state, batch) -> (variables, opt_state, loss)``, a plain
        (not jitted) function; the batch leaves are split along axis 0.
    """
    return jax.shard_map(
        _local_step(loss_fn, optimizer),
        mesh=mesh,
        in_specs=(P(), P(), P(AXIS)),
        out_specs=(P(), P(), P()),
        check_vma=False,
    )


def place_args(mesh: Mesh, variables: Pytree, opt_state: Pytree, batch: Pytree):
    """Places the step arguments on the mesh.

    Args:
        mesh: the 1-D ``"data"`` mesh.
        variables: variable dict, replicated.
        opt_state: optimizer state, replicated.
        batch: dict of ``[global_batch, ...]`` arrays, sharded along axis 0.

    Returns:
        ``(variables, opt_state, batch)`` as committed jax arrays.
    """
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P(AXIS))
    return (
        jax.device_put(variables, replicated),
        jax.device_put(opt_state, replicated),
        jax.device_put(batch, sharded),
    )


def build(
    mesh: Mesh,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    variables: Pytree,
    batch: Pytree,
) -> tuple[StepFn, tuple[Pytree, Pytree, Pytree]]:
    """Builds ``(step_fn, example_args)`` for a shard_map model.

    Args:
        mesh: the 1-D ``"data"`` mesh.
        loss_fn: see :func:`data_parallel_step`.
        optimizer: optax transformation.
        variables: initial variable dict (host arrays).
        batch: dict of host arrays with leading axis the global batch.

    Returns:
        ``(step_fn, (variables, opt_state, batch))`` with the args placed on the mesh.
    """
    opt_state = jax.device_get(jax.jit(optimizer.init)(variables["params"]))
    step = data_parallel_step(loss_fn, optimizer, mesh)
    return step, place_args(mesh, variables, opt_state, batch)
