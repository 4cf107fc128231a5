"""Training data of the fused-op GNN: fusion groups measured as standalone fused ops.

Generation (:func:`generate`), for one HLO module at a time:

1. **Groups**: the compute groups of random plans (:func:`hlo_tools.plan.random_moves`,
   op fusion and duplicate fusion: a group grows by fusing an op with a producer or a
   consumer, as the paper draws them), deduplicated (:func:`plan_groups`). Only
   single-output groups are measured for now (see :func:`fused_module`).
2. **Member times**: every member's single-op time, timed standalone by
   :func:`estimator.op_bench.bench_ops` (cached on disk, as the cost model does), so the
   features are those the estimator will see at search time.
3. **Module**: each group as a standalone HLO module whose ENTRY holds one parameter
   per value read from outside and one ``fusion`` (kind ``kLoop``) of the members
   (:func:`fused_module`).
4. **Time**: compiled with XLA's fusion passes off
   (:func:`hlo_tools.jax_bridge.compile_standalone`, ``exact=True``), fed random inputs
   (:func:`estimator.op_bench.random_inputs`: floats in [0.5, 2), small integers; index
   operands of gather/scatter/dynamic-(update-)slice are 0, always in bounds) and timed
   by :func:`estimator.op_bench.time_standalone` (``warmup`` untraced runs, ``repeats``
   traced runs, the median kept).

Samples are JSON lines in ``<cache_dir("gnn")>/dataset-v<DATASET_VERSION>-<hash of the
backend fingerprint>.jsonl`` (:func:`dataset_path`): one :class:`Sample` per line, keyed
by the group's canonical form; generation appends, skips keys already stored (so a
stopped run resumes), and prints progress on stderr.

Times are seconds and sizes bytes throughout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from estimator import op_bench
from estimator.gnn.features import FEATURE_VERSION, FusedSubgraph, canonical_key
from estimator.gnn.features import subgraph_from_group as _features_of
from estimator.interface import NodeCosts
from hlo_tools import dirs
from hlo_tools import plan as P
from hlo_tools.graph import DeviceGraph, NodeKind, device_graph
from hlo_tools.ir import HloComputation, HloInstruction, HloModule
from hlo_tools.opcodes import READS_RESULT_SIZE_OPCODES
from hlo_tools.printer import to_text

__all__ = [
    "DATASET_VERSION",
    "Sample",
    "dataset_path",
    "fused_module",
    "generate",
    "load_samples",
    "node_arrays",
    "plan_groups",
]

#: Version of how samples are drawn, built and timed (part of the file name).
DATASET_VERSION = 1
#: Opcodes whose operands past the first are indices (drawn as 0: in bounds).
_INDEXED = frozenset({"gather", "scatter", "dynamic-slice", "dynamic-update-slice"})


@dataclasses.dataclass(frozen=True)
class Sample:
    """One measured fused op.

    Attributes:
        key: hex canonical key of the subgraph (:func:`~estimator.gnn.features.canonical_key`).
        source: where the group was drawn (e.g. the zoo model's name).
        subgraph: the fused op's features.
        time_s: median seconds of one execution of the fused op.
        p25_s: 25th percentile, seconds.
        p75_s: 75th percentile, seconds.
        samples: timed executions.
    """

    key: str
    source: str
    subgraph: FusedSubgraph
    time_s: float
    p25_s: float
    p75_s: float
    samples: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "source": self.source, "subgraph": self.subgraph.to_json(),
                "time_s": self.time_s, "p25_s": self.p25_s, "p75_s": self.p75_s,
                "samples": self.samples, "feature_version": FEATURE_VERSION}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Sample:
        return cls(str(d["key"]), str(d["source"]), FusedSubgraph.from_json(d["subgraph"]),
                   float(d["time_s"]), float(d["p25_s"]), float(d["p75_s"]),
                   int(d["samples"]))


def dataset_path(fingerprint: dict[str, Any], directory: str | os.PathLike | None = None
                 ) -> Path:
    """The JSON-lines file of one backend fingerprint (default directory:
    ``hlo_tools.dirs.cache_dir("gnn")``)."""
    tag = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(directory) if directory is not None else dirs.cache_dir("gnn")
    return root / f"dataset-v{DATASET_VERSION}-{tag}.jsonl"


def load_samples(path: str | os.PathLike) -> list[Sample]:
    """Every sample of a dataset file (a torn last line is skipped; missing file: [])."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                if d.get("feature_version") == FEATURE_VERSION:
                    out.append(Sample.from_json(d))
    except FileNotFoundError:
        return []
    return out


# --------------------------------------------------------------------------- groups


def plan_groups(graph: DeviceGraph, seed: int, plans: int = 8, moves: int = 80
                ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Distinct multi-node compute groups ``(members, copies)`` of random plans.

    Args:
        graph: the graph.
        seed: seed of the first plan (plan ``k`` uses ``seed + k``).
        plans: random plans drawn.
        moves: moves per plan (op fusion 60%, duplicate fusion 40%).
    """
    space = P.FusionSpace(graph)
    out: dict[tuple[tuple[int, ...], tuple[int, ...]], None] = {}
    for k in range(plans):
        plan = P.random_moves(space, P.initial_plan(graph), random.Random(seed + k), moves,
                              weights=(0.6, 0.4, 0.0))
        copies: dict[int, list[int]] = {}
        for p, g in plan.dups:
            copies.setdefault(g, []).append(p)
        for gid, ms in plan.groups().items():
            if len(ms) > 1 and graph.kinds[ms[0]] == NodeKind.COMPUTE:
                out.setdefault((tuple(sorted(ms)), tuple(sorted(copies.get(gid, [])))))
    return list(out)


def node_arrays(graph: DeviceGraph, time_s: np.ndarray, free: np.ndarray) -> NodeCosts:
    """The node arrays the features read, built as ``disco_jax.cost_model.GraphCosts``
    builds them (reads of slice-like ops capped at their result, ops without a kernel
    read nothing); the whole time is put in ``compute_s``.

    Args:
        graph: the graph.
        time_s: ``[N]`` single-op seconds.
        free: ``[N]`` bool, ops that run no kernel.
    """
    n = graph.num_nodes
    ops = [tuple(dict.fromkeys(o)) for o in graph.operands]
    ptr = np.zeros(n + 1, np.int64)
    np.cumsum([len(o) for o in ops], out=ptr[1:])
    idx = np.fromiter((o for os_ in ops for o in os_), np.int32, count=int(ptr[-1]))
    dst = np.repeat(np.arange(n, dtype=np.int32), np.diff(ptr))
    wb = np.array([i.shape.byte_size() for i in graph.computation.instructions], np.int64)
    reads = wb[idx].astype(np.int64) if idx.size else np.zeros(0, np.int64)
    for k in range(n):
        if graph.opcodes[k] in READS_RESULT_SIZE_OPCODES:
            reads[ptr[k]:ptr[k + 1]] = np.minimum(reads[ptr[k]:ptr[k + 1]], wb[k])
    reads[free[dst]] = 0
    traffic = np.where(free, 0, wb) + np.bincount(dst, weights=reads, minlength=n).astype(
        np.int64)
    zero = np.zeros(n)
    return NodeCosts(zero, zero, np.asarray(time_s, np.float64), traffic, wb, ptr, idx, reads)


# --------------------------------------------------------------------------- modules


def fused_module(graph: DeviceGraph, members: Sequence[int], copies: Sequence[int] = (),
                 name: str = "disco_fused") -> tuple[str, list[op_bench.InputSpec]]:
    """A single-output group as a standalone module holding one ``fusion``.

    Multi-output groups are refused: jaxlib 0.10.2's XLA:CPU aborts the process (a failed
    ``has_layout()`` check, not an exception) compiling a module whose tuple-shaped
    ``fusion`` is built this way, so they cannot be measured standalone yet.

    Raises:
        ValueError: the group has more than one output.

    Returns:
        ``(HLO text, one InputSpec per parameter)``.
    """
    instrs = graph.computation.instructions
    inside = sorted(set(members) | set(copies))
    local = set(inside)
    outputs = list(P.group_outputs(graph, None, members)) or [max(members)]
    if len(outputs) > 1:
        raise ValueError(f"group has {len(outputs)} outputs; only single-output fusions "
                         "are built (XLA:CPU aborts on a standalone multi-output fusion)")
    params: list[HloInstruction] = []
    entry_params: list[HloInstruction] = []
    specs: list[op_bench.InputSpec] = []
    inner: dict[int, str] = {}
    body: list[HloInstruction] = []
    for node in inside:
        src = instrs[node]
        ops = []
        for pos, o in enumerate(graph.operands[node]):
            if o not in local and o not in inner:
                shape = instrs[o].shape
                k = len(params)
                params.append(HloInstruction(f"p{k}", "parameter", shape, payload=str(k)))
                entry_params.append(HloInstruction(f"a{k}", "parameter", shape,
                                                   payload=str(k)))
                index = src.opcode in _INDEXED and pos > 0 and shape.element_type.startswith(
                    ("s", "u"))
                specs.append(op_bench.InputSpec(shape, 1 if index else 0))
                inner[o] = f"p{k}"
            ops.append(inner[o])
        body.append(src.copy(name=f"n{node}", operands=ops, attrs=op_bench.standalone_attrs(src)))
        inner[node] = f"n{node}"
    root, shape = inner[outputs[0]], instrs[outputs[0]].shape
    fused = HloComputation("fused_group", params + body, root)
    fusion = HloInstruction("fusion", "fusion", shape, [p.name for p in entry_params],
                            {"kind": "kLoop", "calls": "fused_group"})
    entry = HloComputation("main", [*entry_params, fusion], "fusion", is_entry=True)
    comps = [*op_bench.called_closure(graph.module, (instrs[i] for i in inside)), fused, entry]
    return to_text(HloModule(name, {}, comps, percent_names=False)), specs


# --------------------------------------------------------------------------- generation


def _member_times(module: HloModule, graph: DeviceGraph, nodes: Iterable[int],
                  replicas: int, progress: bool) -> tuple[np.ndarray, np.ndarray]:
    """``[N]`` single-op seconds (NaN where unknown) and ``[N]`` free flags."""
    instrs = graph.computation.instructions
    wanted = sorted(set(nodes))
    timings = op_bench.bench_ops(module, [instrs[i] for i in wanted], replicas=replicas,
                                 progress=progress)
    view = op_bench.module_view(module)
    t = np.full(graph.num_nodes, math.nan)
    free = np.zeros(graph.num_nodes, np.bool_)
    for i in range(graph.num_nodes):
        status = op_bench.op_status(instrs[i])[0]
        if status == "free":
            t[i], free[i] = 0.0, True
        elif status == "bench" and i in set(wanted):
            hit = timings.get(op_bench.timing_key(view, instrs[i]))
            if hit is not None and hit.ok:
                t[i] = hit.time_s
    return t, free


def generate(modules: Sequence[tuple[str, str]], *, per_module: int = 50, seed: int = 0,
             repeats: int = 15, warmup: int = 3, replicas: int = 1,
             directory: str | os.PathLike | None = None, progress: bool | None = None
             ) -> tuple[Path, int]:
    """Draws, builds, times and stores fused-op samples (resumable).

    Args:
        modules: ``(source name, HLO text)`` pairs, e.g. zoo models' pre-optimization HLO.
        per_module: new samples to add per module at most.
        seed: seed of the random plans.
        repeats: traced runs per fused op (median kept).
        warmup: untraced runs first.
        replicas: devices running each op at once (part of the fingerprint).
        directory: dataset directory (default: ``cache_dir("gnn")``).
        progress: print progress on stderr (default: when it is a terminal).

    Returns:
        ``(dataset file, samples added)``.
    """
    from hlo_tools import jax_bridge, parse

    shown = sys.stderr.isatty() if progress is None else progress
    fingerprint = op_bench.backend_fingerprint(replicas)
    path = dataset_path(fingerprint, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    known = {s.key for s in load_samples(path)}
    added = 0
    t0 = time.perf_counter()
    for source, text in modules:
        module = parse(text)
        graph = device_graph(module)
        groups = plan_groups(graph, seed)
        times, free = _member_times(module, graph, (i for m, c in groups for i in (*m, *c)),
                                    replicas, shown)
        nodes = node_arrays(graph, np.nan_to_num(times), free)
        todo = []
        for ms, cs in groups:
            if (np.isnan(times[list(ms) + list(cs)]).any()
                    or len(P.group_outputs(graph, None, ms)) > 1):
                continue
            sub = _features_of(graph, nodes, ms, cs)
            key = canonical_key(sub).hex()
            if key not in known:
                known.add(key)
                todo.append((ms, cs, sub, key))
            if len(todo) >= per_module:
                break
        items = []
        for ms, cs, sub, key in todo:
            text_k, specs = fused_module(graph, ms, cs, name=f"disco_fused_{key[:16]}")
            try:
                exe = jax_bridge.compile_standalone(text_k, exact=True, replicas=replicas)
                placed = exe.put(*op_bench.random_inputs(specs, seed=int(key[:8], 16)))
            except Exception as err:  # a group XLA rejects standalone: not a sample
                if shown:
                    sys.stderr.write(f"\n{source}: skipped a group: {str(err)[:120]}\n")
                continue
            items.append((exe, placed, sub, key))
        samples = op_bench.time_standalone([(e, p) for e, p, _, _ in items],
                                           repeats=repeats, warmup=warmup)
        with open(path, "a", encoding="utf-8") as f:
            for exe, _, sub, key in items:
                runs = samples.get(exe.module_name, [])
                if not runs:
                    continue
                q25, q50, q75 = np.percentile(runs, [25, 50, 75])
                sample = Sample(key, source, sub, float(q50), float(q25), float(q75), len(runs))
                f.write(json.dumps(sample.to_json()) + "\n")
                added += 1
        if shown:
            sys.stderr.write(f"{source}: {len(items)} fused ops timed, {added} added "
                             f"({time.perf_counter() - t0:.0f} s)\n")
    return path, added
