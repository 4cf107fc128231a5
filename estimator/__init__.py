"""Cost estimation for DisCo: measured per-op times and the linear AllReduce model.

* :mod:`estimator.profiler`: per-instruction times from ``jax.profiler`` traces, op keys
  (opcode + shapes) so a time measured in one program serves identical ops elsewhere,
  stored JSON profiles, and an analytic fallback for ops never measured.
* :mod:`estimator.allreduce`: ``T(bytes) = C * bytes + D`` fitted on psum
  microbenchmarks, and the ``configs/hardware/*.toml`` files that hold it.
* :mod:`estimator.op_bench`: every unique single op of a module timed standalone
  (a tiny module per op), cached on disk per backend fingerprint.

Importing this package does not import jax (workers set device flags before that).
"""

from estimator.allreduce import (
    SETUPS,
    AllReduceFit,
    AllReduceModel,
    AllReducePoint,
    HardwareConfig,
    MeasuredAllReduce,
    fit_allreduce,
    load_hardware,
    measure_psum,
    run_setup,
    write_hardware,
)
from estimator.op_bench import (
    OpTimeCache,
    OpTiming,
    backend_fingerprint,
    bench_module,
    bench_ops,
)
from estimator.profiler import (
    OP_CLASSES,
    OpCostModel,
    OpEstimate,
    OpInfo,
    OpKey,
    OpProfile,
    ProgramProfile,
    analyze_module,
    build_op_profile,
    describe_instruction,
    map_to_original,
    profile_ops,
    profile_program,
)

__all__ = [
    "OP_CLASSES",
    "SETUPS",
    "AllReduceFit",
    "AllReduceModel",
    "AllReducePoint",
    "HardwareConfig",
    "MeasuredAllReduce",
    "OpCostModel",
    "OpEstimate",
    "OpInfo",
    "OpKey",
    "OpProfile",
    "OpTimeCache",
    "OpTiming",
    "ProgramProfile",
    "analyze_module",
    "backend_fingerprint",
    "bench_module",
    "bench_ops",
    "build_op_profile",
    "describe_instruction",
    "fit_allreduce",
    "load_hardware",
    "map_to_original",
    "measure_psum",
    "profile_ops",
    "profile_program",
    "run_setup",
    "write_hardware",
]
