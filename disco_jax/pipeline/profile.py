"""The in-context profile: the step compiled with nothing fused, profiled and timed where
it runs, beside the same program with one gradient bucket (nothing fused), beside XLA's
default and beside the tuple probe. A *lean* profile, for a budget that cannot pay for
the one-bucket program's compile, leaves it out. Every process of a job calls it alike
(the programs have collectives). :func:`profile_module_in_context` does
the same for a module given alone (an HLO file), on this process's devices, and
:func:`profile_compiled_in_context` runs XLA's compiled module as written."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import hlo_tools
from disco_estimator.ops import trace
from disco_estimator.probes import tuple_allreduce_programs
from disco_jax.pipeline.choose import measure
from disco_jax.pipeline.sync import SOLO, Sync
from hlo_tools.ir import HloModule

__all__ = [
    "MIN_ROUNDS",
    "REMEASURE_INCONSISTENT",
    "CompiledInContext",
    "InContext",
    "compile_again",
    "inconsistent_walls",
    "pooled",
    "profile_compiled_in_context",
    "profile_in_context",
    "profile_module_in_context",
]


class InContext(NamedTuple):
    """What :func:`profile_in_context` measured.

    Attributes:
        profile: the traced profile of the no-fusion program (per-op times).
        wall_s: untraced seconds per iteration of the no-fusion program.
        one_bucket: the no-fusion program with every gradient in one flat all-reduce
            bucket (the same computation, one collective), as a module (None: a lean
            profile).
        one_bucket_wall_s: its untraced seconds per iteration (None: a lean profile).
        fused: XLA's default compilation of the step, as the module XLA runs (None: not
            measured): the fit's program for the saving share.
        fused_wall_s: its untraced seconds per iteration (None: not measured).
        tuple_buffers: how many buffers the tuple probe's all-reduce has: the program's
            gradients, each its own buffer of one all-reduce, as XLA's combiner writes
            them (None: not measured).
        tuple_wall_s: seconds of that all-reduce alone in a program
            (:func:`disco_estimator.probes.tuple_allreduce_programs`; None: not measured,
            or fewer than two gradients). In a job each buffer of a combined
            collective is a network all-reduce of its own; in one process the buffers
            follow one another once the device threads have met, so each pays far less
            than a gradient all-reduce between computations, where the threads meet
            again every time (resnet ``medium`` on 4 devices: 84 all-reduces traced at
            130 ms in all, XLA's one combined all-reduce of the same 8 MB at 22 ms).
        flat_wall_s: seconds of one flat all-reduce of the same bytes alone in a program
            (None: not measured).
        runs: the measured programs by name (``no_fusion``, ``one_bucket`` (not in a
            lean profile), ``fused`` and, when measured, ``tuple`` and ``flat``), each
            called as ``run(*args)``
            with the step's arguments, to be measured again later (:func:`pooled`).
        samples_s: the samples behind the medians above, by the same names.
        one_bucket_profile: the traced profile of the one-bucket program (per-op times
            of its bucket's copies: the concatenate into the flat buffer and the
            slices out of it; None: not measured).
        flat_bytes: the bytes of the tuple probe's flat all-reduce: every gradient's
            (None: not measured).

    The times are medians of interleaved samples (in a job, per sample the minimum over
    processes).
    """

    profile: trace.ProgramProfile
    wall_s: float
    one_bucket: HloModule | None
    one_bucket_wall_s: float | None
    fused: HloModule | None = None
    fused_wall_s: float | None = None
    tuple_buffers: int | None = None
    tuple_wall_s: float | None = None
    flat_wall_s: float | None = None
    runs: Mapping[str, Callable[..., Any]] | None = None
    samples_s: Mapping[str, Sequence[float]] | None = None
    one_bucket_profile: trace.ProgramProfile | None = None
    flat_bytes: int | None = None

    @property
    def lean(self) -> bool:
        """A lean profile: no one-bucket program."""
        return self.one_bucket is None


def profile_in_context(step: Callable[..., Any], args: Sequence[Any], module: HloModule, *,
                       iterations: int = 5, warmup: int = 2, rounds: int = 5,
                       library: bool = True, sync: Sync = SOLO,
                       quick: bool = False,
                       left_s: Callable[[], float] | None = None,
                       xla_default: Callable[..., Any] | None = None,
                       lean: bool = False) -> InContext:
    """Profiles ``module`` compiled with nothing fused, here, in the setup it will run in,
    and times it beside the same program with one gradient bucket (nothing fused), beside
    XLA's default compilation of the step and beside the tuple probe: the gradients'
    combined all-reduce alone, against one flat buffer of the same bytes (see
    :class:`InContext`; with fewer than two gradients there is nothing to combine).

    Args:
        step: the train step (its calling convention).
        args: its arguments (placed on the job's devices).
        module: its pre-optimization module.
        iterations: profiled iterations (per-op times are medians over them).
        warmup: untraced iterations first.
        rounds: untraced samples of each iteration time.
        library: run dots and convolutions on XLA's kernel library, as enacted plans do
            (:class:`hlo_tools.CompileOptions`' ``library``), so their in-context times are
            the times a plan's dots will take.
        sync: the job's :class:`Sync` (default: one process).
        quick: for a short budget: the one-bucket program is timed but not traced (its
            bucket's copies are then priced standalone) and inconsistent timings are not
            measured again.
        left_s: what is left of the profile's time, seconds, when called (None: no
            limit). Beyond its compiles, the no-fusion trace and :data:`MIN_ROUNDS` rounds
            of timings, each part is done only while it fits: rounds up to ``rounds``,
            the one-bucket trace, timings taken again (process 0's clock decides for
            the job).
        xla_default: XLA's default compilation of the step (``run(*args)``, e.g. the
            ``xla_default`` baseline), when compiled already (None: compiled here).
        lean: no one-bucket program: two programs to compile instead of three (the fit
            then takes the all-reduce's latency from the tuple probe or the hardware
            file, :func:`~disco_jax.pipeline.fit.calibrate_in_context`).
    """
    graph = hlo_tools.device_graph(module)
    several = len(graph.gradient_allreduces) >= 2  # something to combine, buckets differ
    exact = hlo_tools.CompileOptions(exact=True, library=library)
    place = hlo_tools.InPlaceOf(step, args)
    runs = {"no_fusion": hlo_tools.compile_module(hlo_tools.to_text(module), place, exact)}
    one = None
    if not lean:
        one = _one_bucket(module, graph)
        runs["one_bucket"] = hlo_tools.compile_module(hlo_tools.to_text(one), place, exact)
    runs["fused"] = xla_default if xla_default is not None else hlo_tools.compile_module(
        None, place, hlo_tools.CompileOptions(exact=False))
    buffers = [int(graph.out_bytes[i]) for i in graph.gradient_allreduces]
    if several:
        probe = tuple_allreduce_programs(buffers)
        runs["tuple"] = lambda *_: probe.run_tuple()
        runs["flat"] = lambda *_: probe.run_flat()
    measured = _profile_runs(runs, args, one, iterations=iterations, warmup=warmup,
                             rounds=rounds, sync=sync, buckets_differ=several,
                             tuple_buffers=len(buffers) if "tuple" in runs else None,
                             quick=quick, left_s=left_s)
    return measured._replace(flat_bytes=sum(buffers) if "flat" in runs else None)


def profile_module_in_context(module: HloModule | str, *, iterations: int = 5,
                              warmup: int = 2, rounds: int = 5, library: bool = True,
                              seed: int = 0) -> InContext:
    """:func:`profile_in_context` for a module given alone (HLO text or our IR), without
    its train step: e.g. a file for ``disco simulate`` / ``disco optimize``.

    Both exact programs (nothing fused; one gradient bucket) are compiled from their text
    by :func:`hlo_tools.compile_module` (``FromText``) on this process's devices, exactly
    as it compiles them in place of the step (``exact=True``, dots and
    convolutions on the kernel library with ``library``), XLA's default from the same
    text, and all run on the same inputs
    made from the entry parameters (normal floats, small ints; seeded). One process: the
    module runs on this process's devices alone.

    Args:
        module: the pre-optimization whole-program module (text, or parsed).
        iterations: profiled iterations (per-op times are medians over them).
        warmup: untraced iterations first.
        rounds: untraced samples of each iteration time.
        library: run dots and convolutions on XLA's kernel library, as enacted plans do.
        seed: seeds the inputs.

    Returns:
        The :class:`InContext` measurement, for :func:`in_context_costs` of the module.

    Raises:
        hlo_tools.jax_bridge.DevicesUnavailableError: the module needs more devices than
            this process has.
        hlo_tools.HloCompileError: the module cannot be compiled here (a compiled or
            multi-replica module, or XLA rejects it).
    """
    from hlo_tools.jax_bridge import CompileOptions, FromText, compile_module

    text = module if isinstance(module, str) else hlo_tools.to_text(module)
    exact = CompileOptions(exact=True, library=library)
    run, inputs = compile_module(text, FromText(seed=seed), exact)
    parsed = hlo_tools.parse(text) if isinstance(module, str) else module
    graph = hlo_tools.device_graph(parsed)
    one = _one_bucket(parsed, graph)
    one_text = hlo_tools.to_text(one)
    runs = {"no_fusion": run,
            "one_bucket": compile_module(one_text, FromText(inputs=False), exact).run,
            "fused": compile_module(text, FromText(inputs=False),
                                    CompileOptions(exact=False)).run}
    return _profile_runs(runs, inputs, one, iterations=iterations, warmup=warmup,
                         rounds=rounds, sync=SOLO,
                         buckets_differ=len(graph.gradient_allreduces) >= 2)


class CompiledInContext(NamedTuple):
    """What :func:`profile_compiled_in_context` measured of a compiled module run as
    written.

    Attributes:
        node_s: seconds per execution of each instruction of the module that ran kernels,
            by name (the kernels XLA made of it summed, medians over iterations and
            devices).
        wall_s: untraced seconds per iteration (median of the samples).
        samples_s: the samples behind ``wall_s``.
        profile: the traced profile of the program (its kernels by XLA's new names).
        devices: the devices it ran on.
    """

    node_s: Mapping[str, float]
    wall_s: float
    samples_s: Sequence[float]
    profile: trace.ProgramProfile
    devices: int


def compile_again(module: HloModule, devices: int) -> Any:
    """XLA's compiled ``module`` compiled again from its ops, as one replica on each of
    ``devices`` local devices: :func:`hlo_tools.compiled.runnable` hands XLA the ops, and
    XLA's default pipeline fuses them as it did the first time. Where XLA does not compile
    a combined all-reduce given as text (jaxlib < 0.12), its buffers are given separately
    and XLA's combiner combines them again.

    Returns:
        The :class:`hlo_tools.jax_bridge.StandaloneHlo` program.

    Raises:
        hlo_tools.HloCompileError: XLA does not compile it.
    """
    from hlo_tools.compiled import runnable
    from hlo_tools.jax_bridge import CompileOptions, HloCompileError, Standalone, compile_module

    def compiled(split: bool) -> Any:
        text = hlo_tools.to_text(runnable(module, split_combined=split))
        return compile_module(text, Standalone(devices), CompileOptions(exact=False))

    try:
        return compiled(False)
    except HloCompileError:
        if not any(i.opcode == "all-reduce" and i.shape.is_tuple
                   for _, i in module.instructions()):
            raise
        return compiled(True)


def profile_compiled_in_context(module: HloModule, *, iterations: int = 5, warmup: int = 2,
                                rounds: int = 5, seed: int = 0) -> CompiledInContext:
    """Runs XLA's compiled ``module`` here, on this process's devices, and times each of
    its instructions in context.

    XLA compiles the module's ops again (:func:`compile_again`); the program runs on
    seeded inputs made from the parameters (every device the same), is profiled and
    timed untraced. Kernels map back to the module's instructions through their
    tags; a fusion whose ops XLA put into another instruction's kernel takes no time.

    Raises:
        hlo_tools.jax_bridge.DevicesUnavailableError: the module needs more devices than
            this process has.
        hlo_tools.HloCompileError: XLA does not compile it again.
        RuntimeError: the trace holds no kernels of it.
    """
    import jax

    from hlo_tools.compiled import tagged_node
    from hlo_tools.jax_bridge.devices import local_devices_for

    devices = len(local_devices_for(module, jax.default_backend()))
    program = compile_again(module, devices)
    placed = program.put_random(seed)

    def run(*inputs: Any) -> Any:
        return program.run(inputs)

    profile = trace.profile_calls(run, program.as_text(), args=placed,
                                  iterations=iterations, warmup=warmup)
    kernels = hlo_tools.parse(profile.hlo_text)
    node_of = {i.name: tagged_node(i.op_name) for _, i in kernels.instructions()}
    node_s = {i.name: 0.0 for _, i in module.instructions() if i.opcode == "fusion"}
    for name, total in profile.times_s.items():
        node = node_of.get(name)
        if node is not None:
            node_s[node] = node_s.get(node, 0.0) + total / max(profile.counts.get(name, 1.0),
                                                                1.0)
    samples = measure({"as_written": run}, placed, rounds=rounds,
                      tag="compiled_in_context")["as_written"]
    return CompiledInContext(node_s, statistics.median(samples), samples, profile, devices)


def _one_bucket(module: HloModule, graph: hlo_tools.DeviceGraph) -> HloModule:
    """``module`` (its device ``graph``) with every gradient in one flat all-reduce
    bucket."""
    from hlo_tools import plan as P

    return hlo_tools.apply_plan(module, P.bucket_plan(P.FusionSpace(graph), None), graph)


#: At most this many more rounds of in-context timings while they are inconsistent
#: (:func:`inconsistent_walls`).
REMEASURE_INCONSISTENT = 2
#: The fewest rounds of in-context timings, whatever the profile's time.
MIN_ROUNDS = 3
#: Calls of each program before :func:`~disco_jax.pipeline.choose.measure` times it.
_MEASURE_WARMUP = 2
#: A sample of :func:`~disco_jax.pipeline.choose.measure` lasts at least this long.
_MIN_SAMPLE_S = 0.1


def inconsistent_walls(walls: Mapping[str, Sequence[float]]) -> bool:
    """Whether in-context timings contradict what the programs are: the one-bucket
    program runs the no-fusion program's kernels with fewer collectives, so its median
    at or above the no-fusion program's can only be a slow phase of a shared host (seen
    once in five held-out runs on 4 host devices: 14.3 against 10.1 ms, which fitted an
    all-reduce latency of 0 and a compute scale of 3.1, and put every prediction of that
    job 15-47% off)."""
    return statistics.median(walls["one_bucket"]) >= statistics.median(walls["no_fusion"])


def _fits(left_s: Callable[[], float] | None, need_s: float, sync: Sync,
          tag: str) -> bool:
    """Whether ``need_s`` more seconds fit in what is left (always without a limit);
    process 0's answer in a job, where every process must run the same programs."""
    if left_s is None:
        return True
    return bool(sync.share(f"profile_fits_{tag}", left_s() >= need_s))


def _profile_runs(runs: Mapping[str, Callable[..., Any]], args: Sequence[Any],
                  one: HloModule | None, *, iterations: int, warmup: int, rounds: int,
                  sync: Sync, buckets_differ: bool,
                  tuple_buffers: int | None = None, quick: bool = False,
                  left_s: Callable[[], float] | None = None) -> InContext:
    """Profiles ``runs["no_fusion"]`` and times it beside ``runs["one_bucket"]`` (the
    program of ``one``; neither in a lean profile, ``one`` None), ``runs["fused"]``
    (XLA's default) and, when given, the tuple probe
    ``runs["tuple"]`` and ``runs["flat"]`` (``tuple_buffers`` buffers), all called on
    ``args``. With ``buckets_differ`` (the program has two gradient
    all-reduces or more, so the bucket has copies), ``runs["one_bucket"]`` is profiled
    too, and timings that are :func:`inconsistent_walls` get up to
    :data:`REMEASURE_INCONSISTENT` more rounds of ``rounds`` samples, pooled (every
    process of a job sees the same samples, so all decide alike). ``quick``: neither the
    one-bucket trace nor the extra rounds. ``left_s``: the profile's time left
    (:func:`profile_in_context`); a round is priced as one sample of every program, each
    as long as a call of the no-fusion program (the slowest: nothing fused, nothing
    combined) or :data:`_MIN_SAMPLE_S`."""
    from hlo_tools import baselines as bl

    buckets_differ = buckets_differ and one is not None
    profile = trace.profile_program(runs["no_fusion"], *args, iterations=iterations,
                                    warmup=warmup)
    call_s = statistics.median(profile.wall_times_s) if profile.wall_times_s else 0.0
    round_s = len(runs) * max(call_s, _MIN_SAMPLE_S)
    while rounds > MIN_ROUNDS and not _fits(
            left_s, (rounds + _MEASURE_WARMUP) * round_s, sync, f"rounds_{rounds}"):
        rounds -= 1
    walls = measure(runs, args, rounds=rounds, sync=sync, tag="in_context")
    one_profile = None
    if buckets_differ and not quick and _fits(left_s, (iterations + warmup) * call_s, sync,
                                              "one_bucket_trace"):
        one_profile = trace.profile_program(runs["one_bucket"], *args,
                                            iterations=iterations, warmup=warmup)
    for again in range(REMEASURE_INCONSISTENT if buckets_differ and not quick else 0):
        if not inconsistent_walls(walls) or not _fits(
                left_s, (rounds + _MEASURE_WARMUP) * round_s, sync, f"again_{again}"):
            break
        more = measure(runs, args, rounds=rounds, sync=sync, tag=f"in_context_{again}")
        walls = {name: [*walls[name], *more[name]] for name in walls}
    probed = "tuple" in runs and tuple_buffers is not None
    return InContext(profile, statistics.median(walls["no_fusion"]), one,
                     statistics.median(walls["one_bucket"]) if one is not None else None,
                     bl.module_from_compiled(runs["fused"]),
                     statistics.median(walls["fused"]),
                     tuple_buffers if probed else None,
                     statistics.median(walls["tuple"]) if probed else None,
                     statistics.median(walls["flat"]) if probed else None,
                     dict(runs), walls, one_profile)


def pooled(measured: InContext, more: Mapping[str, Sequence[float]], *,
           keep: bool = True) -> InContext:
    """``measured`` with more samples of its programs (by the names of
    :attr:`InContext.runs`, e.g. taken again beside other programs later in the job)
    pooled into its medians: a fit to the result describes the job's later minutes as
    well as its first (on this shared VM a program measured a minute apart moved by
    5-17%, and every prediction of the step with it). ``keep=False``: the medians of
    ``more`` alone, for the programs it has (a fit of the minutes ``more`` was taken in,
    to compare with programs measured in the same rounds)."""
    def merged(got: Sequence[float], new: Sequence[float]) -> list[float]:
        return [*got, *new] if keep or not new else list(new)

    samples = {name: merged(got, more.get(name, ()))
               for name, got in (measured.samples_s or {}).items()}

    def median(name: str, old: float | None) -> float | None:
        return statistics.median(samples[name]) if name in samples and old is not None \
            else old

    return measured._replace(
        wall_s=median("no_fusion", measured.wall_s),
        one_bucket_wall_s=median("one_bucket", measured.one_bucket_wall_s),
        fused_wall_s=median("fused", measured.fused_wall_s),
        tuple_wall_s=median("tuple", measured.tuple_wall_s),
        flat_wall_s=median("flat", measured.flat_wall_s), samples_s=samples)
