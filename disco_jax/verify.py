"""Whether DisCo's program of a step computes what ``jax.jit``'s computes.

A stored program is trusted only after it ran once next to ``jax.jit``'s program on the
same arguments and every output agreed (:func:`run_both`). Agreement is within
:data:`VERIFY_RTOL` / :data:`VERIFY_ATOL`, or within what floating-point reordering alone
moves an output (:func:`compare_outputs`'s ``reference``): an optimizer step divides by
the root of a squared gradient (Adam), so a gradient within one rounding of zero can move
its parameter by a thousand times the tolerance between two of XLA's own programs of the
same step (``examples/train.py``: 31 output values differ between ``jax.jit``'s program
and the one with nothing fused, by up to 4.6e-5).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["REORDER_FACTOR", "VERIFY_ATOL", "VERIFY_RTOL", "Verdict", "compare_outputs",
           "run_both"]

#: Tolerances of the verification of a stored plan before it is first trusted.
VERIFY_RTOL, VERIFY_ATOL = 1e-5, 1e-6
#: ...or this many times what XLA's own reordering moves an output.
REORDER_FACTOR = 2.0


class Verdict(NamedTuple):
    """The answer of :func:`compare_outputs`.

    Attributes:
        ok: every output agrees.
        max_abs_diff: the largest absolute difference of any output (None: not finite or
            not comparable).
        detail: what differed, or the largest difference, in words.
    """

    ok: bool
    max_abs_diff: float | None
    detail: str


def _local_values(x: Any) -> Any:
    """What this process holds of an output, as numpy: the whole array when it is
    addressable here, else its local shards stacked in device order (an output sharded
    over the processes of a job, e.g. per-device losses)."""
    import numpy as np

    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    return np.stack([np.asarray(s.data) for s in shards])


def _mismatch(i: int, a: Any, b: Any) -> Verdict:
    return Verdict(False, None, f"output {i} is {a.dtype}{list(a.shape)}, jax.jit's "
                                f"{b.dtype}{list(b.shape)}")


def compare_outputs(got: Any, want: Any, reference: Any = None) -> Verdict:
    """Whether two output pytrees agree: same structure, shapes and dtypes; values within
    :data:`VERIFY_RTOL` / :data:`VERIFY_ATOL` (NaN where NaN).

    Args:
        got: DisCo's outputs.
        want: ``jax.jit``'s outputs.
        reference: the outputs of another of XLA's programs of the same step, compiled
            with another order of floating-point operations (nothing fused). A value of
            ``got`` then also agrees when it is no farther from ``want`` than
            :data:`REORDER_FACTOR` times the reference's largest difference in that
            output.
    """
    import jax
    import numpy as np

    g_leaves, g_tree = jax.tree.flatten(got)
    w_leaves, w_tree = jax.tree.flatten(want)
    if g_tree != w_tree:
        return Verdict(False, None, f"its outputs are {g_tree}, jax.jit's {w_tree}")
    worst, bad = 0.0, []
    for i, (a, b) in enumerate(zip(g_leaves, w_leaves, strict=True)):
        if getattr(a, "shape", None) != getattr(b, "shape", None) or \
                getattr(a, "dtype", None) != getattr(b, "dtype", None):
            return _mismatch(i, a, b)
        a, b = _local_values(a), _local_values(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return _mismatch(i, a, b)
        wide = np.complex128 if np.iscomplexobj(a) else np.float64
        x, y = a.astype(wide), b.astype(wide)
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        diff = np.where(same, 0.0, np.abs(x - y))
        worst = max(worst, float(np.max(diff, initial=0.0))) if np.all(np.isfinite(diff)) \
            else math.inf
        close = np.isclose(x, y, rtol=VERIFY_RTOL, atol=VERIFY_ATOL, equal_nan=True)
        if not np.all(close) and reference is not None:
            r = _local_values(jax.tree.leaves(reference)[i]).astype(wide)
            moved = np.abs(r - y)
            if np.all(np.isfinite(moved)):
                close |= diff <= REORDER_FACTOR * float(np.max(moved, initial=0.0))
        if not np.all(close):
            bad.append(i)
    finite = worst if math.isfinite(worst) else None
    shown = "not finite" if finite is None else f"{worst:.3g}"
    within = f"rtol {VERIFY_RTOL:g}, atol {VERIFY_ATOL:g}" + (
        "" if reference is None else
        f", or {REORDER_FACTOR:g} times what XLA's own reordering moves")
    if bad:
        return Verdict(False, finite,
                       f"outputs {bad[:8]} differ, largest difference {shown} ({within})")
    return Verdict(True, finite, f"largest difference {shown} ({within})")


def run_both(run: Callable[..., Any], dyn: tuple, want: Callable[[], Any],
             dynamic_jit: Callable[[], Any]) -> Verdict:
    """Runs DisCo's program and ``jax.jit``'s once on the same arguments and compares
    every output (:func:`compare_outputs`).

    Where values differ beyond the tolerances (in a job: always, every process alike, so
    that every process runs the same collectives), XLA's own program of the step with
    nothing fused runs too and sets how far floating-point order alone moves each output.

    Args:
        run: DisCo's program of the dynamic positional arguments.
        dyn: the dynamic positional arguments.
        want: runs ``jax.jit``'s program on the same arguments, donating nothing (both
            programs read the same buffers).
        dynamic_jit: gives ``jax.jit`` of the function of the dynamic arguments (lowered
            for the reference program, only when one is needed).

    Raises:
        Exception: what running raises.
    """
    import jax

    from hlo_tools.jax_bridge import CompileOptions, InPlaceOf, compile_module

    # waited for before jax.jit's program starts: in a job the two programs' all-reduces
    # then reach every process in the same order
    got = jax.block_until_ready(run(*dyn))
    expected = jax.block_until_ready(want())
    verdict = compare_outputs(got, expected)
    if verdict.ok and jax.process_count() == 1:
        return verdict
    reference = compile_module(None, InPlaceOf(dynamic_jit(), dyn), CompileOptions(exact=True))
    return compare_outputs(got, expected, jax.block_until_ready(reference(*dyn)))
