"""DisCo for JAX: joint op fusion, duplicate fusion and AllReduce fusion of a
data-parallel train step, chosen by a search costed by a simulator and by measurement.

What a user calls:

* :func:`jit`, the drop-in for ``jax.jit`` (``ENABLE_SEARCH=1`` searches and stores,
  ``0`` runs the stored program), with :class:`RunInfo` (what a call ran) and
  :class:`DiscoFallbackWarning` (why it ran plain ``jax.jit``);
* :func:`optimize_step`, the whole pipeline for one step, returning the winner as an
  :class:`Optimized` whose ``enactment`` (an :class:`Enactment`) is what the store keeps;
* :func:`search` (Algorithm 1 of the DisCo paper over a step's graph) and
  :func:`simulate` (the ready-queue simulator);
* :mod:`disco_jax.store`, the strategy store, and :mod:`disco_jax.zoo`, the train steps
  the project optimizes.

Everything else stays importable from its module (the cost model from
:mod:`disco_estimator.costs.cost_model`, plans to simulator graphs from
:mod:`disco_estimator.costs.lower`, ...).
Importing the package does not import jax.
"""

from __future__ import annotations

import importlib
from typing import Any

from disco_estimator.costs.simulator import simulate
from disco_jax.jit import DiscoFallbackWarning, RunInfo, jit
from disco_jax.pipeline.optimize import Optimized, optimize_step
from disco_jax.pipeline.search import search

__all__ = [
    "DiscoFallbackWarning",
    "Enactment",
    "Optimized",
    "RunInfo",
    "jit",
    "optimize_step",
    "search",
    "simulate",
    "store",
    "zoo",
]

#: Names imported on first use: they import jax (and the zoo flax and optax).
_LAZY = {"Enactment": ("disco_jax.enactment", "Enactment"), "store": ("disco_jax.store", None),
         "zoo": ("disco_jax.zoo", None)}


def __getattr__(name: str) -> Any:
    """:class:`Enactment`, :mod:`disco_jax.store` and :mod:`disco_jax.zoo` on first use."""
    if name in _LAZY:
        module, attr = _LAZY[name]
        loaded = importlib.import_module(module)
        return getattr(loaded, attr) if attr else loaded
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
