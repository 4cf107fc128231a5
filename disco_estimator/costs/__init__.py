"""The cost model and the simulator:

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
"""
