"""Calibration of the cost model's constants against measured iteration times.

Given measured per-iteration times of several programs (plans, XLA's default, ...) and a
way to predict them for any set of constants, this module fits the backend constants
of :class:`~disco_estimator.costs.cost_model.BackendConstants` together with the AllReduce model
``T = C * bytes + D`` by minimizing the mean absolute percentage error (each case --
e.g. one model -- weighted equally), and writes the result as the text of a hardware
file. It holds:

* :class:`Constants`, the fitted vector, and :class:`FitCase`, one case to fit on
  (measured times, a predictor, the communication terms of the linear start);
* :func:`objective`, :func:`linear_start` and :func:`fit_constants` (Nelder-Mead on
  logit/log scales from a non-negative least-squares start, for each per-kernel overhead
  of a small grid) -> :class:`FitResult`;
* :func:`costs_table` and :func:`calibrated_hardware_text`: a hardware file's text with
  the fitted constants (its ``[costs]`` table and ``[allreduce]`` ``C``/``D``, the
  previous ``C``/``D`` kept as ``microbenchmark_*`` keys).

The functions take every input explicitly; the benchmark
``benchmarks/simulator_accuracy.py`` supplies predictions from the simulator. scipy
(a dependency of jax) is imported on first use. Times are seconds and sizes bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from disco_estimator.costs.cost_model import BackendConstants

__all__ = [
    "BOUNDS",
    "FREE_ALL",
    "LAUNCH_GRID",
    "Constants",
    "FitCase",
    "FitResult",
    "calibrated_hardware_text",
    "costs_table",
    "fit_constants",
    "linear_start",
    "objective",
]

#: Grid of per-kernel overheads tried (seconds); the other constants are fitted per value.
LAUNCH_GRID = (0.5e-6, 2e-6)

#: Bounds of the fitted constants: compute_scale, C (s/B), D (s); phi is in [0, 1].
BOUNDS = {"compute_scale": (0.5, 2.0), "c_s_per_byte": (1e-13, 1e-6), "d_s": (1e-7, 0.02)}

#: Constants a fit can free (besides ``kernel_launch_s``, taken from the launch grid).
FREE_ALL = ("overlap", "compute_scale", "c_s_per_byte", "d_s")


@dataclasses.dataclass(frozen=True)
class Constants:
    """Backend constants (see :class:`~disco_estimator.costs.cost_model.BackendConstants`) with the
    AllReduce model ``T = c_s_per_byte * bytes + d_s``.

    Attributes:
        overlap: phi of the simulator, in [0, 1].
        kernel_launch_s: fixed cost of one kernel, seconds.
        mem_s_per_byte: seconds per byte of memory traffic.
        compute_scale: factor on every compute node's time.
        c_s_per_byte: AllReduce seconds per byte.
        d_s: AllReduce latency, seconds.
    """

    overlap: float
    kernel_launch_s: float
    mem_s_per_byte: float
    compute_scale: float
    c_s_per_byte: float
    d_s: float

    @classmethod
    def from_hardware(cls, hardware: Any) -> Constants:
        """The constants a loaded hardware file
        (:class:`disco_estimator.hardware.HardwareConfig`) gives the cost model."""
        b = BackendConstants.from_hardware(hardware)
        ar = hardware.allreduce
        return cls(b.overlap, b.kernel_launch_s, b.mem_s_per_byte, b.compute_scale,
                   ar.c_s_per_byte, ar.d_s)

    def to_json(self) -> dict[str, float]:
        """The constants as a JSON object (field name -> value)."""
        return dataclasses.asdict(self)


class FitCase(NamedTuple):
    """One case of a fit (e.g. one model in one setup): its variants' measured times and
    how to predict them.

    Attributes:
        measured_s: variant -> measured seconds per iteration (> 0).
        predict: constants -> variant -> predicted seconds per iteration, for the
            variants to score (each must be in ``measured_s``).
        comm_terms: constants -> variant -> ``(bytes, latencies)``: the bytes the
            variant's AllReduces move and the number of latencies ``D`` they pay; only
            :func:`linear_start` reads it (with the start's ``kernel_launch_s`` and
            ``mem_s_per_byte``).
    """

    measured_s: Mapping[str, float]
    predict: Callable[[Constants], Mapping[str, float]]
    comm_terms: Callable[[Constants], Mapping[str, tuple[float, float]]]


class FitResult(NamedTuple):
    """Outcome of :func:`fit_constants`.

    Attributes:
        constants: the best constants found.
        objective: their :func:`objective` (mean absolute percentage error, a fraction).
    """

    constants: Constants
    objective: float


def objective(cases: Sequence[FitCase], c: Constants) -> float:
    """Mean over cases of the mean absolute percentage error over their variants (a
    fraction: 0.05 is 5%)."""
    per = []
    for case in cases:
        pred = case.predict(c)
        meas = case.measured_s
        per.append(statistics.fmean(abs(pred[n] - meas[n]) / meas[n] for n in pred))
    return float(statistics.fmean(per))


def _clip(name: str, value: float) -> float:
    lo, hi = BOUNDS[name]
    return min(max(value, lo), hi)


def linear_start(cases: Sequence[FitCase], base: Constants) -> tuple[float, float, float]:
    """``(compute_scale, C, D)`` from a least-squares fit of relative error that ignores
    overlap: measured ~ k * compute makespan + C * bytes + D * latencies (all >= 0,
    clipped to :data:`BOUNDS`).

    Args:
        cases: the cases; each is predicted once with phi = 0, compute scale 1 and no
            AllReduce time (the compute makespan).
        base: the other constants (``kernel_launch_s``, ``mem_s_per_byte``).
    """
    import numpy as np
    from scipy.optimize import nnls

    rows, rhs = [], []
    zero = dataclasses.replace(base, overlap=0.0, compute_scale=1.0, c_s_per_byte=0.0,
                               d_s=0.0)
    for case in cases:
        terms = case.comm_terms(zero)
        for n, t in case.predict(zero).items():
            nbytes, latencies = terms[n]
            meas = case.measured_s[n]
            rows.append([t / meas, nbytes / meas, latencies / meas])
            rhs.append(1.0)
    a = np.asarray(rows)
    scale = np.maximum(a.max(axis=0), 1e-30)
    coef, _ = nnls(a / scale, np.asarray(rhs))
    k, c, d = coef / scale
    return (_clip("compute_scale", float(k)), _clip("c_s_per_byte", float(c)),
            _clip("d_s", float(d)))


def _unpack(x: Sequence[float], base: Constants, free: Sequence[str]) -> Constants:
    """Constants from the optimizer's vector (logit phi, log of the others, in ``free``'s
    order), clipped to :data:`BOUNDS`; the constants not in ``free`` come from ``base``."""
    values = {}
    for name, v in zip(free, x):
        if name == "overlap":
            values[name] = 1.0 / (1.0 + math.exp(-min(max(v, -30.0), 30.0)))
        else:
            values[name] = _clip(name, math.exp(min(v, 5.0)))
    return dataclasses.replace(base, **values)


def _start_vector(cases: Sequence[FitCase], base: Constants,
                  free: Sequence[str]) -> list[float]:
    """Optimizer start: phi 0.1, the rest from :func:`linear_start` (free ones only)."""
    k, c, d = linear_start(cases, base)
    start = {"overlap": math.log(0.1 / 0.9), "compute_scale": math.log(k),
             "c_s_per_byte": math.log(c), "d_s": math.log(d)}
    return [start[name] for name in free]


def fit_constants(cases: Sequence[FitCase], base: Constants,
                  free: Sequence[str] = FREE_ALL, *,
                  launch_grid: Sequence[float] = LAUNCH_GRID,
                  maxfev: int = 100) -> FitResult:
    """Fits the constants named in ``free`` to the cases' measured times.

    For each per-kernel overhead of ``launch_grid``: Nelder-Mead (at most ``maxfev``
    objective evaluations) on logit phi and the logs of the other free constants, from
    :func:`linear_start`; the best over the grid wins.

    Args:
        cases: what to fit on (see :class:`FitCase`).
        base: the constants not fitted (``mem_s_per_byte`` and every constant not in
            ``free``).
        free: names of the fitted constants, a subset of :data:`FREE_ALL`.
        launch_grid: the per-kernel overheads tried, seconds.
        maxfev: evaluations per Nelder-Mead run.

    Returns:
        The best constants and their :func:`objective`.
    """
    import numpy as np
    from scipy.optimize import minimize

    unknown = set(free) - set(FREE_ALL)
    if unknown:
        raise ValueError(f"cannot fit {sorted(unknown)}; choose from {FREE_ALL}")
    best: FitResult | None = None
    for launch in launch_grid:
        start = dataclasses.replace(base, kernel_launch_s=launch)
        x0 = np.array(_start_vector(cases, start, free))
        steps = np.array([2.0 if name == "overlap" else 0.5 for name in free])
        simplex = np.vstack([x0] + [x0 + np.eye(len(free))[i] * steps[i]
                                    for i in range(len(free))])
        res = minimize(lambda x, s=start: objective(cases, _unpack(x, s, free)), x0,
                       method="Nelder-Mead",
                       options={"maxfev": maxfev, "initial_simplex": simplex,
                                "xatol": 1e-3, "fatol": 1e-5})
        got = FitResult(_unpack(res.x, start, free), float(res.fun))
        if best is None or got.objective < best.objective:
            best = got
    if best is None:
        raise ValueError("launch_grid is empty")
    return best


# --------------------------------------------------------------------------- hardware files

#: First words of the comment written above a calibrated ``[costs]`` table (how a
#: rewrite finds and replaces it).
_COMMENT_START = "# [costs] and [allreduce]"


def costs_table(c: Constants, free: Sequence[str], comment: Sequence[str] = ()) -> str:
    """The ``[costs]`` TOML table of calibrated constants, after a comment.

    Args:
        c: the constants.
        free: the fitted constants' names (``compute_scale`` is written only if fitted;
            the comment names the fitted AllReduce constants).
        comment: where the constants come from, one line each (without ``#``); the first
            follows ``# [costs] and [allreduce] <fitted AllReduce constants>:``.

    Returns:
        The text, ending with a newline.
    """
    ar = " / ".join(n for n in ("c_s_per_byte", "d_s") if n in free)
    first, *rest = list(comment) or [""]
    lines = [f"{_COMMENT_START} {ar}: {first}".rstrip(), *(f"# {line}" for line in rest),
             "[costs]",
             f"overlap = {c.overlap!r}",
             f"kernel_launch_s = {c.kernel_launch_s!r}",
             f"mem_s_per_byte = {c.mem_s_per_byte!r}"]
    if "compute_scale" in free:
        lines.append(f"compute_scale = {c.compute_scale!r}")
    return "\n".join(lines) + "\n"


def calibrated_hardware_text(text: str, raw: Mapping[str, Any], c: Constants,
                             free: Sequence[str], comment: Sequence[str] = ()) -> str:
    """A hardware file's text with calibrated constants.

    The ``[allreduce]`` ``c_s_per_byte``/``d_s`` become ``c``'s, the values they replace
    are kept as ``microbenchmark_c_s_per_byte``/``microbenchmark_d_s`` (the first ones:
    rewriting keeps them), ``time_metric = "op"`` becomes ``"program"``, and the
    :func:`costs_table` is appended (replacing an earlier one with its comment).

    Args:
        text: the file's text.
        raw: the same file parsed (``HardwareConfig.raw``).
        c: the constants.
        free: the fitted constants' names (see :func:`costs_table`).
        comment: where the constants come from (see :func:`costs_table`).
    """
    ar = raw["allreduce"]
    text = re.sub(r"(?ms)^# \[costs\] and \[allreduce\].*?(?=^\[costs\])", "", text)
    text = re.sub(r"(?ms)^\[costs\]\n.*?(?=^\[|\Z)", "", text)
    text = re.sub(r"(?m)^(microbenchmark_c_s_per_byte|microbenchmark_d_s) = .*\n", "", text)
    micro_c = ar.get("microbenchmark_c_s_per_byte", ar["c_s_per_byte"])
    micro_d = ar.get("microbenchmark_d_s", ar["d_s"])
    block = (f"c_s_per_byte = {c.c_s_per_byte!r}\nd_s = {c.d_s!r}\n"
             f"microbenchmark_c_s_per_byte = {micro_c!r}\nmicrobenchmark_d_s = {micro_d!r}\n")
    text = re.sub(r"(?m)^c_s_per_byte = .*\nd_s = .*\n", block, text, count=1)
    text = re.sub(r'(?m)^time_metric = "op"$', 'time_metric = "program"', text, count=1)
    return text.rstrip("\n") + "\n\n" + costs_table(c, free, comment)
