"""Evaluating fused-op estimators on measured samples: pure functions, no jax.

Shared by ``disco train-estimator`` and ``benchmarks/estimator_accuracy.py``:

* :func:`split_samples`: training and held-out samples (held out by source model);
* :func:`fallback_time`: the simulator's fallback rule on a :class:`FusedSubgraph`;
* :func:`relative_errors`, :func:`accuracy`, :func:`error_cdf`: how close predictions are
  to measured times;
* :func:`breakdown`: :func:`accuracy` over a whole set and over its parts (by size and
  by sample kind).

Times are seconds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from disco_estimator.interface import fused_parts_time, memory_bound, split_times

__all__ = [
    "CDF_POINTS",
    "SMALL_OP_S",
    "accuracy",
    "breakdown",
    "error_cdf",
    "fallback_time",
    "relative_errors",
    "split_samples",
]

#: Relative errors at which :func:`error_cdf` reports the fraction of predictions within.
CDF_POINTS = (0.01, 0.02, 0.05, 0.10, 0.14, 0.20, 0.30, 0.50, 1.0)
#: Fused ops measured below this many seconds are "small" (where timer noise lives).
SMALL_OP_S = 10e-6


def split_samples(samples: Sequence[Any], held_out: str | None
                  ) -> tuple[list[Any], list[Any]]:
    """``(training, held-out)`` samples: those whose ``source`` is ``held_out`` are held
    out (none when ``held_out`` is None)."""
    train = [s for s in samples if held_out is None or s.source != held_out]
    test = [s for s in samples if held_out is not None and s.source == held_out]
    return train, test


def fallback_time(sub: Any, kernel_launch_s: float, mem_s_per_byte: float) -> float:
    """The fallback rule's time of a fused op described only by its subgraph, seconds.

    :func:`disco_estimator.interface.fallback_fused_time` on the subgraph's own arrays: each
    node's time is split by :func:`disco_estimator.interface.split_times` over its traffic
    (bytes read, plus bytes written for ops that run a kernel, i.e. take time), and the
    fused op's ``io`` is the subgraph's ``input_bytes + output_bytes``.

    Args:
        sub: an :class:`disco_estimator.gnn.features.FusedSubgraph`.
        kernel_launch_s: fixed cost of one kernel, seconds.
        mem_s_per_byte: seconds per byte of memory traffic.
    """
    time_s = np.asarray(sub.time_s, np.float64)
    traffic = sub.in_bytes + np.where(time_s > 0, sub.out_bytes, 0)
    launch, mem, compute = split_times(time_s, traffic, kernel_launch_s, mem_s_per_byte,
                                       memory_bound(sub.opcodes))
    return fused_parts_time(launch, mem, compute, traffic, sub.input_bytes + sub.output_bytes,
                            mem_s_per_byte)


def relative_errors(predicted_s: Sequence[float], measured_s: Sequence[float]) -> np.ndarray:
    """``[n]`` float64 ``|predicted - measured| / measured``."""
    pred = np.asarray(predicted_s, np.float64)
    meas = np.asarray(measured_s, np.float64)
    return np.abs(pred - meas) / meas


def accuracy(predicted_s: Sequence[float], measured_s: Sequence[float]) -> dict[str, float]:
    """``{"n", "within_10", "within_14", "median_rel_err"}`` of predictions: the fractions
    within 10% and 14% relative error ``|predicted - measured| / measured`` and its
    median (NaN without samples)."""
    err = relative_errors(predicted_s, measured_s)
    n = int(err.size)
    return {"n": n,
            "within_10": float(np.mean(err <= 0.10)) if n else math.nan,
            "within_14": float(np.mean(err <= 0.14)) if n else math.nan,
            "median_rel_err": float(statistics.median(err.tolist())) if n else math.nan}


def error_cdf(predicted_s: Sequence[float], measured_s: Sequence[float],
              points: Sequence[float] = CDF_POINTS) -> list[list[float]]:
    """Points of the CDF of relative error: ``[[x, fraction of errors <= x], ...]`` for
    each ``x`` of ``points`` (fractions NaN without samples)."""
    err = relative_errors(predicted_s, measured_s)
    return [[float(x), float(np.mean(err <= x)) if err.size else math.nan] for x in points]


def breakdown(predictions: dict[str, Sequence[float]], measured_s: Sequence[float],
              parts: dict[str, Callable[[int], bool]] | None = None) -> dict[str, Any]:
    """Accuracy of several estimators over a set of samples and over parts of it.

    Args:
        predictions: estimator name -> ``[n]`` predicted seconds.
        measured_s: ``[n]`` measured seconds.
        parts: part name -> predicate on the sample index (e.g. measured under
            :data:`SMALL_OP_S`, or of kind ``"xla"``).

    Returns:
        ``{"all": {name: accuracy + {"cdf": error_cdf}}, part: {name: accuracy}, ...}``.
    """
    measured = np.asarray(measured_s, np.float64)
    out: dict[str, Any] = {"all": {}}
    for name, pred in predictions.items():
        out["all"][name] = {**accuracy(pred, measured), "cdf": error_cdf(pred, measured)}
    for part, keep in (parts or {}).items():
        idx = [i for i in range(measured.size) if keep(i)]
        out[part] = {name: accuracy(np.asarray(pred, np.float64)[idx], measured[idx])
                     for name, pred in predictions.items()}
    return out
