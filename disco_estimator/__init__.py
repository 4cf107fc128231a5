"""Cost estimation for DisCo: measured per-op times, the linear AllReduce model, and the
cost model and simulator that price a step's plans with them.

* :mod:`disco_estimator.ops`: op times in one place: op keys (opcode + shapes) so a time
  measured in one program serves identical ops elsewhere (``ops.keys``), per-instruction
  times from ``jax.profiler`` traces (``ops.trace``), every unique single op of a module
  timed standalone (``ops.standalone``) and cached on disk per backend fingerprint
  (``ops.cache``), and the op-time table with stored JSON profiles and an analytic
  fallback for ops never measured (``ops.table``).
* :mod:`disco_estimator.allreduce`: ``T(bytes) = C * bytes + D`` fitted on psum
  microbenchmarks.
* :mod:`disco_estimator.hardware`: hardware files (the AllReduce model and the backend's cost
  constants of one setup): found in the user's config directory, else shipped in
  ``disco_estimator/hardware_files/``; read, validated and written atomically.
* :mod:`disco_estimator.probes`: probe programs for the in-program all-reduce latency and the
  compute/communication overlap.
* :mod:`disco_estimator.gloo`: processes and the (emulated) network of gloo jobs.
* :mod:`disco_estimator.interface`: the fused-op estimator protocols and the fallback rule.
* :mod:`disco_estimator.gnn`: the GNN fused-op estimator.
* :mod:`disco_estimator.costs`: the cost model (op times, fused-op estimators and the
  AllReduce model into per-node costs), plans and modules into simulator graphs, the
  ready-queue simulator, the staged cost model, Chrome traces of simulations, and the
  backend constants fitted to measured iterations.

The names below are the ones a user of this layer starts from: the cost model and the
simulator (:class:`CostModel`, :func:`sim_graph_from_module`, :func:`simulate`,
:func:`predict_module`), hardware files (:class:`HardwareConfig`, :func:`find_hardware`,
:func:`load_hardware`, :class:`HardwareError`), the AllReduce model
(:class:`AllReduceModel`, :func:`fit_allreduce`) and op times (:class:`OpTimes`,
:class:`OpProfile`, :func:`profile_ops`). Everything else is imported from its module.

Importing this package does not import jax (workers set device flags before that).
"""

from disco_estimator.allreduce import AllReduceModel, fit_allreduce
from disco_estimator.costs.cost_model import CostModel
from disco_estimator.costs.lower import predict_module, sim_graph_from_module
from disco_estimator.costs.simulator import simulate
from disco_estimator.hardware import HardwareConfig, HardwareError, find_hardware, load_hardware
from disco_estimator.ops import OpProfile, OpTimes, profile_ops

__all__ = [
    "AllReduceModel",
    "CostModel",
    "HardwareConfig",
    "HardwareError",
    "OpProfile",
    "OpTimes",
    "find_hardware",
    "fit_allreduce",
    "load_hardware",
    "predict_module",
    "profile_ops",
    "sim_graph_from_module",
    "simulate",
]
