"""Model zoo: data-parallel train steps to optimize.

Every entry is ``make(num_devices, size="tiny") -> (step_fn, (params, opt_state, batch))``
where ``step_fn`` is a plain (not jitted) function returning
``(new_params, new_opt_state, loss)`` and the arguments are already placed on a 1-D
``"data"`` mesh over ``jax.devices()[:num_devices]`` (batch sharded, the rest
replicated). Sizes: ``"tiny"`` (seconds to compile on 2 CPU cores), ``"small"`` and
``"medium"`` (2-10 M parameters: gradients large enough that a 1 Gbit/s link matters),
``"large"`` (``"medium"`` with 4x the per-device batch: about as much computation as
communication over 1 Gbit/s).

:data:`MODELS` are ``shard_map`` programs with explicit gradient all-reduces: the
pre-optimization HLO has exactly one ``all-reduce`` per leaf of ``params`` plus one
for the loss (see :mod:`disco_jax.zoo.common`). :data:`AUTO_SHARDED` is a ``jax.jit``
program without ``shard_map`` whose all-reduces appear only after XLA's partitioner.
"""

from __future__ import annotations

from collections.abc import Callable

from disco_jax.zoo import auto_sharded, bert, reformer, resnet, rnnlm, transformer, vgg

AUTO_SHARDED = "auto_sharded"

MODELS: dict[str, Callable] = {
    "vgg": vgg.make,
    "resnet": resnet.make,
    "transformer": transformer.make,
    "rnnlm": rnnlm.make,
    "rnnlm_unrolled": rnnlm.make_unrolled,
    "bert": bert.make,
    "reformer": reformer.make,
}

_ALL = {**MODELS, AUTO_SHARDED: auto_sharded.make}

__all__ = ["AUTO_SHARDED", "MODELS", "get", "names"]


def names() -> list[str]:
    """Returns every valid model name (the shard_map models, then ``AUTO_SHARDED``)."""
    return list(_ALL)


def get(name: str) -> Callable:
    """Returns the ``make`` function of a model.

    Args:
        name: a key of :data:`MODELS` or :data:`AUTO_SHARDED`.

    Returns:
        ``make(num_devices, size="tiny") -> (step_fn, example_args)``.

    Raises:
        ValueError: unknown name; the message lists the valid names.
    """
    try:
        return _ALL[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(_ALL)}") from None
