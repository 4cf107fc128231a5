"""Hand bucketing as a plan: flat gradient buckets of at most T bytes, in order of
production (Horovod's tensor fusion, PyTorch DDP's ``bucket_cap_mb``).

:func:`bucket_plan` walks the combinable all-reduces of a :class:`FusionSpace` in order of
gradient production (a stable sort of ``space.allreduces`` by the schedule position of each
gradient's producer, the order in which :func:`~hlo_tools.plan.allreduce_neighbours` and the
simulator's channel see them) and fills one bucket at a time:

* a gradient joins the open bucket while the bucket stays at most ``threshold_bytes``;
* a gradient larger than the threshold is a bucket of its own;
* the last bucket takes what is left, however small;
* ``threshold_bytes=None`` means no limit: one bucket.

A gradient that cannot join the open bucket for another reason (a different compatibility
key, or a dependence on the bucket, see :func:`~hlo_tools.plan.can_combine`) closes it and
opens the next one; with several keys (element types, say) each run of one key forms its
own buckets. Every bucket is made with :func:`~hlo_tools.plan.combine`, so the result is a
legal plan, and :func:`bucket_members` reads the buckets back in production order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hlo_tools.graph import NodeKind
from hlo_tools.plan.legality import can_combine
from hlo_tools.plan.merge import combine
from hlo_tools.plan.space import FusionSpace
from hlo_tools.plan.value import Plan, initial_plan

__all__ = ["BUCKET_THRESHOLDS", "bucket_members", "bucket_plan", "bucketed_name",
           "production_order", "ready_order"]

#: Bucket thresholds of the hand-bucketing sweep, in bytes (None: one bucket). NVIDIA's
#: advice to JAX users is a sweep in 2x steps; these span Horovod's and DDP's defaults in
#: 4x steps.
BUCKET_THRESHOLDS: tuple[int | None, ...] = (2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20, None)


def bucketed_name(threshold_bytes: int | None) -> str:
    """The name of the hand-bucketing program of a threshold: ``bucketed_16MiB``, or
    ``bucketed_one`` for one bucket (None)."""
    return "bucketed_one" if threshold_bytes is None else f"bucketed_{threshold_bytes >> 20}MiB"


def production_order(space: FusionSpace, plan: Plan) -> list[int]:
    """The combinable all-reduces of ``space`` in order of gradient production under
    ``plan``'s schedule: ``space.allreduces`` stably sorted by the position of each one's
    gradient producer (its own position when it has none)."""
    pos, producer = plan.pos, space.grad_producer
    return sorted(space.allreduces, key=lambda a: pos[producer.get(a, a)])


def ready_order(space: FusionSpace, weights: Sequence[float] | None = None) -> list[int]:
    """The combinable all-reduces of ``space`` in the order their gradients can be ready:
    what a backward pass that produces each next gradient as early as it can would give.

    The schedule position of a gradient's producer (:func:`production_order`) is not
    that order in the programs jax lowers: the weight-gradient ops follow the
    parameters' tree order, so a vgg's first convolution's weight gradient (which needs
    the whole backward pass) is placed before its classifier's (which needs only its
    last layer). A staged enactment cut in that order puts almost all the backward pass
    into its first stage.

    Greedy: repeatedly the gradient whose not yet computed ancestors (the producer
    included) weigh least comes next, ties by :func:`production_order`; once a
    gradient's ancestors are computed, the gradients that need nothing more follow at
    no cost. For a backward pass, where each layer's gradients need the layers after
    it, that is reverse layer order.

    Args:
        space: the graph's fusion space.
        weights: ``[N]`` what each node costs (e.g. the cost model's seconds); None:
            1 for every compute node, 0 for the rest.

    Returns:
        ``space.allreduces``, reordered.
    """
    graph = space.graph
    n = graph.num_nodes
    if weights is None:
        w = np.asarray([k == NodeKind.COMPUTE for k in graph.kinds], np.float64)
    else:
        w = np.asarray(weights, np.float64)
        if w.shape != (n,):
            raise ValueError(f"weights has shape {w.shape}, the graph {n} nodes")
    order = production_order(space, initial_plan(graph))
    if len(order) < 2:
        return order
    anc = [0] * n  # ancestor bitsets, the node itself included (nodes are topological)
    for i in range(n):
        bits = 1 << i
        for o in graph.operands[i]:
            bits |= anc[o]
        anc[i] = bits
    nbytes = (n + 7) // 8
    need = np.stack([np.unpackbits(np.frombuffer(
        anc[space.grad_producer.get(a, a)].to_bytes(nbytes, "little"), np.uint8),
        bitorder="little")[:n].astype(bool) for a in order])
    done = np.zeros(n, bool)
    left = list(range(len(order)))
    out = []
    while left:
        cost = (need[left] & ~done) @ w
        j = left.pop(int(np.argmin(cost)))  # argmin: the first of equals, in production order
        done |= need[j]
        out.append(order[j])
    return out


def bucket_plan(space: FusionSpace, threshold_bytes: int | None,
                base: Plan | None = None) -> Plan:
    """Flat gradient buckets of at most ``threshold_bytes`` each, in order of production.

    Args:
        space: the graph's fusion space; its ``allreduces`` are the gradients bucketed.
        threshold_bytes: most bytes of a bucket of two or more gradients (a single
            gradient above it stays alone); None: one bucket for everything that may be
            combined.
        base: the plan to add the buckets to (its fusions and schedule are kept); the
            initial plan when None. It must not combine all-reduces already.

    Returns:
        ``base`` with the buckets combined.

    Raises:
        ValueError: a negative threshold, or a ``base`` that already has buckets.
    """
    if threshold_bytes is not None and threshold_bytes < 0:
        raise ValueError(f"threshold_bytes must be >= 0 or None, got {threshold_bytes}")
    plan = initial_plan(space.graph) if base is None else base
    if any(plan.group[a] != a or _bucketed(plan, a) for a in space.allreduces):
        raise ValueError("the base plan already combines all-reduces")
    sizes = space.graph.out_bytes
    limit = float("inf") if threshold_bytes is None else threshold_bytes
    first, size = None, 0  # the open bucket: its first member and its bytes
    for ar in production_order(space, plan):
        grad = sizes[ar]
        if (first is not None and size + grad <= limit
                and can_combine(space, plan, first, ar)):
            plan = combine(space, plan, first, ar)
            size += grad
            continue
        first, size = ar, grad  # open a new bucket
        if grad > limit:
            first = None  # too big to share: alone, and the next gradient opens a bucket
    return plan


def _bucketed(plan: Plan, ar: int) -> bool:
    """Whether ``ar`` shares its group with another node."""
    g = plan.group[ar]
    p = plan.pos[ar]
    order = plan.order
    return ((p > 0 and plan.group[order[p - 1]] == g)
            or (p + 1 < len(order) and plan.group[order[p + 1]] == g))


def bucket_members(space: FusionSpace, plan: Plan) -> list[list[int]]:
    """The plan's buckets (a lone all-reduce is a bucket of one), each in order of
    production, the buckets ordered by their first member's production."""
    buckets: dict[int, list[int]] = {}
    for ar in production_order(space, plan):
        buckets.setdefault(plan.group[ar], []).append(ar)
    return list(buckets.values())
