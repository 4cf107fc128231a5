"""DisCo for JAX: joint op fusion, duplicate fusion and AllReduce fusion of a
data-parallel train step, chosen by a search costed by a simulator.

Importing the package does not import jax.
"""

from disco_jax.costs import (
    BackendConstants,
    BatchedFusedOpEstimator,
    CostModel,
    FallbackFusedEstimator,
    FusedOpEstimator,
    GraphCosts,
    OpTimes,
    sim_graph,
    sim_graph_from_module,
    simulate_plan,
)

__all__ = [
    "BackendConstants",
    "BatchedFusedOpEstimator",
    "CostModel",
    "FallbackFusedEstimator",
    "FusedOpEstimator",
    "GraphCosts",
    "OpTimes",
    "sim_graph",
    "sim_graph_from_module",
    "simulate_plan",
]
