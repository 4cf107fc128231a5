"""DisCo for JAX: joint op fusion, duplicate fusion and AllReduce fusion of a
data-parallel train step, chosen by a search costed by a simulator.

The public API, re-exported here:

* the cost model (:mod:`disco_jax.cost_model`): :class:`CostModel`, :class:`OpTimes`,
  :class:`BackendConstants`, :class:`GraphCosts`;
* plans to simulator graphs (:mod:`disco_jax.lower`): :func:`sim_graph`,
  :func:`sim_graph_from_module`, :func:`simulate_plan`;
* the simulator (:mod:`disco_jax.simulator`): :func:`simulate`, :class:`SimGraph`,
  :class:`SimResult`;
* the search (:mod:`disco_jax.search`): :func:`search` and its :class:`SearchOutcome`,
  :class:`SearchStats`, :class:`SearchConfig`, :func:`load_config`,
  :func:`baseline_plans`; the compact core :func:`backtracking_search`,
  :class:`SearchResult`;
* the model zoo, :mod:`disco_jax.zoo` (imported on first use: it imports jax);
* :func:`jit` (:mod:`disco_jax.jit`), the drop-in for ``jax.jit`` with the strategy store
  (:mod:`disco_jax.store`) and ``ENABLE_SEARCH``.

Importing the package does not import jax.
"""

from __future__ import annotations

import importlib
from typing import Any

from disco_jax.cost_model import BackendConstants, CostModel, GraphCosts, OpTimes
from disco_jax.jit import jit
from disco_jax.lower import sim_graph, sim_graph_from_module, simulate_plan
from disco_jax.search import (
    SearchConfig,
    SearchOutcome,
    SearchResult,
    SearchStats,
    backtracking_search,
    baseline_plans,
    load_config,
    search,
)
from disco_jax.simulator import SimGraph, SimResult, simulate

__all__ = [
    "BackendConstants",
    "CostModel",
    "GraphCosts",
    "OpTimes",
    "SearchConfig",
    "SearchOutcome",
    "SearchResult",
    "SearchStats",
    "SimGraph",
    "SimResult",
    "backtracking_search",
    "baseline_plans",
    "jit",
    "load_config",
    "search",
    "sim_graph",
    "sim_graph_from_module",
    "simulate",
    "simulate_plan",
    "zoo",
]


def __getattr__(name: str) -> Any:
    """``disco_jax.zoo`` on first use (it imports jax, flax and optax)."""
    if name == "zoo":
        return importlib.import_module("disco_jax.zoo")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
