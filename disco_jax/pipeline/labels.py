"""Fused-op labels of a step: its compiled programs traced where they run.

:func:`trace_labels` profiles compiled programs of a step (plans enacted exactly, XLA's
own compilations) and turns each of their fused kernels into a labeled sample
(:func:`disco_estimator.gnn.context.context_samples`) whose features come from the step's
cost model: the member times the GNN reads when the search prices a group.
:func:`random_plan_programs` compiles seeded random plans of a step for it, and
:func:`step_labels` does both for a whole step (``benchmarks/estimator_context.py``
builds the context dataset with it). :func:`keep_labels` adds what a product run traced
to the user's local dataset, without ever failing the run.

Times are seconds throughout.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import hlo_tools
from disco_estimator.gnn.context import context_samples, traced_fusions
from disco_estimator.gnn.dataset import Sample
from disco_estimator.ops import trace

__all__ = [
    "KEEP_ITERATIONS",
    "LABELS_ENV",
    "StepLabels",
    "keep_labels",
    "keep_labels_s",
    "labels_wanted",
    "random_plan_programs",
    "step_labels",
    "trace_labels",
]


#: Traced iterations per program when a product run keeps labels (after one untraced).
KEEP_ITERATIONS = 3
#: ``DISCO_LOCAL_LABELS=0`` (or ``off``): product runs keep no fused-op labels.
LABELS_ENV = "DISCO_LOCAL_LABELS"


def labels_wanted() -> bool:
    """Whether product runs add fused-op labels to the local dataset
    (``$DISCO_LOCAL_LABELS``, default yes)."""
    import os

    return os.environ.get(LABELS_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


def trace_labels(runs: Mapping[str, Callable[..., Any]], args: Sequence[Any], costs: Any,
                 origin: str, *, iterations: int = 5, warmup: int = 1,
                 retest: bool = False) -> list[Sample]:
    """Traces each program of ``runs`` and labels its fused kernels.

    Args:
        runs: compiled programs of the step by name (each called as ``run(*args)``,
            e.g. :func:`hlo_tools.compile_module`'s).
        args: the step's arguments, placed.
        costs: the step's cost model (a :class:`~disco_estimator.interface.NodeCostSource`).
        origin: the samples' ``source``.
        iterations: traced iterations per program (labels are medians over them and
            the devices).
        warmup: untraced iterations first.
        retest: trace every program a second time, after all the first traces, and
            record each label's second median as ``retest_s``.

    Returns:
        The samples, program by program (a fused op two programs share is kept once:
        the first).
    """
    first = {name: trace.profile_program(run, *args, iterations=iterations, warmup=warmup)
             for name, run in runs.items()}
    again = ({name: trace.profile_program(run, *args, iterations=iterations, warmup=warmup)
              for name, run in runs.items()} if retest else {})
    out: dict[str, Sample] = {}
    for name, profile in first.items():
        module = hlo_tools.parse(profile.hlo_text)
        second = ({f.name: f for f in traced_fusions(again[name], module)}
                  if name in again else None)
        for s in context_samples(traced_fusions(profile, module), costs, origin, second):
            out.setdefault(s.key, s)
    return list(out.values())


def random_plan_programs(program: Any, count: int, seed: int, *, moves: int = 80
                         ) -> dict[str, Callable[..., Any]]:
    """``count`` seeded random plans of a step (op and duplicate fusion, as the GNN's
    standalone dataset draws them), each enacted and compiled exactly in the step's place.

    Args:
        program: the step's :class:`~disco_jax.pipeline.program.Program`.
        count: plans.
        seed: seed of the first plan (plan ``k`` uses ``seed + k``).
        moves: random moves per plan.
    """
    from hlo_tools import plan as P
    from hlo_tools.jax_bridge import platform_family

    graph = program.graph
    space = P.FusionSpace(graph)
    exact = hlo_tools.CompileOptions(exact=True, library=True)
    backend = platform_family(program.platform) or "cpu"
    out = {}
    for k in range(count):
        plan = P.random_moves(space, P.initial_plan(graph), random.Random(seed + k), moves,
                              weights=(0.6, 0.4, 0.0))
        text = hlo_tools.to_text(hlo_tools.apply_plan(program.module, plan, graph,
                                                      backend=backend))
        out[f"random_{seed + k}"] = hlo_tools.compile_module(
            text, hlo_tools.InPlaceOf(program.step, program.args), exact)
    return out


class StepLabels(NamedTuple):
    """What :func:`step_labels` measured of one step.

    Attributes:
        samples: the labeled fused ops (kind ``"context"``).
        programs: how many programs were traced.
        seconds: wall time, profile and fit included.
    """

    samples: list[Sample]
    programs: int
    seconds: float


def step_labels(step: Callable[..., Any], args: Sequence[Any], origin: str, *,
                plans: int = 6, seed: int = 0, hardware: str | None = None,
                xla_default: bool = True, retest: bool = True,
                iterations: int = 5) -> StepLabels:
    """Labels of one step: its in-context profile and cost model
    (:func:`~disco_jax.pipeline.profile.profile_in_context`,
    :func:`~disco_jax.pipeline.fit.in_context_costs`), then ``plans`` random plans and
    XLA's default compilation traced (:func:`trace_labels`).

    Args:
        step: the train step (a ``shard_map`` data-parallel step).
        args: its arguments.
        origin: the samples' ``source`` (e.g. the model's name).
        plans: random plans traced.
        seed: seed of the first plan.
        hardware: the hardware file (default: this setup's,
            :func:`~disco_jax.pipeline.fit.default_hardware`).
        xla_default: trace XLA's default compilation of the step too.
        retest: trace every program twice (``retest_s``).
        iterations: traced iterations per program.
    """
    import time

    import jax

    from disco_jax.pipeline.fit import default_hardware, in_context_costs
    from disco_jax.pipeline.profile import profile_in_context
    from disco_jax.pipeline.program import lower_program
    from hlo_tools import baselines as bl

    t0 = time.perf_counter()
    program = lower_program(step, args)
    measured = profile_in_context(program.step, program.args, program.module)
    hardware = hardware or default_hardware(jax.process_count(), program.platform)
    costs, _ = in_context_costs(program.module, hardware, measured, progress=False)
    runs = random_plan_programs(program, plans, seed)
    if xla_default:
        runs["xla_default"] = bl.compile_baseline(program.step, program.args, "xla_default")
    samples = trace_labels(runs, program.args, costs, origin, iterations=iterations,
                           retest=retest)
    return StepLabels(samples, len(runs), time.perf_counter() - t0)


def keep_labels_s(programs: int, iteration_s: float) -> float:
    """About how long :func:`keep_labels` takes for ``programs`` programs of
    ``iteration_s`` seconds an iteration: per program the untraced and traced iterations
    and one more, and a second for the trace itself."""
    return programs * ((KEEP_ITERATIONS + 2) * iteration_s + 1.0)


def keep_labels(runs: Mapping[str, Callable[..., Any]], args: Sequence[Any], costs: Any,
                origin: str, *, iterations: int = KEEP_ITERATIONS) -> int:
    """Traces ``runs`` and adds their labels to the user's local dataset
    (:mod:`disco_estimator.gnn.local`); returns how many were new. Every process of a job
    calls it alike (the programs have collectives); the one without a cost model
    (``costs`` None) only runs them. Any failure (a trace the profiler cannot write, a
    full disk) warns once and adds nothing: labels never cost a run its result."""
    from disco_estimator.gnn.local import add_local_samples
    from disco_estimator.ops import backend_fingerprint

    try:
        if costs is None:
            for run in runs.values():
                trace.profile_program(run, *args, iterations=iterations, warmup=1)
            return 0
        samples = trace_labels(runs, args, costs, origin, iterations=iterations)
        return add_local_samples(samples, backend_fingerprint(1)) if samples else 0
    except Exception as err:  # never the user's failure
        warnings.warn(f"disco: fused-op labels not kept ({type(err).__name__}: {err})",
                      RuntimeWarning, stacklevel=2)
        return 0
