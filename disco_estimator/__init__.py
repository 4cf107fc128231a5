"""Cost estimation for DisCo: measured per-op times and the linear AllReduce model.

* :mod:`disco_estimator.ops`: op times in one place: op keys (opcode + shapes) so a time
  measured in one program serves identical ops elsewhere (``ops.keys``), per-instruction
  times from ``jax.profiler`` traces (``ops.trace``), every unique single op of a module
  timed standalone (``ops.standalone``) and cached on disk per backend fingerprint
  (``ops.cache``), and the op-time table with stored JSON profiles and an analytic
  fallback for ops never measured (``ops.table``).
* :mod:`disco_estimator.allreduce`: ``T(bytes) = C * bytes + D`` fitted on psum
  microbenchmarks.
* :mod:`disco_estimator.hardware`: hardware files (the AllReduce model and the backend's cost
  constants of one setup): found in the user's config directory, else shipped in
  ``disco_estimator/hardware_files/``; read, validated and written atomically.
* :mod:`disco_estimator.probes`: probe programs for the in-program all-reduce latency and the
  compute/communication overlap.
* :mod:`disco_estimator.gloo`: processes and the (emulated) network of gloo jobs.
* :mod:`disco_estimator.interface`: the fused-op estimator protocols and the fallback rule.

Importing this package does not import jax (workers set device flags before that).
"""

from disco_estimator import gloo
from disco_estimator.allreduce import (
    SETUPS,
    AllReduceFit,
    AllReduceModel,
    AllReducePoint,
    MeasuredAllReduce,
    fit_allreduce,
    measure_psum,
    run_setup,
)
from disco_estimator.hardware import (
    HardwareConfig,
    HardwareError,
    available_hardware,
    find_hardware,
    load_hardware,
    write_hardware,
    write_hardware_text,
)
from disco_estimator.interface import (
    BatchedFusedOpEstimator,
    FallbackFusedEstimator,
    FusedOpEstimator,
    NodeCosts,
    fallback_fused_time,
)
from disco_estimator.ops import (
    OP_CLASSES,
    OpCostModel,
    OpEstimate,
    OpInfo,
    OpKey,
    OpProfile,
    OpTimeCache,
    OpTiming,
    ProgramProfile,
    analyze_module,
    backend_fingerprint,
    bench_module,
    bench_ops,
    build_op_profile,
    describe_instruction,
    map_to_original,
    profile_ops,
    profile_program,
)
from disco_estimator.probes import ProbeResult, measure_probes

__all__ = [
    "OP_CLASSES",
    "SETUPS",
    "AllReduceFit",
    "AllReduceModel",
    "AllReducePoint",
    "BatchedFusedOpEstimator",
    "FallbackFusedEstimator",
    "FusedOpEstimator",
    "HardwareConfig",
    "HardwareError",
    "MeasuredAllReduce",
    "NodeCosts",
    "OpCostModel",
    "OpEstimate",
    "OpInfo",
    "OpKey",
    "OpProfile",
    "OpTimeCache",
    "OpTiming",
    "ProbeResult",
    "ProgramProfile",
    "analyze_module",
    "available_hardware",
    "backend_fingerprint",
    "bench_module",
    "bench_ops",
    "build_op_profile",
    "describe_instruction",
    "fallback_fused_time",
    "find_hardware",
    "fit_allreduce",
    "gloo",
    "load_hardware",
    "map_to_original",
    "measure_probes",
    "measure_psum",
    "profile_ops",
    "profile_program",
    "run_setup",
    "write_hardware",
    "write_hardware_text",
]
