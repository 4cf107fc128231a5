"""Staged enactment: a data-parallel step as compute stages and all-reduces on two streams.

XLA:CPU runs a gloo all-reduce and computation of one program one after the other, but
two programs dispatched from two Python threads overlap (with at least two threads in
the CPU client's pool: ``NPROC`` for a process pinned to one CPU). The simulator's two
resources, a compute stream and a communication channel, become real:

* the **compute stream** (the caller's thread) runs the per-device stages in order:
  forward and backward up to bucket 0's last gradient, the backward up to bucket 1's,
  ..., the optimizer update (:func:`hlo_tools.stages.cut_stages` cuts them from the
  step's pre-optimization module);
* the **communication stream** (one worker thread) runs one jitted ``shard_map`` sum
  over a flat 1-D buffer per bucket, in bucket order, each launched as soon as the stage
  that outputs its buffer has been dispatched; the update waits for all of them.

Values cross stages as device buffers (single-device jax arrays, one per local device),
never through the host. Collectives run only on the communication thread, in the same
order in every process, so a multi-process gloo job (one device per process) runs the
same schedule everywhere.

Typical use::

    step, args = zoo.get("vgg")(4, "tiny")
    staged = staged_step(step, args, buckets=2)      # or a list of node buckets
    new_params, new_opt_state, loss = staged(*args)  # same outputs as jax.jit(step)
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import hlo_tools
from hlo_tools import jax_bridge
from hlo_tools.graph import DeviceGraph, device_graph
from hlo_tools.ir import NUMPY_DTYPES, HloModule
from hlo_tools.jax_bridge.devices import local_shards
from hlo_tools.plan import FusionSpace
from hlo_tools.plan.buckets import ready_order
from hlo_tools.stages import (
    ARG,
    FLAT,
    REDUCED,
    RESULT,
    CommBucket,
    Stage,
    StageCut,
    cut_stages,
)

__all__ = [
    "CHUNK_BYTES",
    "COMM",
    "COMPUTE",
    "Launch",
    "OverlapCheck",
    "POOL_THREADS",
    "StagedParts",
    "StagedPlan",
    "StagedStep",
    "StagedStepError",
    "TEST_ATTEMPTS",
    "even_buckets",
    "schedule",
    "staged_plan",
    "staged_step",
]

#: The compute stream: the stages, in order, on the caller's thread.
COMPUTE = "compute"
#: The communication stream: the all-reduces, in order, on one worker thread.
COMM = "comm"
#: The mesh axis of the communication programs.
_AXIS = "stages"
#: Each bucket is reduced in collectives of at most this many bytes (None: one collective
#: per bucket). Every collective is a gloo wake-up that the communication thread needs the
#: CPU for, in the middle of the compute stream's work, so one collective per bucket
#: overlaps best (over the emulated 1 Gbit/s link, 1 MiB pieces cost transformer-large's
#: 4-bucket staged step 99-172 ms, one collective per bucket 76 ms).
CHUNK_BYTES: int | None = None
#: ``NPROC`` of a gloo worker pinned to one CPU: XLA:CPU's pool then has this many
#: threads instead of one, enough for the compute stream and the communication thread.
#: More threads on the one CPU take it from the communication thread when gloo wakes up
#: (transformer-large's staged step: 76 ms lost with 4, none with 2).
POOL_THREADS = 2
#: How long the compute stream waits for one all-reduce (seconds).
_COMM_TIMEOUT_S = 600.0


class Launch(NamedTuple):
    """One program launch of the schedule.

    Attributes:
        stream: :data:`COMPUTE` (a stage) or :data:`COMM` (a communication bucket).
        program: the stage or bucket index.
        after: the launches it waits for, as ``(stream, program)``: a compute launch
            waits for the all-reduces it reads to finish, a communication launch for
            the stage that outputs its buffer to be dispatched (and its stream's
            previous launch, implicitly).
    """

    stream: str
    program: int
    after: tuple[tuple[str, int], ...]


class StagedPlan(NamedTuple):
    """A step cut for staged enactment: what runs, where, after what.

    Attributes:
        cut: the stages (per-device HLO text, inputs, outputs) and communication
            buckets (:class:`hlo_tools.stages.StageCut`).
        schedule: the launches, each stream's in its order (:func:`schedule`).
        fingerprints: sha256 of each stage's text, in stage order.
    """

    cut: StageCut
    schedule: tuple[Launch, ...]
    fingerprints: tuple[str, ...]

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.cut.stages

    @property
    def comms(self) -> tuple[CommBucket, ...]:
        return self.cut.buckets

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (HLO as text, shapes as HLO shape strings)."""
        cut = self.cut
        return {
            "body_name": cut.body_name,
            "stages": [{"text": st.text, "inputs": [list(r) for r in st.inputs],
                        "outputs": [list(r) for r in st.outputs]} for st in cut.stages],
            "buckets": [b._asdict() for b in cut.buckets],
            "arg_shapes": [str(s) for s in cut.arg_shapes],
            "result_shapes": [str(s) for s in cut.result_shapes],
            "schedule": [[ln.stream, ln.program, [list(a) for a in ln.after]]
                         for ln in self.schedule],
            "fingerprints": list(self.fingerprints),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StagedPlan:
        """The inverse of :meth:`to_json`.

        Raises:
            ValueError: a field is missing or malformed, or a stage's text does not
                match its fingerprint.
        """
        from hlo_tools.parser import parse_shape
        from hlo_tools.stages import ValueRef

        try:
            stages = tuple(Stage(st["text"], tuple(ValueRef(*r) for r in st["inputs"]),
                                 tuple(ValueRef(*r) for r in st["outputs"]))
                           for st in data["stages"])
            buckets = tuple(CommBucket(**{**b, "members": tuple(b["members"]),
                                          "sizes": tuple(b["sizes"])})
                            for b in data["buckets"])
            cut = StageCut(stages, buckets,
                           tuple(parse_shape(s) for s in data["arg_shapes"]),
                           tuple(parse_shape(s) for s in data["result_shapes"]),
                           data["body_name"])
            sched = tuple(Launch(stream, int(k), tuple((a, int(b)) for a, b in after))
                          for stream, k, after in data["schedule"])
            prints = tuple(data["fingerprints"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed staged plan: {err!r}") from None
        if prints != tuple(_fingerprint(st.text) for st in stages):
            raise ValueError("malformed staged plan: a stage's text does not match its "
                             "fingerprint")
        return cls(cut, sched, prints)


def schedule(cut: StageCut) -> tuple[Launch, ...]:
    """The launches of a cut: each stage after the all-reduces it reads (the update after
    all of them), each all-reduce after the stage that outputs its buffer; listed in the
    order they are issued when every all-reduce is launched as soon as it may be."""
    out: list[Launch] = []
    update = len(cut.stages) - 1
    for s, stage in enumerate(cut.stages):
        reads = sorted({int(ref.key) for ref in stage.inputs if ref.kind == REDUCED})
        if s == update:  # the update waits for every all-reduce
            reads = list(range(len(cut.buckets)))
        out.append(Launch(COMPUTE, s, tuple((COMM, k) for k in reads)))
        out += [Launch(COMM, k, ((COMPUTE, s),)) for k, b in enumerate(cut.buckets)
                if b.after_stage == s]
    return tuple(out)


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def even_buckets(graph: DeviceGraph, count: int) -> list[list[int]]:
    """``count`` gradient buckets of about equal bytes, contiguous in the order the
    gradients can be ready (:func:`hlo_tools.plan.ready_order`).

    Raises:
        ValueError: ``count`` is not between 1 and the number of gradient all-reduces.
    """
    space = FusionSpace(graph)
    order = ready_order(space)
    if not 1 <= count <= len(order):
        raise ValueError(f"count={count}: the step has {len(order)} gradient all-reduces")
    sizes = np.cumsum([graph.out_bytes[a] for a in order])
    total = float(sizes[-1])
    buckets: list[list[int]] = [[] for _ in range(count)]
    for a, upto in zip(order, sizes):
        k = min(int((upto - 1e-9) * count // total), count - 1) if total else 0
        buckets[k].append(a)
    return _nonempty(buckets, order)


def _nonempty(buckets: list[list[int]], order: list[int]) -> list[list[int]]:
    """The same number of buckets, each non-empty, contiguous in ``order``."""
    count = len(buckets)
    sizes = [len(b) for b in buckets]
    for k in range(count):  # move members forward to fill empty buckets
        if sizes[k] == 0:
            donor = max(range(count), key=lambda j: sizes[j])
            sizes[donor] -= 1
            sizes[k] += 1
    out, start = [], 0
    for n in sizes:
        out.append(order[start:start + n])
        start += n
    return out


def staged_plan(module: HloModule, buckets: Sequence[Sequence[int]],
              graph: DeviceGraph | None = None) -> StagedPlan:
    """The :class:`StagedPlan` of a ``shard_map`` step's pre-optimization module for a
    bucketing of its gradient all-reduces (node indices of ``graph``, in order)."""
    cut = cut_stages(module, buckets, graph)
    return StagedPlan(cut, schedule(cut), tuple(_fingerprint(s.text) for s in cut.stages))


# ------------------------------------------------------------------ the overlap self-test


class OverlapCheck(NamedTuple):
    """Whether a communication program and a compute stage run at once
    (:meth:`StagedStep.self_test`).

    Attributes:
        overlaps: they overlapped (the same answer in every process of a job).
        wait_s: seconds of the communication program alone.
        compute_s: seconds of the compute stage alone (repeated to about as long).
        together_s: seconds of both, dispatched from two threads at once.
        reason: why not (empty when they overlap).
    """

    overlaps: bool
    wait_s: float
    compute_s: float
    together_s: float
    reason: str


# --------------------------------------------------------------------------- running


def _mesh_of(args: Any) -> Mesh:
    """The mesh of the step's arguments (their NamedShardings must share it)."""
    meshes = {leaf.sharding.mesh for leaf in jax.tree.leaves(args)
              if isinstance(getattr(leaf, "sharding", None), NamedSharding)}
    if len(meshes) != 1:
        raise ValueError(f"the arguments must be placed on one mesh, found {len(meshes)}")
    return meshes.pop()


def _comm_program(mesh: Mesh, bucket: CommBucket, dtype: np.dtype,
                  chunk_bytes: int | None = None) -> Any:
    """The compiled communication program of a bucket: a ``shard_map`` reduction of a
    flat buffer, ``[devices * length]`` split over the devices, each device's slice its
    own buffer; every device gets the reduced buffer as its slice of the result.

    With ``chunk_bytes`` the buffer is reduced in pieces of at most that many bytes, one
    collective each, in order (elementwise the same sums)."""
    reduce = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[bucket.reducer]
    n = bucket.length
    step = max(1, chunk_bytes // np.dtype(dtype).itemsize) if chunk_bytes else n
    bounds = [(a, min(a + step, n)) for a in range(0, n, step)]

    def body(x):
        if len(bounds) <= 1:
            return reduce(x, _AXIS)
        return jax.numpy.concatenate([reduce(x[a:b], _AXIS) for a, b in bounds])

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS),
                               check_vma=False))
    spec = jax.ShapeDtypeStruct((mesh.size * bucket.length,), dtype,
                                sharding=NamedSharding(mesh, P(_AXIS)))
    return jax_bridge.compile_module(None, jax_bridge.InPlaceOf(fn, (spec,))).compiled


class StagedStepError(RuntimeError):
    """A stage or an all-reduce of a staged step failed (the message names which and in
    which process)."""


class StagedParts(NamedTuple):
    """The programs of a staged step timed alone (:meth:`StagedStep.parts`).

    Attributes:
        stage_s: ``[S]`` seconds of each compute stage, in stage order.
        comm_s: ``[B]`` seconds of each communication program, in bucket order.
    """

    stage_s: tuple[float, ...]
    comm_s: tuple[float, ...]


#: How often :meth:`StagedStep.self_test` measures before it says the streams do not
#: overlap.
TEST_ATTEMPTS = 2


class StagedStep:
    """A train step run as staged enactment: ``staged(params, opt_state, batch)``.

    Build it with :func:`staged_step`. Calling it returns what ``jax.jit(step)`` returns
    (the same pytrees, replicated outputs on the step's mesh). The communication stream
    is a daemon worker thread owned by this object; :meth:`close` stops it.

    Attributes:
        plan: the :class:`StagedPlan` it runs.
        devices: the step's mesh devices local to this process, in mesh order.
    """

    def __init__(self, plan: StagedPlan, mesh: Mesh, out_tree: Any, *, exact: bool = False,
                 comm_timeout_s: float = _COMM_TIMEOUT_S,
                 chunk_bytes: int | None = CHUNK_BYTES):
        self.plan = plan
        self.mesh = mesh
        self.out_tree = out_tree
        me = jax.process_index()
        self.devices = tuple(d for d in mesh.devices.flat if d.process_index == me)
        self.comm_timeout_s = comm_timeout_s
        #: ``(bucket, elements)`` of every all-reduce launched, in launch order (the last
        #: 10,000): the same sequence in every process of a job.
        self.comm_log: collections.deque[tuple[int, int]] = collections.deque(maxlen=10_000)
        comm_mesh = Mesh(np.array(list(mesh.devices.flat)), (_AXIS,))
        self.comm_mesh = comm_mesh
        # one batch: in a job its compiles are spread over the processes
        # (hlo_tools.jax_bridge.spread)
        stage_calls = [functools.partial(
            jax_bridge.compile_module, s.text, jax_bridge.PerDevice(self.devices),
            jax_bridge.CompileOptions(exact=exact)) for s in plan.stages]
        comm_calls = [functools.partial(_comm_program, comm_mesh, b,
                                        NUMPY_DTYPES[b.element_type], chunk_bytes)
                      for b in plan.comms]
        built = jax_bridge.spread(stage_calls + comm_calls)
        self.programs = built[:len(stage_calls)]
        self.comm_programs = built[len(stage_calls):]
        self.out_shardings = [NamedSharding(mesh, P()) for _ in plan.cut.result_shapes]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="disco-comm")
        self._lock = threading.Lock()  # one call at a time: one schedule in flight

    @classmethod
    def for_args(cls, plan: StagedPlan, args: Sequence[Any], out_tree: Any,
                 **kwargs: Any) -> StagedStep:
        """The step that runs ``plan`` on arguments placed like ``args`` (on one mesh);
        ``out_tree`` is the step's output tree structure; ``kwargs`` as ``__init__``."""
        return cls(plan, _mesh_of(args), out_tree, **kwargs)

    def close(self) -> None:
        """Stops the communication thread (after the launches already queued)."""
        self._pool.shutdown(wait=True)

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    # -- the streams

    def _per_device(self, arg: Any, k: int) -> list[Any]:
        """The local per-device buffers of an argument (its addressable shards, however
        jax built the array: :func:`hlo_tools.jax_bridge.devices.local_shards`)."""
        shards = local_shards(arg)
        want = tuple(self.plan.cut.arg_shapes[k].dims)
        out = []
        for d in self.devices:
            if d not in shards or tuple(shards[d].shape) != want:
                raise ValueError(f"argument {k}: no shard of shape {list(want)} on {d}")
            out.append(shards[d])
        return out

    def _reduce(self, k: int, flat: list[Any]) -> list[Any]:
        """The communication stream's work for bucket ``k``: one all-reduce, waited for."""
        bucket = self.plan.comms[k]
        sharding = NamedSharding(self.comm_mesh, P(_AXIS))
        buffer = jax.make_array_from_single_device_arrays(
            (self.comm_mesh.size * bucket.length,), sharding, flat)
        self.comm_log.append((k, bucket.length))
        reduced = self.comm_programs[k](buffer)
        reduced.block_until_ready()  # the channel is busy until the buffer is reduced
        shards = {s.device: s.data for s in reduced.addressable_shards}
        return [shards[d] for d in self.devices]

    def __call__(self, *args: Any) -> Any:
        leaves = jax.tree.leaves(args)
        cut = self.plan.cut
        if len(leaves) != len(cut.arg_shapes):
            raise ValueError(f"the step takes {len(cut.arg_shapes)} arrays, got {len(leaves)}")
        with self._lock:
            return self._run(leaves)

    def self_test(self, *args: Any, barrier: Callable[[str], None] | None = None
                  ) -> OverlapCheck:
        """Checks that this jax/XLA build and machine overlap the two streams: the first
        bucket's all-reduce alone, the longest compute stage alone (repeated to about as
        long), then both at once from the two threads. They overlap when running them
        together hides at least 30% of the shorter one (without a second thread in
        XLA:CPU's pool they take longer than the two alone: 295 ms against 229 ms for
        transformer-medium over 1 Gbit/s; with one, 145 against 245 ms). Every process
        of a job must call it (it runs collectives); the verdict is reduced over the
        processes (all overlap or none). A verdict against overlap is taken again, up to
        :data:`TEST_ATTEMPTS` times in all: one slow sample of a busy machine in one
        process must not turn a staged program its final choice measured faster into
        one program.

        XLA:CPU runs programs on its client's thread pool; a process pinned to one CPU
        gets a single thread unless ``NPROC`` says otherwise (jax/jaxlib 0.10.2), and its
        programs then run one after the other: staged enactment gains nothing.
        """
        import time

        leaves = jax.tree.leaves(args)
        with self._lock:
            values = self._run(leaves, keep=True)
        stage = max(range(len(self.plan.stages)),
                    key=lambda k: self.plan.stages[k].text.count("\n"))
        inputs = [values[(ref.kind, ref.key)] for ref in self.plan.stages[stage].inputs]
        flat = values[(FLAT, 0)]

        def line_up(tag: str) -> None:
            if barrier is not None:
                barrier(f"staged_self_test_{tag}")

        def timed(fn: Callable[[], Any]) -> float:
            line_up("t")
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        wait = lambda: self._reduce(0, flat)  # noqa: E731
        compute = lambda: jax.block_until_ready(self.programs[stage](inputs))  # noqa: E731
        wait(), compute()
        for _ in range(TEST_ATTEMPTS):  # every process sees the same verdict: in step
            alone_w = min(timed(wait) for _ in range(2))
            alone_c = min(timed(compute) for _ in range(2))
            reps = max(1, min(20, round(alone_w / max(alone_c, 1e-4))))

            def both(reps: int = reps) -> None:
                fut = self._pool.submit(wait)
                for _ in range(reps):
                    compute()
                fut.result(timeout=self.comm_timeout_s)

            together = min(timed(both) for _ in range(2))
            serial = alone_w + reps * alone_c
            mine = serial - together >= 0.3 * min(alone_w, reps * alone_c)
            everyone = self._all_agree(mine)
            if everyone:
                break
        reason = "" if everyone else (
            f"the streams did not overlap ({together * 1e3:.0f} ms together, "
            f"{serial * 1e3:.0f} ms alone"
            + ("" if mine else " in this process")
            + "): XLA:CPU ran them one after the other (one thread in its pool: a process "
              "pinned to one CPU needs NPROC=2 or more in its environment) or they compete "
              "for the CPU")
        return OverlapCheck(everyone, alone_w, reps * alone_c, together, reason)

    def _all_agree(self, ok: bool) -> bool:
        """``ok`` of every process, and-ed (a minimum all-reduce on the comm mesh)."""
        bucket = CommBucket(("self_test",), (1,), "f32", "min", False, 0)
        program = _comm_program(self.comm_mesh, bucket, np.dtype(np.float32))
        flags = [jax.device_put(np.ones(1, np.float32) * float(ok), d) for d in self.devices]
        buffer = jax.make_array_from_single_device_arrays(
            (self.comm_mesh.size,), NamedSharding(self.comm_mesh, P(_AXIS)), flags)
        out = program(buffer)
        return bool(np.min(np.asarray(out.addressable_shards[0].data)) > 0.5)

    def parts(self, *args: Any, repeats: int = 3,
              barrier: Callable[[str], None] | None = None) -> StagedParts:
        """Times every program of the schedule alone (median of ``repeats`` calls each,
        each waited for): the compute stages on this thread, then the communication
        programs in bucket order (a multi-process job calls this in every process;
        ``barrier(tag)`` lines the processes up before each all-reduce is timed)."""
        import statistics
        import time

        leaves = jax.tree.leaves(args)
        with self._lock:
            values = self._run(leaves, keep=True)
        stage_s, comm_s = [], []
        for k, stage in enumerate(self.plan.stages):
            inputs = [values[(ref.kind, ref.key)] for ref in stage.inputs]
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                jax.block_until_ready(self.programs[k](inputs))
                times.append(time.perf_counter() - t0)
            stage_s.append(statistics.median(times[1:]))
        for k in range(len(self.plan.comms)):
            times = []
            for r in range(repeats + 1):
                if barrier is not None:
                    barrier(f"staged_parts_{k}_{r}")
                t0 = time.perf_counter()
                self._reduce(k, values[(FLAT, k)])
                times.append(time.perf_counter() - t0)
            comm_s.append(statistics.median(times[1:]))
        return StagedParts(tuple(stage_s), tuple(comm_s))

    def _wait(self, k: int, fut: concurrent.futures.Future) -> list[Any]:
        """Bucket ``k``'s reduced buffers; a clear error when its all-reduce failed or did
        not finish in time (e.g. another process of the job failed)."""
        try:
            return fut.result(timeout=self.comm_timeout_s)
        except concurrent.futures.TimeoutError:
            raise StagedStepError(
                f"process {jax.process_index()}: the all-reduce of bucket {k} did not "
                f"finish in {self.comm_timeout_s:.0f} s (did another process of the job "
                "fail?)") from None
        except Exception as err:
            raise StagedStepError(f"process {jax.process_index()}: the all-reduce of "
                                  f"bucket {k} failed: {err}") from err

    def _run(self, leaves: list[Any], keep: bool = False) -> Any:
        values: dict[tuple[str, Any], list[Any]] = {}
        comms: dict[int, concurrent.futures.Future] = {}
        for launch in self.plan.schedule:
            if launch.stream == COMM:
                flat = values[(FLAT, launch.program)]
                comms[launch.program] = self._pool.submit(self._reduce, launch.program, flat)
                continue
            for stream, k in launch.after:
                if stream == COMM:
                    values[(REDUCED, k)] = self._wait(k, comms[k])
            stage = self.plan.stages[launch.program]
            inputs = []
            for ref in stage.inputs:
                if ref.kind == ARG:
                    key = (ARG, ref.key)
                    if key not in values:
                        values[key] = self._per_device(leaves[int(ref.key)], int(ref.key))
                    inputs.append(values[key])
                else:
                    inputs.append(values[(ref.kind, ref.key)])
            try:
                outputs = self.programs[launch.program](inputs)
            except Exception as err:
                raise StagedStepError(f"process {jax.process_index()}: stage "
                                      f"{launch.program} failed: {err}") from err
            for ref, per_device in zip(stage.outputs, outputs, strict=True):
                values[(ref.kind, ref.key)] = per_device
        if keep:  # every value of the schedule, for timing its programs alone
            for k, fut in comms.items():
                values[(REDUCED, k)] = self._wait(k, fut)
            return values
        results = [jax.make_array_from_single_device_arrays(
            tuple(shape.dims), sharding, values[(RESULT, j)])
            for j, (shape, sharding) in enumerate(zip(self.plan.cut.result_shapes,
                                                      self.out_shardings))]
        return jax.tree.unflatten(self.out_tree, results)


def staged_step(step: Callable[..., Any], args: Sequence[Any],
                buckets: int | Sequence[Sequence[int]] = 1, *, exact: bool = False,
                comm_timeout_s: float = _COMM_TIMEOUT_S,
                chunk_bytes: int | None = CHUNK_BYTES,
                module: HloModule | None = None) -> StagedStep:
    """Builds the staged enactment of a zoo-style ``shard_map`` train step.

    Args:
        step: ``step(params, opt_state, batch) -> (params, opt_state, loss)`` (plain or
            jitted), a ``shard_map`` over a 1-D mesh with one ``pmean`` per gradient.
        args: its arguments, placed on the mesh (as the zoo places them).
        buckets: the number of gradient buckets (:func:`even_buckets`), or the buckets
            themselves as all-reduce node indices of ``device_graph`` of the step's
            module (e.g. :func:`hlo_tools.plan.bucket_members`), in order.
        exact: compile the stages with XLA's fusion passes off (as written).
        comm_timeout_s: how long the compute stream waits for one all-reduce.
        chunk_bytes: reduce each bucket in collectives of at most this many bytes
            (None: one collective per bucket).
        module: the step's pre-optimization module on ``args``, already parsed (None:
            lowered and parsed here).

    Returns:
        The :class:`StagedStep`. In a multi-process job every process builds it from the
        same step and calls it alike: the all-reduces pair up across processes in
        launch order.

    Raises:
        ValueError: the step is not a supported ``shard_map`` step, or its arguments
            are not placed on one mesh.
    """
    step = jax_bridge.fresh_function(step)
    if module is None:
        module = hlo_tools.parse(jax_bridge.extract(step, *args))
    graph = device_graph(module)
    if isinstance(buckets, int):
        buckets = even_buckets(graph, buckets)
    plan = staged_plan(module, buckets, graph)
    if len(plan.cut.arg_shapes) != len(jax.tree.leaves(args)):
        raise ValueError("the step's program does not take every argument (jax dropped "
                         "unused ones)")
    out_tree = jax.tree.structure(jax.eval_shape(step, *args))
    return StagedStep(plan, _mesh_of(args), out_tree, exact=exact,
                      comm_timeout_s=comm_timeout_s, chunk_bytes=chunk_bytes)
