"""Op times: what an op costs to run, from every source, in one place.

* :mod:`disco_estimator.ops.keys`: what identifies an op (``OpKey``: opcode and shapes,
  name- and layout-free) and describes it (``OpInfo``: class, bytes, flops); the key an
  op's time is stored under and whether an op is timed at all.
* :mod:`disco_estimator.ops.trace`: intake of ``jax.profiler`` traces: per-instruction
  times of a compiled program (``profile_program``, :class:`ProgramProfile`) and
  measured Chrome traces.
* :mod:`disco_estimator.ops.cache`: the on-disk cache of single-op times (``OpTiming``
  by op key, one file per backend fingerprint).
* :mod:`disco_estimator.ops.standalone`: every unique single op of a module timed
  standalone (a tiny module per op), in this process or a child pinned to one CPU.
* :mod:`disco_estimator.ops.table`: the op-time table (:class:`OpTimes`) over those
  sources, the analytic fallback (``OpCostModel``) and stored per-op profiles
  (:class:`OpProfile`).

The package exports the names used outside it (``__all__``); the rest is imported from
its module. Imports point down: ``keys``, ``trace`` and ``cache`` import none of the
others; ``standalone`` and ``table`` import those three. Importing this package does not
import jax.
"""

from disco_estimator.ops.cache import backend_fingerprint
from disco_estimator.ops.keys import (
    fusion_computations,
    library_computations,
    module_view,
    op_status,
    timing_key,
)
from disco_estimator.ops.standalone import (
    InputSpec,
    TimingJob,
    bench_ops,
    benchable_ops,
    called_closure,
    standalone_attrs,
    timer,
)
from disco_estimator.ops.table import OpProfile, OpTimes, profile_ops
from disco_estimator.ops.trace import (
    COMM_TID,
    COMPUTE_TID,
    OpEvent,
    ProgramProfile,
    find_trace_file,
    iteration_order,
    measured_chrome_trace,
    module_name,
    op_events,
    per_device_samples,
    read_trace_events,
    summarize,
)

__all__ = [
    # keys
    "fusion_computations",
    "library_computations",
    "module_view",
    "op_status",
    "timing_key",
    # trace
    "COMM_TID",
    "COMPUTE_TID",
    "OpEvent",
    "ProgramProfile",
    "find_trace_file",
    "iteration_order",
    "measured_chrome_trace",
    "module_name",
    "op_events",
    "per_device_samples",
    "read_trace_events",
    "summarize",
    # cache
    "backend_fingerprint",
    # standalone
    "InputSpec",
    "TimingJob",
    "bench_ops",
    "benchable_ops",
    "called_closure",
    "standalone_attrs",
    "timer",
    # table
    "OpProfile",
    "OpTimes",
    "profile_ops",
]
