"""Plans to simulator graphs: a plan over a :class:`~hlo_tools.graph.DeviceGraph`, or a
module as written, becomes a :class:`~disco_estimator.costs.simulator.SimGraph`.

:func:`sim_graph` turns a plan into a SimGraph -- one node per group in the plan's
schedule order -- and is on the search's hot path: everything that does not depend on
the plan is computed once per graph in the cost model's
:class:`~disco_estimator.costs.cost_model.GraphCosts`, fused-op estimates are cached by group, and
the per-plan work is a handful of numpy passes over the N nodes.
:func:`sim_graph_from_module` simulates a module *as written* (e.g. XLA's own plan from
``lowered.compile().as_text()``): every instruction is a kernel, ``fusion``
instructions are predicted by the fused-op estimator from their fused computations
(never measured as fusions), and all-reduces -- also tuple-shaped ones from XLA's
combiner, and ``all-reduce-start``/``-done`` -- are communication nodes.
:func:`simulate_plan` costs a plan: its SimGraph through
:func:`disco_estimator.costs.simulator.simulate`; :func:`simulated_s` a module as written,
and :func:`predict_module` the same with the ops the cost model has no time for timed
standalone first.

Times are seconds and sizes bytes throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from disco_estimator.costs.cost_model import CostModel, GraphCosts, cover
from disco_estimator.costs.simulator import SimGraph, SimResult, simulate
from hlo_tools.graph import DeviceGraph, device_graph
from hlo_tools.ir import HloModule
from hlo_tools.plan import Plan, initial_plan

__all__ = ["affine_simulation", "predict_module", "sim_graph", "sim_graph_from_module",
           "simulate_plan", "simulated_s"]


def _runs(plan: Plan, n: int) -> tuple[np.ndarray, ...]:
    """Group runs of the schedule: (order, group, start positions, lengths, run of pos)."""
    order = np.frombuffer(plan.order, dtype=np.int32) if plan.order.itemsize == 4 else \
        np.asarray(plan.order, dtype=np.int32)
    group = np.frombuffer(plan.group, dtype=np.int32) if plan.group.itemsize == 4 else \
        np.asarray(plan.group, dtype=np.int32)
    g_ord = group[order]
    head = np.ones(n, dtype=np.bool_)
    head[1:] = g_ord[1:] != g_ord[:-1]
    starts = np.flatnonzero(head)
    lens = np.diff(starts, append=n)
    run_of_pos = np.cumsum(head) - 1
    return order, group, starts, lens, run_of_pos


def sim_graph(graph: DeviceGraph, plan: Plan, costs: CostModel) -> SimGraph:
    """The :class:`SimGraph` of ``plan``: one node per group, in the plan's schedule order.

    * a singleton keeps its own time (a collective runs on the channel);
    * a fusion group (two or more compute nodes, or a group holding copies of
      duplicated producers) is one compute node timed by the fused-op estimator;
    * an AllReduce bucket of k all-reduces becomes, as :func:`hlo_tools.rewrite.apply_plan`
      writes it, a compute node concatenating the gradients into a flat buffer, one
      communication node ``T = C * bytes + D`` for the whole buffer, and k compute nodes
      slicing each gradient back out (the reshapes are bitcasts); the copies are priced
      by :meth:`~disco_estimator.costs.cost_model.CostModel.copy_time`;
    * an all-reduce that pays the latency ``D`` (one buffer, or a bucket) pays it less
      :meth:`~disco_estimator.costs.cost_model.CostModel.fused_wait_s` times the share
      of the step's ops that run in kernels of several ops (a plan's fusion groups, a
      fusion XLA wrote): ``D`` is fitted on the program with nothing fused, where each
      all-reduce also waits beside small kernels.

    Dependencies follow the plan's group-contracted graph. Parameters and constants are
    zero-time nodes whose bytes are persistent; tuples, ``get-tuple-element``, bitcasts
    and reshapes take no time and no memory. Every compute duration is multiplied by
    :attr:`~disco_estimator.costs.cost_model.BackendConstants.compute_scale`. Groups that duplicate
    fusion left without readers (every reader holds its own copy) cost nothing: XLA
    deletes them.

    Node ``k`` of the result is the ``k``-th group of the schedule (a bucket takes
    ``k + 2`` nodes), so the nodes of a schedule prefix that two plans share have the
    same indices and durations in both SimGraphs.

    Cost: a few numpy passes over the N nodes and E edges plus a dict lookup per fusion
    group (fused-op estimates are cached per group in the graph's
    :class:`~disco_estimator.costs.cost_model.GraphCosts`).

    Args:
        graph: the per-device graph.
        plan: a plan over ``graph``.
        costs: the cost model.

    Returns:
        The SimGraph (topologically ordered, int32 CSR).
    """
    gc = costs.graph_costs(graph)
    n = graph.num_nodes
    if n == 0:
        empty = np.zeros(0, dtype=np.int32)
        return SimGraph((), np.zeros(0, np.bool_), np.zeros(0), np.zeros(0, np.int64),
                        np.zeros(1, np.int32), empty, gc.persistent_bytes)
    order, group, starts, lens, run_of_pos = _runs(plan, n)
    heads = order[starts]
    copies = _copies_by_group(plan)
    multi = lens > 1
    bucket = multi & gc.is_comm[heads]
    fusion = multi & ~bucket
    if copies:
        has_copies = np.zeros(n, dtype=np.bool_)
        has_copies[list(copies)] = True
        fusion |= has_copies[group[heads]]
    width = 1 + bucket * (1 + lens)
    sim_start = np.cumsum(width) - width
    size = int(sim_start[-1] + width[-1]) if n else 0
    pos_in_run = np.arange(n) - starts[run_of_pos]
    in_bucket = bucket[run_of_pos]
    out = np.empty(n, dtype=np.int32)
    out[order] = sim_start[run_of_pos] + np.where(in_bucket, 2 + pos_in_run, 0)
    reader = np.empty(n, dtype=np.int32)
    reader[order] = sim_start[run_of_pos]
    src, dst = _edges(gc, plan, group, out, reader, copies)
    dur = np.zeros(size, dtype=np.float64)
    comm = np.zeros(size, dtype=np.bool_)
    nbytes = np.zeros(size, dtype=np.int64)
    names = np.empty(size, dtype=object)
    single = ~multi & ~fusion
    at, hd = sim_start[single], heads[single]
    dur[at], comm[at], nbytes[at], names[at] = (gc.time_s[hd], gc.is_comm[hd],
                                                gc.out_bytes[hd], gc.names_arr[hd])
    _fill_fusions(gc, plan, order, starts, lens, sim_start, np.flatnonzero(fusion), copies,
                  dur, nbytes, names)
    extra = _fill_buckets(gc, costs, order, starts, lens, sim_start, np.flatnonzero(bucket),
                          dur, comm, nbytes, names)
    wait = costs.fused_wait_s
    if wait > 0.0:
        alone = gc.ops[hd]  # a single node's kernel: fused where XLA wrote a fusion
        fused_ops = gc.ops[order[fusion[run_of_pos]]].sum() + alone[alone > 1].sum()
        share = float(fused_ops) / max(int(gc.ops.sum()), 1)
        waits = np.concatenate([at[gc.pays_d[hd]], sim_start[bucket] + 1])
        dur[waits] = np.maximum(dur[waits] - share * wait, 0.0)
    if extra[0].size:
        src, dst = np.concatenate([src, extra[0]]), np.concatenate([dst, extra[1]])
    if costs.constants.compute_scale != 1.0:
        dur[~comm] *= costs.constants.compute_scale
    edges = dst.astype(np.int64) * size + src
    edges.sort()
    if edges.size > 1:  # drop duplicate edges (several members reading one value)
        edges = edges[np.concatenate(([True], edges[1:] != edges[:-1]))]
    dst = edges // size
    src = edges - dst * size
    gone = fusion[run_of_pos]  # constants fused into a kernel (or dropped with it)
    if plan.dups:
        dead = _dead_nodes(gc, plan, group, heads, sim_start, reader, src, dst, size)
        if dead.size:  # XLA deletes them and apply_plan does not write them
            dur[dead], nbytes[dead] = 0.0, 0
            keep = ~np.isin(dst, dead)
            src, dst = src[keep], dst[keep]
            runs = np.searchsorted(sim_start, dead)
            gone = gone | np.isin(run_of_pos, runs)
    ptr = np.zeros(size + 1, dtype=np.int32)
    np.cumsum(np.bincount(dst, minlength=size), out=ptr[1:])
    persistent = gc.persistent_bytes - int(gc.constant_bytes[order[gone]].sum())
    return SimGraph(tuple(names.tolist()), comm, dur, nbytes, ptr, src.astype(np.int32),
                    persistent)


def _dead_nodes(gc: GraphCosts, plan: Plan, group: np.ndarray, heads: np.ndarray,
                sim_start: np.ndarray, reader: np.ndarray, src: np.ndarray, dst: np.ndarray,
                size: int) -> np.ndarray:
    """Sim nodes of compute groups nobody reads any more because every reader holds its
    own copy: :func:`hlo_tools.plan.dead_groups` on the sim edges, where a copy reads
    another copy held by its group rather than the original (as apply_plan writes it)."""
    by_src = np.argsort(src, kind="stable")
    succ, succ_ptr = dst[by_src], np.zeros(size + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=size), out=succ_ptr[1:])
    pred_ptr = np.zeros(size + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=size), out=pred_ptr[1:])
    fusible = np.zeros(size, dtype=np.bool_)
    fusible[sim_start] = gc.fusible[group[heads]]
    root = int(reader[gc.root])
    dead: set[int] = set()
    todo = {int(reader[p]) for p, _ in plan.dups}
    while todo:
        s = todo.pop()
        if s in dead or s == root or not fusible[s]:
            continue
        if all(d in dead for d in succ[succ_ptr[s]:succ_ptr[s + 1]].tolist()):
            dead.add(s)
            todo.update(src[pred_ptr[s]:pred_ptr[s + 1]].tolist())
            todo.update(d for d in dead if d != s)  # readers of earlier candidates may be gone
    return np.array(sorted(dead), dtype=np.int64)


def _copies_by_group(plan: Plan) -> dict[int, tuple[int, ...]]:
    out: dict[int, list[int]] = {}
    for p, g in plan.dups:
        out.setdefault(g, []).append(p)
    return {g: tuple(sorted(ps)) for g, ps in out.items()}


def _csr_rows(ptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entries of the CSR rows ``rows``: (entry indices, position in ``rows`` of each)."""
    counts = ptr[rows + 1] - ptr[rows]
    which = np.repeat(np.arange(rows.size), counts)
    first = np.repeat(ptr[rows] - (np.cumsum(counts) - counts), counts)
    return first + np.arange(which.size), which


def _edges(gc: GraphCosts, plan: Plan, group: np.ndarray, out: np.ndarray, reader: np.ndarray,
           copies: Mapping[int, tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """Sim edges ``src -> dst`` between groups (a copy's reads belong to its group)."""
    e_dst, e_src = gc.edge_dst, gc.op_idx
    mask = group[e_dst] != group[e_src]
    if not plan.dups:
        return out[e_src[mask]], reader[e_dst[mask]]
    dups = np.array(sorted(plan.dups), dtype=np.int64).reshape(-1, 2)
    dup_p, dup_g = dups[:, 0], dups[:, 1]
    # a group holding a copy of p reads the copy, not p: cut p's edges into the group
    edges, which = _csr_rows(gc.use_ptr, dup_p)
    edges = gc.use_edge[edges]
    mask[edges[group[e_dst[edges]] == dup_g[which]]] = False
    src, dst = out[e_src[mask]], reader[e_dst[mask]]
    # ... and the copy reads p's operands, unless they are in the group or copies too
    ops, which = _csr_rows(gc.op_ptr, dup_p)
    o, g = e_src[ops], dup_g[which]
    keep = (group[o] != g) & ~np.isin(o * gc.n + g, dup_p * gc.n + dup_g)
    return (np.concatenate([src, out[o[keep]]]),
            np.concatenate([dst, reader[g[keep]]]))


def _fill_fusions(gc: GraphCosts, plan: Plan, order: np.ndarray, starts: np.ndarray,
                  lens: np.ndarray, sim_start: np.ndarray, runs: np.ndarray,
                  copies: Mapping[int, tuple[int, ...]], dur: np.ndarray, nbytes: np.ndarray,
                  names: np.ndarray) -> None:
    """Times, output bytes and names of the fusion groups' nodes."""
    if not runs.size:
        return
    order_l = order.tolist()
    first = starts[runs]
    spans = zip(first.tolist(), (first + lens[runs]).tolist())
    groups = [tuple(order_l[a:b]) for a, b in spans]
    if copies:
        group = plan.group
        keys = [(g, copies.get(group[g[0]], ())) for g in groups]
        dup_p = np.array(sorted({p for p, _ in plan.dups}), dtype=np.int64)
        # the duplicated producers and the operands their copies read
        special = set(dup_p.tolist()) | set(gc.op_idx[_csr_rows(gc.op_ptr, dup_p)[0]].tolist())
        leaves = None
        for k, (g, c) in enumerate(keys):
            if not special.isdisjoint(g):
                if leaves is None:
                    leaves = _leaving(gc, plan)
                keys[k] = (g, c, tuple(m for m in g if leaves[m]))
    else:
        keys = [(g, ()) for g in groups]
    hits = list(map(gc.fused_cache.get, keys))
    if None in hits:
        gc.prefetch([key for key, hit in zip(keys, hits) if hit is None and len(key) == 2])
        hits = [hit or gc.fused(*key) for key, hit in zip(keys, hits)]
    at = sim_start[runs]
    t, ob, nm = zip(*hits)
    dur[at], nbytes[at], names[at] = t, ob, nm


def _leaving(gc: GraphCosts, plan: Plan) -> list[bool]:
    """Per node, whether its value leaves its group: :func:`hlo_tools.plan.group_outputs`'s
    rule for every node at once (the root; a reader in another group that holds no copy
    of it; a copy held by another group that reads it)."""
    n, group = gc.n, np.frombuffer(plan.group, dtype=np.int32) \
        if plan.group.itemsize == 4 else np.asarray(plan.group, dtype=np.int32)
    dups = np.array(sorted(plan.dups), dtype=np.int64).reshape(-1, 2)
    dup_codes = dups[:, 0] * n + dups[:, 1]
    out = np.zeros(n, dtype=np.bool_)
    out[gc.root] = True
    src, rg = gc.op_idx.astype(np.int64), group[gc.edge_dst].astype(np.int64)
    cross = rg != group[src]
    src, rg = src[cross], rg[cross]
    out[src[~np.isin(src * n + rg, dup_codes)]] = True
    ops, which = _csr_rows(gc.op_ptr, dups[:, 0])
    o, h = gc.op_idx[ops].astype(np.int64), dups[which, 1]
    cross = h != group[o]
    o, h = o[cross], h[cross]
    out[o[~np.isin(o * n + h, dup_codes)]] = True
    return out.tolist()


def _fill_buckets(gc: GraphCosts, costs: CostModel, order: np.ndarray, starts: np.ndarray,
                  lens: np.ndarray, sim_start: np.ndarray, runs: np.ndarray, dur: np.ndarray,
                  comm: np.ndarray, nbytes: np.ndarray, names: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate / AllReduce / slice nodes of each bucket; returns their edges."""
    src: list[int] = []
    dst: list[int] = []
    for r in runs.tolist():
        s, k, at = int(starts[r]), int(lens[r]), int(sim_start[r])
        members = order[s:s + k]
        sizes = gc.write_bytes[members]
        total = int(sizes.sum())
        first = gc.names_arr[members[0]]
        dur[at], nbytes[at], names[at] = costs.copy_time(total), total, f"{first}.buffer"
        dur[at + 1], comm[at + 1], nbytes[at + 1] = costs.allreduce_time(total), True, total
        names[at + 1] = f"{first}.bucket"
        dur[at + 2:at + 2 + k] = [costs.copy_time(b) for b in sizes.tolist()]
        nbytes[at + 2:at + 2 + k] = sizes
        names[at + 2:at + 2 + k] = gc.slice_names[members]
        src += [at] + [at + 1] * k
        dst += [at + 1] + list(range(at + 2, at + 2 + k))
    return np.asarray(src, dtype=np.int32), np.asarray(dst, dtype=np.int32)


def sim_graph_from_module(module: HloModule, costs: CostModel) -> SimGraph:
    """The :class:`SimGraph` of a module as written.

    Every instruction of the per-device computation (the shard_map body, else ENTRY) is
    its own node: ``fusion`` instructions are timed by the fused-op estimator from their
    fused computations' single ops (never measured as fusions), collectives (tuple-shaped
    combined all-reduces and ``all-reduce-start`` included; ``-done`` is free) run on
    the channel, control flow costs its bodies. Use it on ``lowered.compile().as_text()``
    to simulate XLA's own plan.
    """
    graph = device_graph(module)
    return sim_graph(graph, initial_plan(graph), costs)


def simulate_plan(graph: DeviceGraph, plan: Plan, costs: CostModel) -> SimResult:
    """Simulates ``plan`` with the cost model's overlap phi (no graph check: the SimGraph
    of :func:`sim_graph` is valid by construction)."""
    return simulate(sim_graph(graph, plan, costs), costs.overlap, check=False)


def simulated_s(module: HloModule, costs: CostModel) -> float:
    """Simulated seconds per iteration of ``module`` as written, under ``costs``."""
    return simulate(sim_graph_from_module(module, costs), costs.overlap).iteration_s


def affine_simulation(module: HloModule, model: Callable[..., CostModel],
                      x0: Sequence[float], steps: Sequence[float]) -> Callable[..., float]:
    """Simulated seconds per iteration of ``module`` as written, as a function of
    constants of the cost model that every node's duration is affine in, jointly: the
    compute scale (it multiplies every compute node) with the all-reduce's ``C`` and
    ``D`` (communication nodes only), or the saving share alone (a fused kernel's price
    falls affinely in it down to a floor; with the compute scale it is a product).

    The module's :class:`SimGraph` is built at ``x0`` and once more per constant,
    ``steps[i]`` away in the ``i``-th; any other values then cost one simulation, not a
    new cost model and its graph costs (1-2 s each on a step of 5,000 nodes).

    Args:
        module: the module as written.
        model: the cost model at given values of the constants, ``model(*x)``.
        x0: the values to build the base graph at.
        steps: a nonzero step per constant.

    Returns:
        ``at(*x, overlap=None)``: the simulated seconds per iteration at ``x`` (durations
        below 0, far outside the range the steps span, count as 0), with the simulator's
        phi ``overlap`` (None: the cost model's at ``x0``; phi sets no duration).
    """
    base_model = model(*x0)
    base = sim_graph_from_module(module, base_model)
    slopes = []
    for i, h in enumerate(steps):
        x = list(x0)
        x[i] += h
        slopes.append((sim_graph_from_module(module, model(*x)).duration_s
                       - base.duration_s) / h)
    phi = base_model.overlap

    def at(*x: float, overlap: float | None = None) -> float:
        dur = base.duration_s.copy()
        for xi, x0i, slope in zip(x, x0, slopes, strict=True):
            dur += (xi - x0i) * slope
        return simulate(base._replace(duration_s=np.maximum(dur, 0.0)),
                        phi if overlap is None else overlap).iteration_s

    return at


def predict_module(module: HloModule, costs: CostModel) -> float:
    """Predicted seconds per iteration of a module as written (e.g. XLA's compiled
    program), its ops the profile lacks timed standalone first
    (:func:`~disco_estimator.costs.cost_model.cover`)."""
    cover(costs, module)
    return simulated_s(module, costs)
