"""Training data of the fused-op GNN: fusion groups measured as standalone fused ops.

Generation (:func:`generate`), for one HLO module at a time:

1. **Groups**, of one of two :data:`KINDS` (each sample records its ``kind``):

   * ``"plan"``: the compute groups of random plans (:func:`hlo_tools.plan.random_moves`,
     op fusion and duplicate fusion: a group grows by fusing an op with a producer or a
     consumer, as the paper draws them), deduplicated (:func:`plan_groups`), from a
     pre-optimization module;
   * ``"xla"``: XLA's own fusions (:func:`xla_groups`), from a post-optimization module
     (``lowered.compile().as_text()``): each ``fusion`` of the per-device program with
     two or more ops is a group over the graph of its fused computation, as the
     simulator and ``disco estimate`` see it (library fusions, ``kCustom``, are not).

   Only single-output groups are measured for now (see :func:`fused_module`).
2. **Member times**: every member's single-op time, timed standalone by
   :func:`disco_estimator.ops.bench_ops` (cached on disk, as the cost model does), so the
   features are those the estimator will see at search time.
3. **Module**: each group as a standalone HLO module whose ENTRY holds one parameter
   per value read from outside and one ``fusion`` (kind ``kLoop``) of the members
   (:func:`fused_module`).
4. **Time**: compiled with XLA's fusion passes off
   (:func:`hlo_tools.jax_bridge.compile_module`, ``Standalone``, ``exact=True``), fed random inputs
   (:func:`disco_estimator.ops.standalone.random_inputs`: floats in [0.5, 2), small integers; index
   operands of gather/scatter/dynamic-(update-)slice are 0, always in bounds) and timed
   by :func:`disco_estimator.ops.timer` (``warmup`` untraced runs, ``repeats`` traced
   runs, the median kept; on the CPU backend in a child process pinned to one CPU, as
   the members' single-op times are).

Samples are JSON lines in ``<cache_dir("gnn")>/dataset-v<DATASET_VERSION>-<hash of the
backend fingerprint>.jsonl`` (:func:`dataset_path`): one :class:`Sample` per line, keyed
by the group's canonical form; generation appends, skips keys already stored (so a
stopped run resumes), and prints progress on stderr.

Times are seconds and sizes bytes throughout.
"""

from __future__ import annotations

import dataclasses
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

from disco_estimator.gnn.features import FEATURE_VERSION, FusedSubgraph, canonical_key
from disco_estimator.gnn.features import subgraph_from_group as _features_of
from disco_estimator.interface import NodeCosts
from disco_estimator.ops import (
    InputSpec,
    TimingJob,
    backend_fingerprint,
    bench_ops,
    called_closure,
    module_view,
    op_status,
    standalone_attrs,
    timer,
    timing_key,
)
from hlo_tools import dirs
from hlo_tools import plan as P
from hlo_tools.compiled import is_library_fusion
from hlo_tools.graph import DeviceGraph, NodeKind, device_graph
from hlo_tools.ir import HloComputation, HloInstruction, HloModule
from hlo_tools.opcodes import READS_RESULT_SIZE_OPCODES
from hlo_tools.printer import to_text

__all__ = [
    "DATASET_VERSION",
    "Sample",
    "KINDS",
    "STANDALONE_KINDS",
    "dataset_path",
    "fused_module",
    "fusion_groups",
    "generate",
    "load_samples",
    "measure_groups",
    "node_arrays",
    "plan_groups",
    "xla_groups",
]

#: Version of how samples are drawn, built and timed (part of the file name). 2: samples
#: carry their ``kind``; XLA's own fusions are a source. 3: timed in a process pinned to
#: one CPU (:class:`~disco_estimator.ops.standalone.PinnedTimer`; v2's unpinned timings of
#: the same op swung by up to 10x from one batch of runs to the next).
DATASET_VERSION = 3
#: Kinds of samples: groups of random plans, XLA's own fusions (both timed standalone,
#: drawn by :func:`generate`), fused ops timed in whole-program traces
#: (:mod:`disco_estimator.gnn.context`).
KINDS = ("plan", "xla", "context")
#: The kinds :func:`generate` draws and times standalone.
STANDALONE_KINDS = ("plan", "xla")
#: Opcodes whose operands past the first are indices (drawn as 0: in bounds).
_INDEXED = frozenset({"gather", "scatter", "dynamic-slice", "dynamic-update-slice"})


@dataclasses.dataclass(frozen=True)
class Sample:
    """One measured fused op.

    Attributes:
        key: hex canonical key of the subgraph
            (:func:`~disco_estimator.gnn.features.canonical_key`).
        source: where the group was drawn (e.g. the zoo model's name).
        subgraph: the fused op's features.
        time_s: median seconds of one execution of the fused op.
        p25_s: 25th percentile, seconds.
        p75_s: 75th percentile, seconds.
        samples: timed executions.
        kind: one of :data:`KINDS`: ``"plan"`` (a group of a random plan) or ``"xla"``
            (one of XLA's own fusions), both timed standalone, or ``"context"`` (a fused
            op of a whole program, timed in its trace: :mod:`disco_estimator.gnn.context`).
        retest_s: median seconds of a second, independent measurement (None: not
            measured again); how well the label repeats.
    """

    key: str
    source: str
    subgraph: FusedSubgraph
    time_s: float
    p25_s: float
    p75_s: float
    samples: int
    kind: str = "plan"
    retest_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"key": self.key, "source": self.source, "kind": self.kind,
               "subgraph": self.subgraph.to_json(),
               "time_s": self.time_s, "p25_s": self.p25_s, "p75_s": self.p75_s,
               "samples": self.samples, "feature_version": FEATURE_VERSION}
        if self.retest_s is not None:
            out["retest_s"] = self.retest_s
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Sample:
        return cls(str(d["key"]), str(d["source"]), FusedSubgraph.from_json(d["subgraph"]),
                   float(d["time_s"]), float(d["p25_s"]), float(d["p75_s"]),
                   int(d["samples"]), str(d.get("kind", "plan")),
                   float(d["retest_s"]) if d.get("retest_s") is not None else None)


def dataset_path(fingerprint: dict[str, Any], directory: str | os.PathLike | None = None,
                 name: str = "dataset") -> Path:
    """The JSON-lines file of one backend fingerprint (default directory:
    ``hlo_tools.dirs.cache_dir("gnn")``); ``name``: which dataset (``"dataset"``, the
    standalone one :func:`generate` writes; ``"context"``, the labels of whole-program
    traces)."""
    from disco_estimator.gnn.local import fingerprint_tag

    root = Path(directory) if directory is not None else dirs.cache_dir("gnn")
    return root / f"{name}-v{DATASET_VERSION}-{fingerprint_tag(fingerprint)}.jsonl"


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


def fusion_groups(module: HloModule, graph: DeviceGraph
                  ) -> list[tuple[HloInstruction, DeviceGraph, list[int]]]:
    """The ``fusion`` instructions of ``graph`` as fusion groups.

    Args:
        module: the module holding ``graph``.
        graph: a per-device graph (e.g. :func:`hlo_tools.graph.device_graph` of a
            post-optimization module).

    Returns:
        ``(instruction, body graph, members)`` per fusion, in program order: the graph
        of its fused computation (:func:`hlo_tools.graph.device_graph`) and every node of
        it that is not a parameter.
    """
    out = []
    for instr in graph.computation.instructions:
        if instr.opcode != "fusion":
            continue
        body = device_graph(module, module.computation(instr.called_computations[0]))
        members = [i for i, kind in enumerate(body.kinds) if kind != NodeKind.PARAMETER]
        out.append((instr, body, members))
    return out


def xla_groups(module: HloModule, graph: DeviceGraph | None = None
               ) -> list[tuple[str, DeviceGraph, list[int]]]:
    """XLA's own fusions that can be samples: ``(fusion name, body graph, members)``.

    The :func:`fusion_groups` of the per-device program with two or more members, a
    single (non-tuple) output, that XLA:CPU can compile standalone (:func:`buildable`),
    and not a library fusion (``kind=kCustom``: a call into
    XLA's kernel library, timed as one op). Multi-output fusions (a tuple-shaped root)
    cannot be built standalone yet (see :func:`fused_module`).

    Args:
        module: a post-optimization module (e.g.
            :func:`hlo_tools.baselines.module_from_compiled`).
        graph: its per-device graph (default: ``device_graph(module)``).
    """
    graph = graph if graph is not None else device_graph(module)
    out = []
    for instr, body, members in fusion_groups(module, graph):
        if is_library_fusion(instr) or len(members) < 2:
            continue
        root = body.computation.instructions[body.root]
        if root.shape.is_tuple or len(P.group_outputs(body, None, members)) != 1:
            continue
        if not buildable(body, members):
            continue
        out.append((instr.name, body, members))
    return out


def buildable(graph: DeviceGraph, members: Sequence[int]) -> bool:
    """Whether a group can be written as a standalone fusion that XLA:CPU compiles.

    A hand-written fusion reaches XLA before layout assignment, and XLA:CPU's emitter
    aborts the process on some of them (reshapes, bitcasts, transposes inside, a select
    reading a fused value, ...: :data:`hlo_tools.opcodes.UNFUSIBLE_OPCODES` and the
    checks of :func:`hlo_tools.plan.can_fuse`). The group is buildable when the fusion
    moves can rebuild it from single ops: every member's producers among the members
    fused into it one by one, from the root down, each fusion legal.

    Args:
        graph: the graph of the group (e.g. a fused computation's).
        members: its nodes.
    """
    inside = set(members)
    space = P.FusionSpace(graph)
    if not all(space.fusible[m] for m in inside):
        return False
    plan = P.initial_plan(graph)
    for consumer in sorted(inside, reverse=True):
        for producer in dict.fromkeys(graph.operands[consumer]):
            if producer in inside and plan.group[producer] != plan.group[consumer]:
                if not P.can_fuse(space, plan, producer, consumer):
                    return False
                plan = P.fuse(space, plan, producer, consumer)
    return len({plan.group[m] for m in inside}) == 1


def node_arrays(graph: DeviceGraph, time_s: np.ndarray, free: np.ndarray) -> NodeCosts:
    """The node arrays the features read, built as ``disco_estimator.costs.cost_model.GraphCosts``
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


def _unbitcast(graph: DeviceGraph, node: int) -> str:
    """The opcode a node keeps in a standalone fused module: a post-layout ``bitcast``
    (XLA's fusions hold them; XLA rejects them before layout assignment) becomes the op
    it stands for, ``bitcast-convert`` when the element type changes, else ``reshape``."""
    instr = graph.computation.instructions[node]
    if instr.opcode != "bitcast" or not graph.operands[node]:
        return instr.opcode
    src = graph.computation.instructions[graph.operands[node][0]].shape
    return "reshape" if src.element_type == instr.shape.element_type else "bitcast-convert"


def fused_module(graph: DeviceGraph, members: Sequence[int], copies: Sequence[int] = (),
                 name: str = "disco_fused") -> tuple[str, list[InputSpec]]:
    """A single-output group as a standalone module holding one ``fusion``.

    Layouts are dropped (the module is compiled with default layouts) and post-layout
    bitcasts become reshapes, so XLA's own fused computations can be rebuilt this way.

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
    if len(outputs) > 1 or instrs[outputs[0]].shape.is_tuple:
        raise ValueError(f"group has {len(outputs)} outputs or a tuple-shaped one; only "
                         "single-output fusions are built (XLA:CPU aborts on a standalone "
                         "multi-output fusion)")
    params: list[HloInstruction] = []
    entry_params: list[HloInstruction] = []
    specs: list[InputSpec] = []
    inner: dict[int, str] = {}
    body: list[HloInstruction] = []
    for node in inside:
        src = instrs[node]
        ops = []
        for pos, o in enumerate(graph.operands[node]):
            if o not in local and o not in inner:
                shape = instrs[o].shape.without_layout()
                k = len(params)
                params.append(HloInstruction(f"p{k}", "parameter", shape, payload=str(k)))
                entry_params.append(HloInstruction(f"a{k}", "parameter", shape,
                                                   payload=str(k)))
                index = src.opcode in _INDEXED and pos > 0 and shape.element_type.startswith(
                    ("s", "u"))
                specs.append(InputSpec(shape, 1 if index else 0))
                inner[o] = f"p{k}"
            ops.append(inner[o])
        body.append(src.copy(name=f"n{node}", operands=ops, attrs=standalone_attrs(src),
                             shape=src.shape.without_layout(),
                             opcode=_unbitcast(graph, node)))
        inner[node] = f"n{node}"
    root, shape = inner[outputs[0]], instrs[outputs[0]].shape.without_layout()
    fused = HloComputation("fused_group", params + body, root)
    fusion = HloInstruction("fusion", "fusion", shape, [p.name for p in entry_params],
                            {"kind": "kLoop", "calls": "fused_group"})
    entry = HloComputation("main", [*entry_params, fusion], "fusion", is_entry=True)
    comps = [*called_closure(graph.module, (instrs[i] for i in inside)), fused, entry]
    return to_text(HloModule(name, {}, comps, percent_names=False)), specs


# --------------------------------------------------------------------------- generation


def _member_times(module: HloModule, graphs: Sequence[tuple[DeviceGraph, Iterable[int]]],
                  replicas: int, progress: bool, pinned: bool | None = None
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per ``(graph, nodes)``: ``[N]`` single-op seconds (NaN where unknown, or not among
    ``nodes``) and ``[N]`` free flags; every op is timed in one :func:`bench_ops` call."""
    wanted = [(graph, sorted(set(nodes))) for graph, nodes in graphs]
    instrs = [graph.computation.instructions[i] for graph, nodes in wanted for i in nodes]
    timings = bench_ops(module, instrs, replicas=replicas, progress=progress, pinned=pinned)
    view = module_view(module)
    out = []
    for graph, nodes in wanted:
        body = graph.computation.instructions
        t = np.full(graph.num_nodes, math.nan)
        free = np.zeros(graph.num_nodes, np.bool_)
        chosen = set(nodes)
        for i in range(graph.num_nodes):
            status = op_status(body[i])[0]
            if status == "free":
                t[i], free[i] = 0.0, True
            elif status == "bench" and i in chosen:
                hit = timings.get(timing_key(view, body[i]))
                if hit is not None and hit.ok:
                    t[i] = hit.time_s
        out.append((t, free))
    return out


def _candidates(module: HloModule, kind: str, seed: int, replicas: int, progress: bool,
                pinned: bool | None = None
                ) -> list[tuple[DeviceGraph, NodeCosts, tuple[int, ...], tuple[int, ...]]]:
    """The measurable groups of one module: ``(graph, node arrays, members, copies)``."""
    if kind == "plan":
        graph = device_graph(module)
        groups = plan_groups(graph, seed)
        ((times, free),) = _member_times(
            module, [(graph, (i for m, c in groups for i in (*m, *c)))], replicas, progress,
            pinned)
        nodes = node_arrays(graph, np.nan_to_num(times), free)
        return [(graph, nodes, ms, cs) for ms, cs in groups
                if not np.isnan(times[list(ms) + list(cs)]).any()
                and len(P.group_outputs(graph, None, ms)) == 1]
    if kind == "xla":
        fusions = xla_groups(module)
        timed = _member_times(module, [(body, ms) for _, body, ms in fusions], replicas,
                              progress, pinned)
        return [(body, node_arrays(body, np.nan_to_num(times), free), tuple(ms), ())
                for (_, body, ms), (times, free) in zip(fusions, timed)
                if not np.isnan(times[ms]).any()]
    raise ValueError(f"unknown sample kind {kind!r}; valid: {', '.join(STANDALONE_KINDS)}")


def generate(modules: Sequence[tuple[str, str]], *, kind: str = "plan", per_module: int = 50,
             seed: int = 0, repeats: int = 15, warmup: int = 3, replicas: int = 1,
             directory: str | os.PathLike | None = None, progress: bool | None = None,
             pinned: bool | None = None) -> tuple[Path, int]:
    """Draws, builds, times and stores fused-op samples (resumable).

    Args:
        modules: ``(source name, HLO text)`` pairs: for ``kind="plan"`` zoo models'
            pre-optimization HLO, for ``kind="xla"`` their post-optimization HLO
            (``lowered.compile().as_text()``).
        kind: which groups to draw (:data:`KINDS`): random plans' groups, or XLA's own
            fusions (:func:`xla_groups`).
        per_module: new samples to add per module at most.
        seed: seed of the random plans (and of which XLA fusions come first).
        repeats: traced runs per fused op (median kept).
        warmup: untraced runs first.
        replicas: devices running each op at once (part of the fingerprint).
        directory: dataset directory (default: ``cache_dir("gnn")``).
        progress: print progress on stderr (default: when it is a terminal).
        pinned: time members and fused ops in a child pinned to one CPU (default:
            :func:`disco_estimator.ops.standalone.pinned_timing`: on the CPU backend, yes).

    Returns:
        ``(dataset file, samples added)``.

    Raises:
        ValueError: an unknown ``kind``.
    """
    from hlo_tools import parse

    if kind not in STANDALONE_KINDS:
        raise ValueError(f"unknown sample kind {kind!r}; valid: {', '.join(STANDALONE_KINDS)}")
    shown = sys.stderr.isatty() if progress is None else progress
    fingerprint = backend_fingerprint(replicas)
    path = dataset_path(fingerprint, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    known = {(s.kind, s.key) for s in load_samples(path)}
    added = 0
    t0 = time.perf_counter()
    for source, text in modules:
        module = parse(text)
        candidates = _candidates(module, kind, seed, replicas, shown, pinned)
        if kind == "xla":  # a fixed, seeded order, so per_module draws a fair subset
            random.Random(seed).shuffle(candidates)
        todo = []
        for graph, nodes, ms, cs in candidates:
            sub = _features_of(graph, nodes, ms, cs)
            key = canonical_key(sub).hex()
            if (kind, key) not in known:
                known.add((kind, key))
                todo.append((graph, ms, cs, sub, key))
            if len(todo) >= per_module:
                break
        measured = measure_groups([(g, ms, cs) for g, ms, cs, _, _ in todo],
                                  names=[f"disco_fused_{key[:16]}" for *_, key in todo],
                                  seeds=[int(key[:8], 16) for *_, key in todo],
                                  repeats=repeats, warmup=warmup, replicas=replicas,
                                  pinned=pinned)
        skipped = 0
        with open(path, "a", encoding="utf-8") as f:
            for (_, _, _, sub, key), m in zip(todo, measured):
                if m.get("error"):
                    skipped += 1
                    if shown:
                        sys.stderr.write(f"{source}: skipped a group: {m['error'][:120]}\n")
                    continue
                sample = Sample(key, source, sub, m["time_s"], m["p25_s"], m["p75_s"],
                                m["samples"], kind)
                f.write(json.dumps(sample.to_json()) + "\n")
                added += 1
        if shown:
            sys.stderr.write(f"{source} ({kind}): {len(candidates)} groups, {len(todo)} new, "
                             f"{skipped} not measurable, {added} added in all "
                             f"({time.perf_counter() - t0:.0f} s)\n")
    return path, added


def measure_groups(groups: Sequence[tuple[DeviceGraph, Sequence[int], Sequence[int]]], *,
                   names: Sequence[str] | None = None, seeds: Sequence[int] | None = None,
                   repeats: int = 15, warmup: int = 3, replicas: int = 1,
                   pinned: bool | None = None) -> list[dict[str, Any]]:
    """Times fusion groups as standalone fused ops, the way the dataset's samples are.

    Each group is built by :func:`fused_module`, compiled with XLA's fusion passes off,
    fed :func:`disco_estimator.ops.standalone.random_inputs` and timed (median of ``repeats`` traced
    runs) by :func:`disco_estimator.ops.timer`: on the CPU backend in a process pinned to
    one CPU.

    Args:
        groups: ``(graph, members, copies)`` per fused op.
        names: module name of each (default ``disco_fused_<k>``); unique.
        seeds: seed of each group's random inputs (default: ``k`` for group ``k``).
        repeats: traced runs per fused op.
        warmup: untraced runs first.
        replicas: devices running each at once.
        pinned: time in a child pinned to one CPU (default:
            :func:`disco_estimator.ops.standalone.pinned_timing`).

    Returns:
        Per group ``{"time_s", "p25_s", "p75_s", "samples"}`` (seconds), or
        ``{"error": why}`` when it cannot be built, compiled or timed (e.g. a
        multi-output group).
    """
    names = list(names) if names is not None else [f"disco_fused_{k}"
                                                   for k in range(len(groups))]
    seeds = list(seeds) if seeds is not None else list(range(len(groups)))
    out: list[dict[str, Any]] = [{} for _ in groups]
    jobs: dict[int, TimingJob] = {}
    for k, ((graph, ms, cs), name, in_seed) in enumerate(zip(groups, names, seeds)):
        try:
            text, specs = fused_module(graph, ms, cs, name=name)
        except Exception as err:  # the group cannot be built as one fusion: no time
            out[k] = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
            continue
        jobs[k] = TimingJob(name, text, tuple(specs), in_seed)
    with timer(replicas, repeats, warmup, pinned=pinned) as clock:
        runs, errors = clock.run(list(jobs.values()))
    for k, job in jobs.items():
        got = runs.get(job.module_name, [])
        if job.module_name in errors:
            out[k] = {"error": errors[job.module_name]}
        elif not got:
            out[k] = {"error": "no timed run (the fused op ran no kernel)"}
        else:
            q25, q50, q75 = np.percentile(got, [25, 50, 75])
            out[k] = {"time_s": float(q50), "p25_s": float(q25), "p75_s": float(q75),
                      "samples": len(got)}
    return out
