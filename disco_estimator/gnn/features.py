"""Features of a fused op for the GNN: a fused subgraph as data, and as ``jraph.GraphsTuple``.

A fusion group -- ``members`` of a :class:`~hlo_tools.graph.DeviceGraph` plus the
``copies`` of duplicated producers -- is first described as a :class:`FusedSubgraph`:
plain per-node and per-edge arrays, independent of jax, that the on-disk dataset stores
and the estimator's cache keys by (:func:`canonical_key`). It is then encoded
(:func:`encode`) and batched into a ``jraph.GraphsTuple`` (:func:`batch`), padded to one
of a few static sizes (:func:`pad_to_bucket`) so that training and inference compile
once per bucket, never once per graph.

Node features (one node per member or copy, in topological order):

* ``opcode``: int32 id over :data:`OPCODE_VOCAB` -- id 0 is the *unknown* bucket for an
  opcode this version does not list, the others are :data:`hlo_tools.opcodes.HLO_OPCODES`
  sorted;
* ``dtype``: int32 id over :data:`DTYPE_VOCAB` (id 0: unknown element type);
* ``x``: float32 ``[NUM_NODE_FEATURES]``: ``log1p`` of the bytes the op reads and of
  the bytes it writes, ``log`` of its own measured single-op time in microseconds
  (floored at :data:`MIN_TIME_S`), whether its value leaves the fused op, whether it is a
  duplicated copy.

Edges: every data dependency inside the group in both directions, plus a self-loop on
each node (the neighbourhood ``N_i`` of eq. (1) of the paper includes ``i``); edge
features: ``[E, 2]`` float32 one-hot of the direction (producer -> consumer, consumer ->
producer); self-loops are ``[0, 0]``.

Globals: ``x`` float32 ``[NUM_GLOBAL_FEATURES]``: ``log`` of the member count, ``log1p``
of the fused op's input and output bytes in MiB, ``log`` of the sum and of the largest
member time in microseconds; ``base``: float32 scalar, ``log`` of the sum of the member
times in seconds (the model predicts a correction to it).

Times are seconds and sizes bytes unless a feature says otherwise.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jraph
import numpy as np

from disco_estimator.interface import NodeCosts
from hlo_tools.graph import DeviceGraph
from hlo_tools.opcodes import HLO_OPCODES
from hlo_tools.plan import group_outputs

__all__ = [
    "DTYPE_VOCAB",
    "FEATURE_VERSION",
    "FusedSubgraph",
    "MIN_TIME_S",
    "NUM_GLOBAL_FEATURES",
    "NUM_NODE_FEATURES",
    "OPCODE_VOCAB",
    "UNKNOWN",
    "batch",
    "bucket_sizes",
    "canonical_key",
    "dtype_id",
    "encode",
    "encode_batch",
    "opcode_id",
    "pad_to_bucket",
    "subgraph_from_group",
    "unpad",
]

#: Version of the features; stored in datasets and checkpoints, bumped on any change.
FEATURE_VERSION = 1
#: Name of the unknown bucket (id 0) of both vocabularies.
UNKNOWN = "<unknown>"
#: Opcode vocabulary: id 0 is :data:`UNKNOWN`, then every opcode of
#: :data:`hlo_tools.opcodes.HLO_OPCODES` in sorted order.
OPCODE_VOCAB: tuple[str, ...] = (UNKNOWN, *sorted(HLO_OPCODES))
#: Element-type vocabulary: id 0 is :data:`UNKNOWN`.
DTYPE_VOCAB: tuple[str, ...] = (UNKNOWN, "pred", "s8", "s16", "s32", "s64", "u8", "u16",
                                "u32", "u64", "f16", "bf16", "f32", "f64", "c64", "c128",
                                "f8e4m3fn", "f8e5m2")
#: Times below this (e.g. ops that run no kernel, 0 s) are floored to it before ``log``.
MIN_TIME_S = 1e-8
NUM_NODE_FEATURES = 5
NUM_GLOBAL_FEATURES = 5

_OPCODE_IDS = {op: i for i, op in enumerate(OPCODE_VOCAB)}
_DTYPE_IDS = {dt: i for i, dt in enumerate(DTYPE_VOCAB)}
_MIB = float(1 << 20)


def opcode_id(opcode: str) -> int:
    """Id of ``opcode`` in :data:`OPCODE_VOCAB` (0, the unknown bucket, if absent)."""
    return _OPCODE_IDS.get(opcode, 0)


def dtype_id(element_type: str) -> int:
    """Id of an element type in :data:`DTYPE_VOCAB` (0, the unknown bucket, if absent)."""
    return _DTYPE_IDS.get(element_type, 0)


class FusedSubgraph(NamedTuple):
    """One fused op as plain arrays (what the dataset stores and the cache keys by).

    ``n`` nodes (members and copies, in topological order) and ``e`` internal edges.

    Attributes:
        opcodes: ``[n]`` opcode of each node.
        dtypes: ``[n]`` element type of each node's result (``"tuple"`` etc. allowed).
        time_s: ``[n]`` float64, each node's measured single-op time, seconds.
        in_bytes: ``[n]`` int64, bytes each node reads when run alone.
        out_bytes: ``[n]`` int64, bytes each node writes.
        is_output: ``[n]`` bool, the node's value leaves the fused op.
        is_copy: ``[n]`` bool, the node is a duplicated producer.
        senders: ``[e]`` int32, producer node of each internal data dependency.
        receivers: ``[e]`` int32, consumer node of each internal data dependency.
        input_bytes: bytes the fused op reads from outside (each value once).
        output_bytes: bytes the fused op writes (its outputs).
    """

    opcodes: tuple[str, ...]
    dtypes: tuple[str, ...]
    time_s: np.ndarray
    in_bytes: np.ndarray
    out_bytes: np.ndarray
    is_output: np.ndarray
    is_copy: np.ndarray
    senders: np.ndarray
    receivers: np.ndarray
    input_bytes: int
    output_bytes: int

    @property
    def num_nodes(self) -> int:
        return len(self.opcodes)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (lists of numbers and strings)."""
        return {"opcodes": list(self.opcodes), "dtypes": list(self.dtypes),
                "time_s": [float(t) for t in self.time_s],
                "in_bytes": [int(b) for b in self.in_bytes],
                "out_bytes": [int(b) for b in self.out_bytes],
                "is_output": [bool(b) for b in self.is_output],
                "is_copy": [bool(b) for b in self.is_copy],
                "senders": [int(s) for s in self.senders],
                "receivers": [int(r) for r in self.receivers],
                "input_bytes": int(self.input_bytes), "output_bytes": int(self.output_bytes)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FusedSubgraph:
        """Inverse of :meth:`to_json`."""
        return cls(tuple(data["opcodes"]), tuple(data["dtypes"]),
                   np.asarray(data["time_s"], np.float64),
                   np.asarray(data["in_bytes"], np.int64),
                   np.asarray(data["out_bytes"], np.int64),
                   np.asarray(data["is_output"], np.bool_),
                   np.asarray(data["is_copy"], np.bool_),
                   np.asarray(data["senders"], np.int32),
                   np.asarray(data["receivers"], np.int32),
                   int(data["input_bytes"]), int(data["output_bytes"]))


def subgraph_from_group(graph: DeviceGraph, nodes: NodeCosts, members: Sequence[int],
                        copies: Sequence[int] = (), outputs: Sequence[int] | None = None
                        ) -> FusedSubgraph:
    """The :class:`FusedSubgraph` of one fusion group.

    Args:
        graph: the graph the group belongs to.
        nodes: the graph's node arrays (e.g. ``CostModel.node_costs(graph)``); a node's
            single-op time is ``launch_s + mem_s + compute_s``.
        members: node indices of the group.
        copies: producers duplicated into the group.
        outputs: members whose values leave the group (default:
            :func:`hlo_tools.plan.group_outputs`).

    Returns:
        The subgraph, nodes in ascending (topological) node order.
    """
    copy_set = set(copies) - set(members)
    inside = sorted(set(members) | copy_set)
    local = {g: k for k, g in enumerate(inside)}
    outs = set(group_outputs(graph, None, members) if outputs is None else outputs)
    ptr, idx, reads = nodes.op_ptr, nodes.op_idx, nodes.read_bytes
    senders: list[int] = []
    receivers: list[int] = []
    in_bytes = np.zeros(len(inside), np.int64)
    external: dict[int, int] = {}
    for k, i in enumerate(inside):
        for e in range(int(ptr[i]), int(ptr[i + 1])):
            o = int(idx[e])
            in_bytes[k] += int(reads[e])
            if o in local:
                senders.append(local[o])
                receivers.append(k)
            elif reads[e] > external.get(o, -1):
                external[o] = int(reads[e])
    order = np.asarray(inside, np.int64)
    time_s = (nodes.launch_s[order] + nodes.mem_s[order] + nodes.compute_s[order]) \
        if inside else np.zeros(0)
    instrs = graph.computation.instructions
    return FusedSubgraph(
        opcodes=tuple(graph.opcodes[i] for i in inside),
        dtypes=tuple(instrs[i].shape.element_type or "tuple" for i in inside),
        time_s=np.asarray(time_s, np.float64),
        in_bytes=in_bytes,
        out_bytes=np.asarray([int(nodes.write_bytes[i]) for i in inside], np.int64),
        is_output=np.asarray([i in outs for i in inside], np.bool_),
        is_copy=np.asarray([i in copy_set for i in inside], np.bool_),
        senders=np.asarray(senders, np.int32),
        receivers=np.asarray(receivers, np.int32),
        input_bytes=int(sum(external.values())),
        output_bytes=int(sum(int(nodes.write_bytes[i]) for i in outs)),
    )


def canonical_key(sub: FusedSubgraph, digits: int = 4) -> bytes:
    """A key equal for every fused subgraph that the GNN sees identically.

    Node names and graph positions are not part of a :class:`FusedSubgraph`; nodes are in
    topological order and edges are sorted, so two groups computing the same ops on the
    same sizes with the same member times share a key. Times are rounded to ``digits``
    significant digits (measurement noise below that changes nothing worth recomputing).

    Returns:
        A 20-byte SHA-1 digest.
    """
    h = hashlib.sha1()
    h.update(f"v{FEATURE_VERSION}|{'/'.join(sub.opcodes)}|{'/'.join(sub.dtypes)}|".encode())
    h.update(np.array([float(f"{t:.{digits - 1}e}") for t in sub.time_s], np.float64).tobytes())
    h.update(sub.in_bytes.astype(np.int64).tobytes())
    h.update(sub.out_bytes.astype(np.int64).tobytes())
    h.update(np.packbits(sub.is_output).tobytes() + b"|" + np.packbits(sub.is_copy).tobytes())
    edges = sorted(zip(sub.senders.tolist(), sub.receivers.tolist()))
    h.update(np.asarray(edges, np.int64).tobytes())
    h.update(f"|{sub.input_bytes}|{sub.output_bytes}".encode())
    return h.digest()


# --------------------------------------------------------------------------- encoding


def _log_us(t: np.ndarray | float) -> np.ndarray:
    return np.log(np.maximum(np.asarray(t, np.float64), MIN_TIME_S) * 1e6)


def encode(sub: FusedSubgraph) -> jraph.GraphsTuple:
    """One fused subgraph as a single-graph ``jraph.GraphsTuple`` of numpy arrays.

    Returns:
        ``nodes = {"opcode": [n] int32, "dtype": [n] int32, "x": [n, NUM_NODE_FEATURES]
        float32}``, ``edges = [2e + n, 2] float32`` (direction one-hot, self-loops last),
        ``globals = {"x": [1, NUM_GLOBAL_FEATURES] float32, "base": [1] float32}``.
    """
    n = sub.num_nodes
    x = np.stack([np.log1p(sub.in_bytes.astype(np.float64)),
                  np.log1p(sub.out_bytes.astype(np.float64)),
                  _log_us(sub.time_s),
                  sub.is_output.astype(np.float64),
                  sub.is_copy.astype(np.float64)], axis=-1).astype(np.float32)
    loops = np.arange(n, dtype=np.int32)
    senders = np.concatenate([sub.senders, sub.receivers, loops]).astype(np.int32)
    receivers = np.concatenate([sub.receivers, sub.senders, loops]).astype(np.int32)
    e = len(sub.senders)
    edges = np.zeros((2 * e + n, 2), np.float32)
    edges[:e, 0] = 1.0
    edges[e:2 * e, 1] = 1.0
    total = float(np.maximum(sub.time_s, 0.0).sum())
    largest = float(sub.time_s.max()) if n else 0.0
    g = np.array([[math.log(max(n, 1)),
                   math.log1p(sub.input_bytes / _MIB), math.log1p(sub.output_bytes / _MIB),
                   float(_log_us(total)), float(_log_us(largest))]], np.float32)
    return jraph.GraphsTuple(
        nodes={"opcode": np.array([opcode_id(o) for o in sub.opcodes], np.int32).reshape(n),
               "dtype": np.array([dtype_id(d) for d in sub.dtypes], np.int32).reshape(n),
               "x": x.reshape(n, NUM_NODE_FEATURES)},
        edges=edges, senders=senders, receivers=receivers,
        globals={"x": g, "base": np.array([math.log(max(total, MIN_TIME_S))], np.float32)},
        n_node=np.array([n], np.int32), n_edge=np.array([2 * e + n], np.int32))


def batch(graphs: Sequence[jraph.GraphsTuple]) -> jraph.GraphsTuple:
    """Several encoded graphs as one ``GraphsTuple`` (numpy; ``jraph.batch_np``)."""
    return jraph.batch_np(list(graphs))


def _next_size(n: int, minimum: int) -> int:
    """The smallest ``minimum * 4**k`` (k >= 0) that is >= n."""
    size = minimum
    while size < n:
        size *= 4
    return size


def bucket_sizes(n_node: int, n_edge: int, n_graph: int) -> tuple[int, int, int]:
    """The static padded sizes of a batch: ``(nodes, edges, graphs)``, each from a
    geometric ladder (x4: nodes from 64, edges from 256, graphs from 8), with room for
    the padding graph (one extra node and graph)."""
    return (_next_size(n_node + 1, 64), _next_size(n_edge, 256), _next_size(n_graph + 1, 8))


def pad_to_bucket(graph: jraph.GraphsTuple) -> jraph.GraphsTuple:
    """Pads a batch to its :func:`bucket_sizes` with ``jraph.pad_with_graphs``."""
    n_node, n_edge, n_graph = bucket_sizes(int(np.sum(graph.n_node)), int(np.sum(graph.n_edge)),
                                           len(graph.n_node))
    return jraph.pad_with_graphs(graph, n_node, n_edge, n_graph)


def encode_batch(subs: Sequence[FusedSubgraph], pad: bool = True) -> jraph.GraphsTuple:
    """Several fused subgraphs encoded, batched and padded at once (vectorised numpy).

    Equal to ``pad_to_bucket(batch([encode(s) for s in subs]))`` (or, with ``pad=False``,
    to ``batch([encode(s) for s in subs])``) up to float rounding, about ten times
    faster: the estimator's inference and training build their batches with it.

    Args:
        subs: ``B >= 1`` fused subgraphs, each with at least one node.
        pad: pad to :func:`bucket_sizes` with the padding graph of
            ``jraph.pad_with_graphs``.

    Returns:
        The batch (numpy arrays); with ``pad`` its sizes are :func:`bucket_sizes`.
    """
    b = len(subs)
    n = np.fromiter((len(s.opcodes) for s in subs), np.int64, count=b)
    e = np.fromiter((len(s.senders) for s in subs), np.int64, count=b)
    if b == 0 or (n < 1).any():
        raise ValueError("encode_batch needs at least one subgraph, each with a node")
    total_n, total_e = int(n.sum()), int(e.sum())
    cum_n = np.concatenate([[0], np.cumsum(n)[:-1]])
    cum_e = np.concatenate([[0], np.cumsum(e)[:-1]])
    graph_of_node = np.repeat(np.arange(b), n)
    graph_of_edge = np.repeat(np.arange(b), e)
    time_s = np.concatenate([s.time_s for s in subs]).astype(np.float64)
    x = np.stack([np.log1p(np.concatenate([s.in_bytes for s in subs]).astype(np.float64)),
                  np.log1p(np.concatenate([s.out_bytes for s in subs]).astype(np.float64)),
                  _log_us(time_s),
                  np.concatenate([s.is_output for s in subs]).astype(np.float64),
                  np.concatenate([s.is_copy for s in subs]).astype(np.float64)],
                 axis=-1).astype(np.float32)
    opcode = np.fromiter((_OPCODE_IDS.get(o, 0) for s in subs for o in s.opcodes), np.int32,
                         count=total_n)
    dtype = np.fromiter((_DTYPE_IDS.get(d, 0) for s in subs for d in s.dtypes), np.int32,
                        count=total_n)
    # Edges of graph g in encode's order: e forward, e backward, n self-loops.
    n_edge = 2 * e + n
    m_edges = int(n_edge.sum())
    snd = np.concatenate([s.senders for s in subs]).astype(np.int64) + cum_n[graph_of_edge] \
        if total_e else np.zeros(0, np.int64)
    rcv = np.concatenate([s.receivers for s in subs]).astype(np.int64) + cum_n[graph_of_edge] \
        if total_e else np.zeros(0, np.int64)
    k = np.arange(total_e)
    fwd = cum_e[graph_of_edge] + cum_n[graph_of_edge] + k          # 2*cum_e + cum_n + (k - cum_e)
    bwd = fwd + e[graph_of_edge]
    i = np.arange(total_n)
    loop = 2 * cum_e[graph_of_node] + 2 * e[graph_of_node] + i       # + cum_n + (i - cum_n)
    senders = np.empty(m_edges, np.int32)
    receivers = np.empty(m_edges, np.int32)
    edges = np.zeros((m_edges, 2), np.float32)
    senders[fwd], receivers[fwd], edges[fwd, 0] = snd, rcv, 1.0
    senders[bwd], receivers[bwd], edges[bwd, 1] = rcv, snd, 1.0
    senders[loop], receivers[loop] = i, i
    starts = cum_n.astype(np.int64)
    total = np.add.reduceat(np.maximum(time_s, 0.0), starts)
    largest = np.maximum.reduceat(time_s, starts)
    glob = np.stack([np.log(n.astype(np.float64)),
                     np.log1p(np.fromiter((s.input_bytes for s in subs), np.float64, b) / _MIB),
                     np.log1p(np.fromiter((s.output_bytes for s in subs), np.float64, b) / _MIB),
                     _log_us(total), _log_us(largest)], axis=-1).astype(np.float32)
    base = np.log(np.maximum(total, MIN_TIME_S)).astype(np.float32)
    n_node, n_edges = n.astype(np.int32), n_edge.astype(np.int32)
    if pad:
        pn, pe, pg = bucket_sizes(total_n, m_edges, b)
        extra_n, extra_e, extra_g = pn - total_n, pe - m_edges, pg - b
        opcode = np.concatenate([opcode, np.zeros(extra_n, np.int32)])
        dtype = np.concatenate([dtype, np.zeros(extra_n, np.int32)])
        x = np.concatenate([x, np.zeros((extra_n, NUM_NODE_FEATURES), np.float32)])
        edges = np.concatenate([edges, np.zeros((extra_e, 2), np.float32)])
        senders = np.concatenate([senders, np.full(extra_e, total_n, np.int32)])
        receivers = np.concatenate([receivers, np.full(extra_e, total_n, np.int32)])
        glob = np.concatenate([glob, np.zeros((extra_g, NUM_GLOBAL_FEATURES), np.float32)])
        base = np.concatenate([base, np.zeros(extra_g, np.float32)])
        zeros = np.zeros(extra_g - 1, np.int32)
        n_node = np.concatenate([n_node, [extra_n], zeros]).astype(np.int32)
        n_edges = np.concatenate([n_edges, [extra_e], zeros]).astype(np.int32)
    return jraph.GraphsTuple(
        nodes={"opcode": opcode, "dtype": dtype, "x": x}, edges=edges,
        senders=senders, receivers=receivers, globals={"x": glob, "base": base},
        n_node=n_node, n_edge=n_edges)


def unpad(padded: jraph.GraphsTuple) -> jraph.GraphsTuple:
    """Removes the padding :func:`pad_to_bucket` added (``jraph.unpad_with_graphs``)."""
    return jraph.unpad_with_graphs(padded)
