"""The GNN as a fused-op estimator: :class:`GnnFusedEstimator`.

It implements :class:`~disco_estimator.interface.FusedOpEstimator` and
:class:`~disco_estimator.interface.BatchedFusedOpEstimator`. Member single-op times come from
the same :class:`~disco_estimator.interface.NodeCostSource` as the fallback rule's
(``source.node_costs(graph)``, e.g. the cost model itself), so both estimators see the
same measurements. Predictions are cached by the fused subgraph's canonical form
(:func:`~disco_estimator.gnn.features.canonical_key`), and the uncached ones of a batch are
encoded at once (:func:`~disco_estimator.gnn.features.encode_batch`) and run through one
jitted forward pass per chunk, padded to static buckets (one compilation per bucket).
``benchmarks/gnn_inference_speed.py`` measures the throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from disco_estimator.gnn import checkpoint as ckpt_io
from disco_estimator.gnn.features import (
    FusedSubgraph,
    canonical_key,
    encode_batch,
    subgraph_from_group,
)
from disco_estimator.gnn.model import FusedOpGnn, GnnConfig
from disco_estimator.interface import NodeCostSource
from hlo_tools.graph import DeviceGraph

__all__ = ["GnnFusedEstimator"]


class GnnFusedEstimator:
    """Fused-op times predicted by the GNN of section 4.3 of the paper.

    Args:
        params: parameters of :class:`~disco_estimator.gnn.model.FusedOpGnn`.
        config: its sizes.
        source: gives the :class:`~disco_estimator.interface.NodeCosts` of a graph (the member
            times), e.g. ``disco_estimator.costs.cost_model.CostModel``; may be set later with
            :meth:`bind` (a cost model that needs the estimator at construction).
        chunk: fused ops per forward pass (511 fills the 512-graph bucket with the
            padding graph).
        jit: run the forward pass jitted (False: op by op, for checks).
    """

    def __init__(self, params: Any, config: GnnConfig, source: NodeCostSource | None = None,
                 *, chunk: int = 511, jit: bool = True):
        self.params = jax.device_put(params) if jit else params
        self.config = config
        self.source = source
        self.chunk = chunk
        self.cache: dict[bytes, float] = {}
        model = FusedOpGnn(config)
        self._apply = jax.jit(model.apply) if jit else model.apply

    @classmethod
    def from_checkpoint(cls, path: str, source: NodeCostSource | None = None,
                        **kwargs: Any) -> GnnFusedEstimator:
        """An estimator from a file written by :func:`disco_estimator.gnn.checkpoint.save`."""
        ck = ckpt_io.load(path)
        return cls(ck.params, ck.config, source, **kwargs)

    def bind(self, source: NodeCostSource) -> GnnFusedEstimator:
        """Sets the member-time source (e.g. the cost model that uses this estimator)."""
        self.source = source
        return self

    # -- on fused subgraphs

    def predict_subgraphs(self, subs: Sequence[FusedSubgraph]) -> np.ndarray:
        """Seconds of each fused subgraph, ``[len(subs)]`` float64 (cached by canonical
        form). A single op without copies is predicted as its own measured time."""
        keys = [canonical_key(s) for s in subs]
        todo: dict[bytes, FusedSubgraph] = {}
        for k, s in zip(keys, subs):
            if k in self.cache or k in todo:
                continue
            if s.num_nodes == 1:  # a single op is its own measured time
                self.cache[k] = float(max(s.time_s[0], 0.0))
            else:
                todo[k] = s
        items = list(todo.items())
        for start in range(0, len(items), self.chunk):
            part = items[start:start + self.chunk]
            padded = encode_batch([s for _, s in part])
            log_t = np.asarray(self._apply(self.params, padded), np.float64)
            self.cache.update(zip((k for k, _ in part), np.exp(log_t[:len(part)]).tolist()))
        return np.array([self.cache[k] for k in keys], np.float64)

    # -- the estimator protocol

    def _subgraph(self, graph: DeviceGraph, members: Sequence[int], copies: Sequence[int],
                  outputs: Sequence[int] | None) -> FusedSubgraph:
        if self.source is None:
            raise RuntimeError("GnnFusedEstimator has no member-time source; call bind()")
        return subgraph_from_group(graph, self.source.node_costs(graph), members, copies,
                                   outputs)

    def predict(self, graph: DeviceGraph, members: Sequence[int],
                copies: Sequence[int] = (), outputs: Sequence[int] | None = None) -> float:
        """Seconds of one execution of the fused op (see
        :class:`~disco_estimator.interface.FusedOpEstimator`)."""
        return float(self.predict_subgraphs([self._subgraph(graph, members, copies,
                                                            outputs)])[0])

    def predict_batch(self, graph: DeviceGraph,
                      groups: Sequence[tuple[Sequence[int], Sequence[int]]]) -> np.ndarray:
        """Seconds for each ``(members, copies)`` group, ``[len(groups)]`` float64."""
        subs = [self._subgraph(graph, m, c, None) for m, c in groups]
        return self.predict_subgraphs(subs)
