"""The GNN fused-op estimator (section 4.3 of the DisCo paper) on jraph, Flax and Optax.

* :mod:`~disco_estimator.gnn.features`: a fusion group as a :class:`FusedSubgraph` and as a
  padded ``jraph.GraphsTuple``; the canonical key of a fused subgraph;
* :mod:`~disco_estimator.gnn.model`: the attention message-passing network (eqs. (1), (2));
* :mod:`~disco_estimator.gnn.train`: training on log time with Adam;
* :mod:`~disco_estimator.gnn.checkpoint`: checkpoints (msgpack with a JSON header);
* :mod:`~disco_estimator.gnn.estimator`: :class:`GnnFusedEstimator`, the
  :class:`~disco_estimator.interface.BatchedFusedOpEstimator` the cost model plugs in;
* :mod:`~disco_estimator.gnn.dataset`: the measured samples (random plans' groups and XLA's
  own fusions, timed as standalone fused ops);
* :mod:`~disco_estimator.gnn.evaluate`: accuracy against measured times, the fallback rule on
  a subgraph, held-out splits (pure numpy).

Importing this package imports jax.
"""
