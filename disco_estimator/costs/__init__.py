"""The cost model and the simulator: what a step's plans cost, from op times, fused-op
estimators and the AllReduce model.

* :mod:`~disco_estimator.costs.cost_model` -- op times, fused-op estimators and the AllReduce
  model into per-node costs (and the op times a module lacks, timed standalone);
* :mod:`~disco_estimator.costs.fused_choice` -- which fused-op estimator (the GNN or the
  fallback rule) prices fused ops;
* :mod:`~disco_estimator.costs.lower` -- plans and modules into simulator graphs, and a
  module's simulated seconds;
* :mod:`~disco_estimator.costs.simulator` -- the ready-queue simulator (with a C kernel);
* :mod:`~disco_estimator.costs.staged_cost` -- the cost model of staged enactments;
* :mod:`~disco_estimator.costs.trace` -- Chrome traces of simulations;
* :mod:`~disco_estimator.costs.constants_fit` -- the backend constants fitted to measured
  iterations (hardware files from a benchmark's measurements).

The package exports what pricing a plan or a module as written takes (the cost model, the
lowering to simulator graphs, the simulator, the fused-op estimator's choice); the staged
cost model, traces and the constants fit are imported from their modules.
"""

from disco_estimator.costs.cost_model import BackendConstants, CostModel, cover
from disco_estimator.costs.fused_choice import FusedChoice, choose_fused_estimator
from disco_estimator.costs.lower import (
    predict_module,
    sim_graph,
    sim_graph_from_module,
    simulate_plan,
    simulated_s,
)
from disco_estimator.costs.simulator import SimGraph, SimResult, full_overlap_bound, simulate

__all__ = [
    "BackendConstants",
    "CostModel",
    "FusedChoice",
    "SimGraph",
    "SimResult",
    "choose_fused_estimator",
    "cover",
    "full_overlap_bound",
    "predict_module",
    "sim_graph",
    "sim_graph_from_module",
    "simulate",
    "simulate_plan",
    "simulated_s",
]
