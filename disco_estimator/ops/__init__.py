"""Op times: what an op costs to run, from every source, in one place.

* :mod:`disco_estimator.ops.keys`: what identifies an op (:class:`OpKey`: opcode and
  shapes, name- and layout-free) and describes it (:class:`OpInfo`: class, bytes,
  flops); the key an op's time is stored under and whether an op is timed at all.
* :mod:`disco_estimator.ops.trace`: intake of ``jax.profiler`` traces: per-instruction
  times of a compiled program (:func:`profile_program`, :class:`ProgramProfile`) and
  measured Chrome traces.
* :mod:`disco_estimator.ops.cache`: the on-disk cache of single-op times
  (:class:`OpTiming` by op key, one file per backend fingerprint).
* :mod:`disco_estimator.ops.standalone`: every unique single op of a module timed
  standalone (a tiny module per op), in this process or a child pinned to one CPU.
* :mod:`disco_estimator.ops.table`: the op-time table (:class:`OpTimes`) over those
  sources, the analytic fallback (:class:`OpCostModel`) and stored per-op profiles
  (:class:`OpProfile`).

Imports point down: ``keys``, ``trace`` and ``cache`` import none of the others;
``standalone`` and ``table`` import those three. Importing this package does not import
jax.
"""

from disco_estimator.ops.cache import (
    OP_BENCH_VERSION,
    OP_CACHE_SCHEMA,
    OpTimeCache,
    OpTiming,
    backend_fingerprint,
    cache_dir,
)
from disco_estimator.ops.keys import (
    LIBRARY_SUFFIX,
    OP_CLASSES,
    OpInfo,
    OpKey,
    OpStatus,
    analyze_module,
    describe_instruction,
    is_library_fusion,
    library_computations,
    library_info,
    library_instructions,
    library_key,
    map_to_original,
    module_view,
    op_key,
    op_status,
    opcode_class,
    timing_key,
)
from disco_estimator.ops.standalone import (
    InputSpec,
    PinnedTimer,
    StandaloneOp,
    Timer,
    TimerResult,
    TimingJob,
    bench_module,
    bench_ops,
    benchable_ops,
    called_closure,
    kernel_instructions,
    pinned_timing,
    random_inputs,
    run_jobs,
    standalone_attrs,
    standalone_op,
    time_standalone,
    timer,
)
from disco_estimator.ops.table import (
    LinearOpCost,
    OpCostModel,
    OpEstimate,
    OpProfile,
    OpRecord,
    OpTimes,
    build_op_profile,
    profile_ops,
)
from disco_estimator.ops.trace import (
    COMM_TID,
    COMPUTE_TID,
    OpEvent,
    ProgramProfile,
    execution_counts,
    find_trace_file,
    iteration_order,
    measured_chrome_trace,
    module_name,
    op_events,
    per_device_samples,
    profile_program,
    read_trace_events,
    summarize,
)

__all__ = [
    # keys
    "LIBRARY_SUFFIX",
    "OP_CLASSES",
    "OpInfo",
    "OpKey",
    "OpStatus",
    "analyze_module",
    "describe_instruction",
    "is_library_fusion",
    "library_computations",
    "library_info",
    "library_instructions",
    "library_key",
    "map_to_original",
    "module_view",
    "op_key",
    "op_status",
    "opcode_class",
    "timing_key",
    # trace
    "COMM_TID",
    "COMPUTE_TID",
    "OpEvent",
    "ProgramProfile",
    "execution_counts",
    "find_trace_file",
    "iteration_order",
    "measured_chrome_trace",
    "module_name",
    "op_events",
    "per_device_samples",
    "profile_program",
    "read_trace_events",
    "summarize",
    # cache
    "OP_BENCH_VERSION",
    "OP_CACHE_SCHEMA",
    "OpTimeCache",
    "OpTiming",
    "backend_fingerprint",
    "cache_dir",
    # standalone
    "InputSpec",
    "PinnedTimer",
    "StandaloneOp",
    "Timer",
    "TimerResult",
    "TimingJob",
    "bench_module",
    "bench_ops",
    "benchable_ops",
    "called_closure",
    "kernel_instructions",
    "pinned_timing",
    "random_inputs",
    "run_jobs",
    "standalone_attrs",
    "standalone_op",
    "time_standalone",
    "timer",
    # table
    "LinearOpCost",
    "OpCostModel",
    "OpEstimate",
    "OpProfile",
    "OpRecord",
    "OpTimes",
    "build_op_profile",
    "profile_ops",
]
