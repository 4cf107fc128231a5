"""Labels that repeat: fused ops timed where they run, in whole-program traces.

A fused op timed alone (:mod:`disco_estimator.gnn.dataset`) runs on an idle core with warm
caches; in a train step it runs between its neighbours, on the devices the step shares.
The search prices a plan's fusion groups from member times measured in context (the
in-context profile of the step with nothing fused), so its labels should be measured
there too. This module reads them from the trace of any compiled program of the step:

* :func:`traced_fusions`: every kernel of several ops in a program's trace
  (:class:`disco_estimator.ops.trace.ProgramProfile`) as a :class:`TracedFusion`: the
  graph of its fused computation, its members and its seconds per execution, one per
  traced iteration and device;
* :func:`context_samples`: those fusions as :class:`~disco_estimator.gnn.dataset.Sample`
  of kind ``"context"``, their features built from the member times a
  :class:`~disco_estimator.interface.NodeCostSource` gives (the cost model of the step:
  the same numbers the estimator reads when the search asks it), optionally paired with a
  second trace of the same program (``retest_s``: how well the label repeats);
* :func:`repeat_agreement`: the fraction of labels a second trace reproduces within a
  relative error (the ceiling under any estimator scored against them).

A program compiled from a plan with XLA's fusion passes off (``exact``) holds the planned
groups as its fusions, so its trace labels exactly the groups the search draws. XLA
renames instructions when it compiles them; the labels never need the old names, since
each is read from the compiled module's own fused computation.

Times are seconds throughout.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from disco_estimator.gnn.dataset import Sample, fusion_groups
from disco_estimator.gnn.features import canonical_key, subgraph_from_group
from disco_estimator.interface import NodeCostSource
from disco_estimator.ops import op_status
from disco_estimator.ops.trace import ProgramProfile
from hlo_tools.compiled import is_library_fusion
from hlo_tools.graph import DeviceGraph, device_graph
from hlo_tools.ir import HloModule

__all__ = [
    "CONTEXT",
    "TracedFusion",
    "context_samples",
    "repeat_agreement",
    "repeat_weight",
    "traced_fusions",
]

#: The sample kind of labels read from whole-program traces.
CONTEXT = "context"


class TracedFusion(NamedTuple):
    """One fused kernel of a traced program.

    Attributes:
        name: the ``fusion`` instruction's name in the compiled module (the trace's
            ``hlo_op``).
        body: the graph of its fused computation.
        members: the body's nodes that the fused op computes (every node but the
            parameters and a tuple-shaped root).
        outputs: the members whose values the fusion returns (the root, or the operands
            of a tuple-shaped root).
        runs_s: ``[iterations x devices]`` seconds of one execution, as traced.
    """

    name: str
    body: DeviceGraph
    members: tuple[int, ...]
    outputs: tuple[int, ...]
    runs_s: tuple[float, ...]

    @property
    def time_s(self) -> float:
        """Median seconds of one execution."""
        return float(statistics.median(self.runs_s))


def _kernels(body: DeviceGraph, members: Sequence[int]) -> int:
    """How many of ``members`` would run a kernel of their own when not fused."""
    instrs = body.computation.instructions
    return sum(op_status(instrs[m])[0] == "bench" for m in members)


def traced_fusions(profile: ProgramProfile, module: HloModule | None = None
                   ) -> list[TracedFusion]:
    """The fused kernels of several ops that ``profile`` timed.

    Each ``fusion`` of the compiled module's per-device computation that fuses two ops
    or more that would run kernels of their own (not one op XLA wrapped, and not a
    library fusion, ``kind=kCustom``: a call into a kernel library) and that the trace
    holds, in program order.

    Args:
        profile: the traced profile of a compiled program
            (:func:`disco_estimator.ops.trace.profile_program`).
        module: ``profile.hlo_text`` parsed (parsed here when None).
    """
    from hlo_tools import parse

    module = module if module is not None else parse(profile.hlo_text)
    out = []
    for instr, body, members in fusion_groups(module, device_graph(module)):
        if is_library_fusion(instr) or instr.name not in profile.counts:
            continue
        root = body.computation.instructions[body.root]
        outputs: tuple[int, ...] = (body.root,)
        if root.shape.is_tuple:
            members = [m for m in members if m != body.root]
            outputs = tuple(dict.fromkeys(body.operands[body.root]))
        if _kernels(body, members) < 2:
            continue
        count = max(profile.counts[instr.name], 1.0)
        runs = tuple(t / count for per in profile.samples_s.values()
                     for t in per.get(instr.name, ()))
        if runs:
            out.append(TracedFusion(instr.name, body, tuple(members), outputs, runs))
    return out


def context_samples(fusions: Sequence[TracedFusion], source: NodeCostSource, origin: str,
                    retest: Mapping[str, TracedFusion] | None = None) -> list[Sample]:
    """Labeled samples of traced fusions.

    Args:
        fusions: from :func:`traced_fusions`.
        source: gives each body's member times (``source.node_costs(body)``), e.g. the
            step's cost model: the member times the estimator reads in the search.
        origin: the samples' ``source`` (e.g. the model or step name; held-out splits
            group by it).
        retest: the same program's fusions from a second trace, by name: each sample's
            ``retest_s`` (None where absent).

    Returns:
        One :class:`~disco_estimator.gnn.dataset.Sample` of kind :data:`CONTEXT` per
        fusion whose member times are all positive (a member without a time would make
        features the search never sees).
    """
    out = []
    for f in fusions:
        nodes = source.node_costs(f.body)
        sub = subgraph_from_group(f.body, nodes, f.members, (), f.outputs)
        timed = [k for k, m in enumerate(sorted(f.members))
                 if op_status(f.body.computation.instructions[m])[0] == "bench"]
        if not timed or np.any(np.asarray(sub.time_s)[timed] <= 0):
            continue
        q25, q50, q75 = np.percentile(f.runs_s, [25, 50, 75])
        again = retest.get(f.name) if retest is not None else None
        out.append(Sample(canonical_key(sub).hex(), origin, sub, float(q50), float(q25),
                          float(q75), len(f.runs_s), CONTEXT,
                          again.time_s if again is not None else None))
    return out


def repeat_agreement(samples: Sequence[Sample], within: float = 0.10) -> dict[str, float]:
    """How well labels repeat: over the samples with a ``retest_s``, the fraction whose
    second measurement is within ``within`` of the first (``|retest - time| / time``),
    and the median of that relative difference.

    Returns:
        ``{"n", "within", "median_rel_diff"}`` (NaN fractions without retests).
    """
    pairs = np.array([(s.time_s, s.retest_s) for s in samples if s.retest_s is not None],
                     np.float64).reshape(-1, 2)
    if not len(pairs):
        return {"n": 0, "within": float("nan"), "median_rel_diff": float("nan")}
    rel = np.abs(pairs[:, 1] - pairs[:, 0]) / pairs[:, 0]
    return {"n": int(len(pairs)), "within": float(np.mean(rel <= within)),
            "median_rel_diff": float(np.median(rel))}


def repeat_weight(sample: Sample, within: float = 0.10, floor: float = 0.1) -> float:
    """A sample's weight in training by how well its label repeats: 1 when its second
    measurement is within ``within`` of the first (or it has none), else ``within``
    over the relative difference, at least ``floor`` (a label off by 50% on retest
    counts a fifth)."""
    if sample.retest_s is None:
        return 1.0
    rel = abs(sample.retest_s - sample.time_s) / sample.time_s
    return 1.0 if rel <= within else max(floor, within / rel)
