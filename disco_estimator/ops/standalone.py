"""Per-op times from standalone runs: one tiny module per unique single op, cached on disk.

Every unique single op of a module (same :class:`~disco_estimator.ops.keys.OpKey`: opcode,
operand shapes, result shape, dtype and a hash of the attributes that change what it
computes) is materialized as a small module of its own -- one parameter per operand,
the op as ROOT, plus the computations it calls (reduce regions, sort comparators,
scatter combiners) -- compiled with :func:`hlo_tools.jax_bridge.compile_module`
(``Standalone``, ``exact=True``: XLA's fusion passes off, the op runs as its own kernel) and timed:

* Inputs are random values of realistic magnitude: floats uniform in [0.5, 2) (valid
  for log, sqrt, rsqrt, divide, power; no denormals), booleans at random, and integer
  index operands (gather/scatter indices, dynamic-slice/-update-slice starts) drawn
  inside the bounds of the indexed operand, so the op does the work it does in the
  real program (an out-of-bounds scatter update is skipped). Small constant operands
  stay constants, as in the program.
* Times come from a ``jax.profiler`` trace, like :mod:`disco_estimator.ops.trace`'s
  whole-program profiles: each executed thunk is one event, and an op's time in one
  run is the sum of its module's events (host dispatch is not included). After
  ``warmup`` untraced runs, ``repeats`` runs are traced; the median is kept. All ops of
  a batch share one trace session.
* By default an op is timed in this process, in the regime the program itself runs in
  (its CPUs, its thread pool): the cost model prices the program's ops with these times.
  ``pinned=True`` times in a child process pinned to one CPU (:class:`PinnedTimer`), as
  the fused-op GNN's dataset is timed (repeatable, but not the program's regime; the
  two are cached apart).
* ``replicas > 1`` runs the op on that many local devices at once, like a
  data-parallel program does (``inproc4``: 4 devices share the host's cores); the
  time is the median over replicas and runs. It is part of the cache fingerprint.

Ops that cannot run on their own are not timed
(:func:`~disco_estimator.ops.keys.op_status` says why): collectives, control flow (its
bodies' ops are timed instead), custom-calls, random number generators and other side
effects, and ``fusion`` (a fusion's time is always predicted from its members, never
measured). Ops that run no kernel (parameters,
constants, tuples, ``get-tuple-element``, ``bitcast``, and ``reshape``, which XLA:CPU
turns into a bitcast under its default layouts) cost zero. Both fall back to the
analytic model of :mod:`disco_estimator.ops.table` (see ``disco_estimator.costs.cost_model``).

Timings are cached on disk per backend (:mod:`disco_estimator.ops.cache`).

Times are seconds and sizes bytes throughout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from disco_estimator.ops.cache import OpTimeCache, OpTiming
from disco_estimator.ops.keys import (
    OpInfo,
    OpKey,
    describe_instruction,
    dims_attr,
    library_info,
    library_instructions,
    module_view,
    op_status,
    timing_key,
)
from disco_estimator.ops.trace import find_trace_file, op_events, read_trace_events
from hlo_tools.ir import NUMPY_DTYPES, HloComputation, HloInstruction, HloModule, Shape
from hlo_tools.opcodes import CONTROL_FLOW_OPCODES
from hlo_tools.printer import to_text

__all__ = [
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
]

#: Attributes left out of a standalone op (they do not change what it computes).
_DROP_ATTRS = frozenset({"metadata", "sharding", "frontend_attributes", "backend_config",
                         "control-predecessors", "statistics", "origin", "schedule_id"})
#: Constant operands up to this many bytes stay constants in the standalone module.
_CONSTANT_BYTES = 1024


# --------------------------------------------------------------------------- standalone op


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One parameter of a standalone module: its shape and how to fill it.

    Attributes:
        shape: the parameter's shape (no layout).
        index_high: for integer index operands, values are drawn in ``[0, index_high)``;
            0 for ordinary data.
    """

    shape: Shape
    index_high: int = 0


@dataclasses.dataclass(frozen=True)
class StandaloneOp:
    """A single op as a module of its own.

    Attributes:
        key: the op's key (:func:`library_key` of it when ``library``).
        hlo_text: the module text (``HloModule disco_op_<hash>``).
        module_name: the module's name.
        inputs: what to feed each parameter, in order.
        info: the op's class, bytes and flops (for the analytic fallback).
        library: compile it letting XLA hand the op to its kernel library (see
            :func:`library_key`).
    """

    key: OpKey
    hlo_text: str
    module_name: str
    inputs: tuple[InputSpec, ...]
    info: OpInfo
    library: bool = False


def _index_bounds(module_instr: Mapping[str, HloInstruction],
                  instr: HloInstruction) -> dict[int, int]:
    """Operand position -> exclusive upper bound for integer index operands."""
    ops = [module_instr[o] for o in instr.operands]
    op = instr.opcode
    if op == "dynamic-slice":
        sizes = dims_attr(instr.attrs.get("dynamic_slice_sizes"))
        dims = ops[0].shape.dims
        return {k: max(1, dims[k - 1] - sizes[k - 1] + 1) if k - 1 < len(sizes) else 1
                for k in range(1, len(ops))}
    if op == "dynamic-update-slice":
        dims, upd = ops[0].shape.dims, ops[1].shape.dims
        return {k: max(1, dims[k - 2] - upd[k - 2] + 1) for k in range(2, len(ops))}
    if op == "gather":
        dims = ops[0].shape.dims
        sizes = dims_attr(instr.attrs.get("slice_sizes"))
        mapped = dims_attr(instr.attrs.get("start_index_map")) or list(range(len(dims)))
        high = min((dims[d] - (sizes[d] if d < len(sizes) else 1) + 1 for d in mapped),
                   default=1)
        return {1: max(1, high)}
    if op == "scatter":
        n_inputs = (len(ops) - 1) // 2
        dims = ops[0].shape.dims
        mapped = (dims_attr(instr.attrs.get("scatter_dims_to_operand_dims"))
                  or list(range(len(dims))))
        return {n_inputs: max(1, min((dims[d] for d in mapped), default=1))}
    return {}


def standalone_attrs(instr: HloInstruction) -> dict[str, str]:
    """An instruction's attributes for a standalone module: without metadata (its stack
    frame ids point into the source module) and what does not change what it computes."""
    return {k: v for k, v in instr.attrs.items() if k not in _DROP_ATTRS}


def _unbitcast(instr: HloInstruction, comp: HloComputation) -> HloInstruction:
    """A post-layout ``bitcast`` inside a called computation as the op it stands for
    (XLA rejects bitcasts before layout assignment): ``bitcast-convert`` when the element
    type changes, else ``reshape``."""
    if instr.opcode != "bitcast" or not instr.operands:
        return instr
    src = comp.instruction(instr.operands[0]).shape
    same_type = src.element_type == instr.shape.element_type
    return instr.copy(opcode="reshape" if same_type else "bitcast-convert")


def called_closure(module: HloModule, instrs: Iterable[HloInstruction]
                   ) -> list[HloComputation]:
    """The computations the instructions call, transitively, callees before callers, made
    standalone (:func:`standalone_attrs`; post-layout bitcasts as the ops they stand for)."""
    comps = module.computations_by_name()
    out: list[HloComputation] = []
    seen: set[str] = set()

    def visit(names: Iterable[str]) -> None:
        for name in names:
            if name in seen or name not in comps:
                continue
            seen.add(name)
            comp = comps[name]
            visit(n for i in comp.instructions for n in i.called_computations)
            out.append(dataclasses.replace(comp, is_entry=False, instructions=[
                _unbitcast(i, comp).copy(attrs=standalone_attrs(i)) for i in comp.instructions]))

    visit(n for instr in instrs for n in instr.called_computations)
    return out


def standalone_op(module: HloModule, instr: HloInstruction, view: Any | None = None,
                  module_instr: Mapping[str, HloInstruction] | None = None,
                  library: bool = False) -> StandaloneOp:
    """Builds the standalone module of one op (see the module docstring).

    Args:
        module: the module holding ``instr``.
        instr: an op whose :func:`op_status` is ``"bench"``.
        view: :func:`module_view` of ``module`` (built if None).
        module_instr: name -> instruction over the whole module (built if None).
        library: time it as XLA's kernel library runs it (see :func:`library_key`).

    Returns:
        The :class:`StandaloneOp`.
    """
    view = view if view is not None else module_view(module)
    module_instr = module_instr if module_instr is not None else view.instr
    info = describe_instruction(view, instr)
    if library:
        info = library_info(info)
    bounds = _index_bounds(module_instr, instr)
    body: list[HloInstruction] = []
    inputs: list[InputSpec] = []
    names: list[str] = []
    for k, name in enumerate(instr.operands):
        src = module_instr[name]
        shape = src.shape.without_layout()
        if not shape.is_array or shape.element_type not in NUMPY_DTYPES:
            raise ValueError(f"operand {k} of type {shape} is not supported")
        if (src.opcode == "constant" and shape.is_array
                and shape.byte_size() <= _CONSTANT_BYTES and k not in bounds):
            body.append(HloInstruction(f"c{k}", "constant", shape, payload=src.payload))
        else:
            body.append(HloInstruction(f"p{k}", "parameter", shape, payload=str(len(inputs))))
            inputs.append(InputSpec(shape, bounds.get(k, 0)))
        names.append(body[-1].name)
    body.append(HloInstruction("op", instr.opcode, instr.shape.without_layout(), names,
                               standalone_attrs(instr), instr.payload))
    digest = hashlib.sha1(info.key.encode().encode()).hexdigest()[:16]
    name = f"disco_op_{digest}"
    comps = [*called_closure(module, [instr]),
             HloComputation("main", body, "op", is_entry=True)]
    text = to_text(HloModule(name, {}, comps, percent_names=module.percent_names))
    return StandaloneOp(info.key, text, name, tuple(inputs), info, library)


def random_inputs(op: StandaloneOp | Sequence[InputSpec], seed: int = 0) -> list[np.ndarray]:
    """Random host arrays for a standalone module's parameters (see the module docstring).

    Args:
        op: a :class:`StandaloneOp`, or the :class:`InputSpec` of each parameter (e.g. of
            a fused-op sample module).
        seed: RNG seed.
    """
    rng = np.random.default_rng(seed)
    specs = op.inputs if isinstance(op, StandaloneOp) else op
    out = []
    for spec in specs:
        dims, etype = spec.shape.dims, spec.shape.element_type
        dtype = np.dtype(NUMPY_DTYPES[etype])
        if spec.index_high:
            out.append(rng.integers(0, spec.index_high, size=dims).astype(dtype))
        elif dtype == np.bool_:
            out.append(rng.random(dims) < 0.5)
        elif np.issubdtype(dtype, np.integer):
            out.append(rng.integers(1, 8, size=dims).astype(dtype))
        elif np.issubdtype(dtype, np.complexfloating):
            out.append((rng.uniform(0.5, 2.0, dims) + 1j * rng.uniform(0.5, 2.0, dims))
                       .astype(dtype))
        else:
            out.append(rng.uniform(0.5, 2.0, dims).astype(dtype))
    return out


# --------------------------------------------------------------------------- timing


def _failed(info: OpInfo, error: str) -> OpTiming:
    return OpTiming(math.nan, math.nan, math.nan, 0, info.cls, info.bytes, info.flops,
                    error[:300])


def _summarize(info: OpInfo, samples: list[float]) -> OpTiming:
    if not samples:
        return OpTiming(0.0, 0.0, 0.0, 0, info.cls, info.bytes, info.flops)
    q25, q50, q75 = np.percentile(samples, [25, 50, 75])
    return OpTiming(float(q50), float(q25), float(q75), len(samples), info.cls, info.bytes,
                    info.flops)


def _trace_samples(trace_root: str, names: set[str]) -> dict[str, list[float]]:
    """Per module, one time per (device, run): the sum of its thunk events."""
    events = op_events(read_trace_events(find_trace_file(trace_root)))
    totals: dict[tuple[str, int, str], float] = defaultdict(float)
    for ev in events:
        if ev.module in names:
            totals[(ev.module, ev.device, ev.run_id)] += ev.dur_s
    out: dict[str, list[float]] = defaultdict(list)
    for (module, _, _), t in totals.items():
        out[module].append(t)
    return out


def time_standalone(items: Sequence[tuple[Any, Sequence[Any]]], *, repeats: int = 15,
                    warmup: int = 3) -> dict[str, list[float]]:
    """Times compiled standalone modules in one profiler session.

    Args:
        items: ``(StandaloneHlo, placed inputs)`` pairs (inputs from ``put``).
        repeats: traced runs of each module.
        warmup: untraced runs first.

    Returns:
        module name -> per-(run, replica) seconds (empty list for a module that ran no
        kernel, e.g. one XLA folded away).
    """
    import jax

    for exe, placed in items:
        for _ in range(warmup):
            exe.run(placed)
    root = tempfile.mkdtemp(prefix="disco_opbench_")
    try:
        jax.profiler.start_trace(root)
        try:
            for exe, placed in items:
                for _ in range(repeats):
                    exe.run(placed)
        finally:
            jax.profiler.stop_trace()
        samples = _trace_samples(root, {exe.module_name for exe, _ in items})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {exe.module_name: samples.get(exe.module_name, []) for exe, _ in items}


class _Progress:
    """A one-line ``done/total`` counter on stderr (only when it is a terminal or asked)."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.done = total, label, 0
        self.enabled = enabled and total > 0
        self.t0 = time.perf_counter()

    def step(self, n: int = 1) -> None:
        self.done += n
        if self.enabled:
            dt = time.perf_counter() - self.t0
            sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} ops ({dt:.0f} s)")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _measure_chunk(chunk: Sequence[StandaloneOp], clock: Timer, progress: _Progress
                   ) -> dict[str, OpTiming]:
    """Compiles and times one batch of ops (compile errors become failed timings)."""
    jobs = [TimingJob(op.module_name, op.hlo_text, op.inputs,
                      int(op.module_name.rsplit("_", 1)[-1][:8], 16), op.library)
            for op in chunk]
    samples, errors = clock.run(jobs)
    progress.step(len(chunk))
    return {op.key.encode(): _failed(op.info, errors[op.module_name])
            if op.module_name in errors else _summarize(op.info, samples[op.module_name])
            for op in chunk}


# --------------------------------------------------------------------------- timers


@dataclasses.dataclass(frozen=True)
class TimingJob:
    """One standalone module to compile (XLA's fusion passes off) and time.

    Attributes:
        module_name: the module's name (unique within one :meth:`Timer.run`).
        hlo_text: the module text.
        inputs: what to feed each parameter (:func:`random_inputs`).
        seed: seed of the random inputs.
        library: let XLA hand single ops to its kernel library (see :func:`library_key`).
    """

    module_name: str
    hlo_text: str
    inputs: tuple[InputSpec, ...]
    seed: int = 0
    library: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"module_name": self.module_name, "hlo_text": self.hlo_text,
                "inputs": [[str(i.shape), i.index_high] for i in self.inputs],
                "seed": self.seed, "library": self.library}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TimingJob:
        from hlo_tools.parser import parse_shape

        return cls(str(d["module_name"]), str(d["hlo_text"]),
                   tuple(InputSpec(parse_shape(shape), int(high)) for shape, high in d["inputs"]),
                   int(d["seed"]), bool(d["library"]))


#: Per module name, its per-(run, replica) seconds; and per module name that could not be
#: compiled or timed, why.
TimerResult = tuple[dict[str, list[float]], dict[str, str]]


def run_jobs(jobs: Sequence[TimingJob], *, replicas: int = 1, repeats: int = 15,
             warmup: int = 3) -> TimerResult:
    """Compiles and times ``jobs`` in this process, in one profiler session.

    Args:
        jobs: the modules.
        replicas: devices that run each module at once.
        repeats: traced runs of each module.
        warmup: untraced runs of each first.

    Returns:
        ``(samples, errors)``: a module XLA rejects is in ``errors`` (with the reason), every
        other in ``samples`` (an empty list when it ran no kernel). If the timing itself
        fails, every compiled module is in ``errors``.
    """
    from hlo_tools import jax_bridge

    samples: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    items = []
    for job in jobs:
        try:
            exe = jax_bridge.compile_module(job.hlo_text, jax_bridge.Standalone(replicas),
                                            jax_bridge.CompileOptions(
                                                exact=True,
                                                library="default" if job.library else False))
            items.append((job, exe, exe.put(*random_inputs(job.inputs, seed=job.seed))))
        except Exception as err:  # e.g. an op XLA rejects standalone
            errors[job.module_name] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    try:
        runs = time_standalone([(exe, placed) for _, exe, placed in items], repeats=repeats,
                               warmup=warmup)
    except Exception as err:
        for job, _, _ in items:
            errors[job.module_name] = f"timing failed: {err}".splitlines()[0][:300]
        return samples, errors
    for job, exe, _ in items:
        samples[job.module_name] = runs.get(exe.module_name, [])
    return samples, errors


class Timer:
    """Times :class:`TimingJob` batches in this process (:func:`run_jobs`).

    Attributes:
        replicas, repeats, warmup: as :func:`run_jobs` takes them.
    """

    def __init__(self, replicas: int = 1, repeats: int = 15, warmup: int = 3):
        self.replicas, self.repeats, self.warmup = replicas, repeats, warmup

    def run(self, jobs: Sequence[TimingJob]) -> TimerResult:
        """:func:`run_jobs` of ``jobs`` with this timer's settings."""
        return run_jobs(jobs, replicas=self.replicas, repeats=self.repeats,
                        warmup=self.warmup)

    def close(self) -> None:
        """Releases what the timer holds (nothing, in this process)."""

    def __enter__(self) -> Timer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PinnedTimer(Timer):
    """Times :class:`TimingJob` batches in a child process pinned to one CPU.

    Why: on a multi-core host XLA:CPU hands a standalone op's work between the threads
    of its pool, and on a shared machine those hand-offs dominate the time. On this
    project's 2-vCPU VM (jax 0.10.2) the medians of 200 runs of a 256 KiB elementwise
    fusion were 45-81 us in four batches unpinned and 4.1-4.2 us in a process pinned to
    one CPU before jax started. Pinning every thread of a process whose jax has already
    started does not reproduce that (10-29 us): the CPU client sizes its pool when it
    starts, so the pin has to come first. The child is started by the first
    :meth:`run` (``python -m disco_estimator._timing_worker``, well under a second) and serves
    every batch until :meth:`close`; it runs without ``NPROC`` so its pool is the one
    the pin gives it, as the GNN's dataset is timed (``disco train-estimator
    --generate``).

    Args:
        cpu: index into this process's allowed CPUs of the one the child gets.
        timeout_s: seconds one batch may take before the child is killed and the
            batch's modules fail.
    """

    def __init__(self, replicas: int = 1, repeats: int = 15, warmup: int = 3, *,
                 cpu: int = 0, timeout_s: float = 900.0):
        super().__init__(replicas, repeats, warmup)
        self.cpu, self.timeout_s = cpu, timeout_s
        self._proc: subprocess.Popen[str] | None = None
        self._stderr: Any = None
        #: The CPUs the child ran on at its last reply (one, where pinning works).
        self.child_cpus: tuple[int, ...] = ()

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            env = {k: v for k, v in os.environ.items() if k != "NPROC"}
            self._stderr = tempfile.TemporaryFile(mode="w+", prefix="disco_timer_")
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "disco_estimator._timing_worker", "--cpu", str(self.cpu)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                text=True, env=env)
        return self._proc

    def _child_error(self, what: str) -> str:
        tail = ""
        if self._stderr is not None:
            self._stderr.seek(0)
            lines = [ln for ln in self._stderr.read().splitlines() if ln.strip()]
            # the last unindented line: a traceback's exception, not its context lines
            heads = [ln for ln in lines if not ln[0].isspace()] or lines
            tail = f": {heads[-1][:200]}" if heads else ""
        return f"pinned timing process {what}{tail}"

    def run(self, jobs: Sequence[TimingJob]) -> TimerResult:
        """Times ``jobs`` in the pinned child; if the child dies or exceeds
        ``timeout_s``, every job of the batch is in ``errors`` and the next batch starts a
        new child."""
        if not jobs:
            return {}, {}
        proc = self._start()
        request = {"replicas": self.replicas, "repeats": self.repeats, "warmup": self.warmup,
                   "jobs": [job.to_json() for job in jobs]}
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
            line = proc.stdout.readline() if ready else None
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            if line is None:  # still busy with the batch: it will not read its input
                proc.kill()
            why = (f"exceeded {self.timeout_s:.0f} s" if line is None
                   else f"exited with {proc.wait()}")
            error = self._child_error(why)  # before close() drops its stderr
            self.close()
            return {}, {job.module_name: error for job in jobs}
        reply = json.loads(line)
        self.child_cpus = tuple(reply["cpus"])
        return ({k: [float(t) for t in v] for k, v in reply["samples"].items()},
                {k: str(v) for k, v in reply["errors"].items()})

    def close(self) -> None:
        """Stops the child (it exits when its input closes; killed if it does not)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


def timer(replicas: int = 1, repeats: int = 15, warmup: int = 3, *,
          pinned: bool | None = None, platform: str | None = None) -> Timer:
    """The timer standalone ops and fused ops are measured with.

    Args:
        replicas, repeats, warmup: as :func:`run_jobs` takes them.
        pinned: time in a child pinned to one CPU (:class:`PinnedTimer`). Default: where
            :func:`pinned_timing` says so.
        platform: jax platform (default: jax's default backend).
    """
    if pinned is None:
        pinned = pinned_timing(replicas, platform)
    cls = PinnedTimer if pinned else Timer
    return cls(replicas, repeats, warmup)


def pinned_timing(replicas: int = 1, platform: str | None = None) -> bool:
    """Whether timings that leave it open (``pinned=None``: the GNN's dataset, ``disco
    estimate --measure``) go to a child pinned to one CPU: on the CPU backend, for one
    replica, wherever the OS has CPU affinity -- also from a process that is itself pinned
    (a gloo worker keeps ``NPROC`` threads in its pool; the child gets the one thread a pin
    gives). ``replicas > 1`` stays in this process: it measures devices that share the
    host's cores."""
    if replicas != 1 or not hasattr(os, "sched_getaffinity"):
        return False
    from hlo_tools import jax_bridge

    return jax_bridge.backend_info(platform)["platform"] == "cpu"


# --------------------------------------------------------------------------- driver


def benchable_ops(module: HloModule, instrs: Iterable[HloInstruction] | None = None,
                  view: Any | None = None) -> dict[str, tuple[HloInstruction, bool]]:
    """:func:`timing_key` -> (first instruction with that key, whether it runs in a
    library fusion), for the benchable ops among ``instrs`` (default:
    :func:`kernel_instructions`)."""
    view = view if view is not None else module_view(module)
    instrs = instrs if instrs is not None else kernel_instructions(module)
    library = library_instructions(module)
    out: dict[str, tuple[HloInstruction, bool]] = {}
    for instr in instrs:
        if op_status(instr)[0] != "bench":
            continue
        lib = id(instr) in library
        out.setdefault(timing_key(view, instr, lib), (instr, lib))
    return out


def _standalone_ops(module: HloModule, wanted: Mapping[str, tuple[HloInstruction, bool]],
                    known: Mapping[str, Any], view: Any
                    ) -> tuple[list[StandaloneOp], dict[str, OpTiming]]:
    """Standalone modules of the ops still to time, and failures to build one."""
    todo, failed = [], {}
    for key, (instr, lib) in wanted.items():
        if key in known:
            continue
        try:
            todo.append(standalone_op(module, instr, view, library=lib))
        except (KeyError, ValueError, IndexError) as err:
            failed[key] = _failed(describe_instruction(view, instr),
                                  f"no standalone module: {err}")
    return todo, failed


def kernel_instructions(module: HloModule) -> list[HloInstruction]:
    """Instructions that run as kernels or inside one: those of ENTRY, of the bodies of
    control flow, and of fused computations -- not of reducers and comparators, which
    only describe how their op combines elements."""
    comps = module.computations_by_name()
    out: list[HloInstruction] = []
    seen = {module.entry.name}
    stack = [module.entry]
    while stack:
        comp = stack.pop()
        out.extend(comp.instructions)
        for instr in comp.instructions:
            if instr.opcode != "fusion" and instr.opcode not in CONTROL_FLOW_OPCODES:
                continue
            for name in instr.called_computations:
                if name in comps and name not in seen:
                    seen.add(name)
                    stack.append(comps[name])
    return out


def bench_ops(
    module: HloModule,
    instructions: Iterable[HloInstruction] | None = None,
    *,
    cache: OpTimeCache | None = None,
    use_cache: bool = True,
    replicas: int = 1,
    repeats: int = 15,
    warmup: int = 3,
    chunk: int = 48,
    progress: bool | None = None,
    pinned: bool | None = False,
) -> dict[str, OpTiming]:
    """Times every unique benchable single op of ``module`` (cached ops are not re-run).

    Args:
        module: the parsed module.
        instructions: the ops to time (default: :func:`kernel_instructions`; fused
            computations are included, a fusion's members are single ops).
        cache: the cache to read and extend (default: this backend's, for ``replicas``).
        use_cache: False times everything again and stores nothing.
        replicas: devices that run each op at once (see the module docstring).
        repeats: traced runs per op.
        warmup: untraced runs per op first.
        chunk: ops per trace session.
        progress: print a counter on stderr (default: when stderr is a terminal).
        pinned: time in a child process pinned to one CPU (:class:`PinnedTimer`; None:
            where :func:`pinned_timing` says so). Default False: in this process, the
            regime the program runs in. The default cache is the one of that regime.

    Returns:
        ``OpKey.encode()`` -> :class:`OpTiming` for every benchable op (failed ones carry
        their ``error``; their time is NaN).
    """
    view = module_view(module)
    wanted = benchable_ops(module, instructions, view)
    pinned = pinned_timing(replicas) if pinned is None else pinned
    if use_cache and cache is None:
        cache = OpTimeCache.for_backend(replicas, pinned=pinned)
    known = {k: cache.get(k) for k in wanted if cache is not None and k in cache} \
        if use_cache else {}
    todo, measured = _standalone_ops(module, wanted, known, view)
    shown = sys.stderr.isatty() if progress is None else progress
    counter = _Progress(len(todo), "timing single ops", shown)
    try:
        with timer(replicas, repeats, warmup, pinned=pinned) as clock:
            for start in range(0, len(todo), chunk):
                measured.update(_measure_chunk(todo[start:start + chunk], clock, counter))
                if use_cache and cache is not None:
                    cache.update(measured)
                    cache.save()
    finally:
        counter.close()
    return {**known, **measured}


def bench_module(hlo_text: str, **kwargs: Any) -> dict[str, OpTiming]:
    """:func:`bench_ops` over every op of a module given as HLO text."""
    import hlo_tools

    return bench_ops(hlo_tools.parse(hlo_text), **kwargs)
