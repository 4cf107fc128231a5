"""The C kernel of the moves (``_plan_kernel.c``): its build, its tables, the calls into it.

The tries of the three moves and the arrays of their merges run in a CPython extension
built with the system C compiler on first use into the cache directory
(:func:`hlo_tools.dirs.cache_dir`, by :class:`hlo_tools.native.Kernel`, as the parser's
kernel is). ``DISCO_PLAN_BACKEND=python`` selects the pure-Python moves; ``auto`` (the
default) uses the kernel when it can be built; without the Python headers (``Python.h``) or
a compiler it warns once and the Python moves run.

The kernel draws through the rng's own ``getrandbits`` as :mod:`hlo_tools.plan.draws`
does, and it keeps its own port of the checks of :mod:`hlo_tools.plan.legality`
(``fusion_legal``, ``duplicate_legal``, ``layout_safe``, ``feeds_only_node``, ...) in the
same order, for speed: it mirrors that module, which stays the reference, and a change to
one is a change to the other. It calls back the Python code for the neighbours of a fused
rank node and for the compare rule, and answers ``NotImplemented``, before drawing
anything, for a plan it cannot take (arrays other than ``array('i')``); the Python code
keeps the plans' private facts (copy index, all-reduce state). The tries report their
decisions as codes (:data:`_DECISIONS`) when traced.

``tests/test_plan.py`` checks that both backends decide the same:
``test_kernel_moves_as_python_does`` (the plans and draws of walks on every fixture),
``test_walks_decide_as_recorded`` (every try of the golden walks and its decision) and
``test_moves_decide_as_legality_does`` (each try decides what ``can_fuse``,
``can_duplicate`` or ``can_combine`` decides), the last two with each backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hlo_tools import native
from hlo_tools.plan.legality import (
    _BUCKET_CYCLE,
    _COMPARES_COPY,
    _EXPOSES_MEMBER,
    _FUSED_PRODUCER,
    _KEYS_DIFFER,
    _LAYOUT_UNSAFE,
    _NEEDS_MULTI_OUTPUT,
    _NO_NEIGHBOUR,
    _NO_OTHER_USERS,
    _NO_PRODUCER,
    LEGAL,
    Try,
    _compare_reads_copy,
)
from hlo_tools.plan.merge import _combine_spans, _finish_merge, _with_copy
from hlo_tools.plan.neighbours import _neighbours
from hlo_tools.plan.reach import _descendants_i32
from hlo_tools.plan.space import FusionSpace, _ar, _ArTables
from hlo_tools.plan.value import Plan, _single_output

if TYPE_CHECKING:
    from collections.abc import Callable

    from hlo_tools.plan.neighbours import _ArState

SOURCE = Path(__file__).with_name("_plan_kernel.c")
#: The extension's module name (its init function is ``PyInit__plan_kernel_ext``).
NAME = "_plan_kernel_ext"

#: The kernel and its state (``KERNEL.module``, ``KERNEL.tried``).
KERNEL = native.Kernel(SOURCE, NAME, "plankernel", owner="hlo_tools.plan", fallback="moves",
                       backend_var="DISCO_PLAN_BACKEND")
#: Compiles the kernel into the cache directory unless it is there already; its path.
build = KERNEL.build
#: The kernel module (built on first call), or None for the pure-Python moves.
load = KERNEL.load

#: The decision of each code the kernel's tries report (its ``enum Decision``, in order).
_DECISIONS = (LEGAL, _NO_PRODUCER, _NEEDS_MULTI_OUTPUT, _LAYOUT_UNSAFE, _COMPARES_COPY,
              _FUSED_PRODUCER, _NO_OTHER_USERS, _EXPOSES_MEMBER, _NO_NEIGHBOUR, _KEYS_DIFFER)


def c_kernel_available() -> bool:
    """Whether the moves run in the C kernel (built on first call)."""
    return load() is not None


def _kernel(space: FusionSpace) -> tuple[Any, Any] | bool:
    """The C kernel and ``space``'s tables for it, made on first use and kept as
    ``space._ks``; False when the pure-Python code runs."""
    kernel = load()
    if kernel is None:
        space._ks = False
    else:
        space._ks = kernel, kernel.new_space(
            space.n, space.root, space.multi_output, space.users, space._dops, space._fops,
            space._bad, space.compute_nodes, _neighbours_of,
            [i for i, r in enumerate(space._reduce) if r],
            _compare_reads_copy if space._any_compare else None)
    return space._ks


def _kernel_ar(space: FusionSpace, tables: _ArTables, kernel) -> Any:
    """The kernel's copy of ``tables`` (kept as ``space._kar`` while they are current)."""
    kar = space._kar
    if kar is None or kar[0] is not tables:
        n = space.n
        rank, key, index = [-1] * n, [-1] * n, [-1] * n
        for b, k in tables.index.items():
            rank[b], key[b], index[b] = tables.rank[b], tables.key[b], k
        kar = space._kar = tables, kernel.new_ar_tables(
            n, tuple(tables.index), rank, key, index, tables.by_rank, tables.is_allreduce,
            tables.skip_buckets, tables.in_order)
    return kar[1]


def _kernel_ar_of(space: FusionSpace, state: _ArState | None, kernel) -> Any:
    """The kernel's copy of the all-reduce tables ``state`` (a plan's ``_ArState``, or
    None) was made with, if it has one or they are the space's current tables; else None."""
    if state is None:
        return None
    kar = space._kar
    if kar is not None and kar[0] is state.tables:
        return kar[1]
    tables = _ar(space)
    return _kernel_ar(space, tables, kernel) if state.tables is tables else None


def _neighbours_of(space: FusionSpace, plan: Plan, index: tuple[dict, dict], ar: int):
    """The kernel's call back for a rank node that is fused or holds copies."""
    return _neighbours(space, plan, index, _ar(space), ar)


def _record(trace: list[Try], move: str, raw: list[tuple[int, int, int]]) -> None:
    """Appends to ``trace`` the tries the kernel reported in ``raw`` (code, node, node)."""
    for code, x, y in raw:
        trace.append(Try(move, (x,) if y < 0 else (x, y), _DECISIONS[code]))


def _op_fusion_c(space: FusionSpace, plan: Plan, index: tuple[dict, dict],
                 ks: tuple[Any, Any], bits: Callable[[int], int], tries: int,
                 trace: list[Try] | None):
    """The tries of a single-output op fusion move in the kernel: the merged plan, None if
    no try found a legal pair, NotImplemented if the kernel declines the plan."""
    state = getattr(plan, "_ars", None)
    raw = None if trace is None else []
    found = ks[0].op_fusion(ks[1], _kernel_ar_of(space, state, ks[0]), state, space, plan,
                            index, bits, tries, raw)
    if raw:
        _record(trace, "op_fusion", raw)
    if found is None or found is NotImplemented:
        return found
    return _finish_merge(plan, index, *found, _single_output(plan))


def _duplicate_c(space: FusionSpace, plan: Plan, index: tuple[dict, dict],
                 ks: tuple[Any, Any], bits: Callable[[int], int], tries: int,
                 trace: list[Try] | None):
    """The tries of a duplicate fusion move in the kernel: the plan with the new copy, None
    if no try found a legal pair, NotImplemented if the kernel declines the plan."""
    raw = None if trace is None else []
    found = ks[0].duplicate(ks[1], space, plan, index, bits, tries, raw)
    if raw:
        _record(trace, "duplicate", raw)
    if found is None or found is NotImplemented:
        return found
    return _with_copy(space, plan, index, *found)


def _allreduce_c(space: FusionSpace, plan: Plan, index: tuple[dict, dict], tables: _ArTables,
                 state: _ArState, ks: tuple[Any, Any], bits: Callable[[int], int], tries: int,
                 trace: list[Try] | None):
    """The tries of an AllReduce move in the kernel (of a plan with two buckets or more):
    the merged plan, None if no try found a legal pair, or, when the kernel declines the
    plan (or is busy in another thread), how many tries are left for the Python code."""
    kernel = ks[0]
    kar = _kernel_ar(space, tables, kernel)
    raw = None if trace is None else []
    while tries > 0:
        found = kernel.allreduce_pick(ks[1], kar, space, plan, index, state, bits, tries, raw)
        if raw:
            _record(trace, "allreduce", raw)
            raw.clear()
        if found is None:
            return None
        if found is NotImplemented:
            return tries
        tries, first, s1, e1, second, s2, e2, a, b = found
        merged = _combine_c(space, plan, index, ks, first, s1, e1, second, s2, e2)
        if trace is not None:
            trace.append(Try("allreduce", (a, b), _BUCKET_CYCLE if merged is None else LEGAL))
        if merged is not None:
            return merged
    return None


def _combine_c(space: FusionSpace, plan: Plan, index: tuple[dict, dict], ks: tuple[Any, Any],
               first: int, s1: int, e1: int, second: int, s2: int, e2: int) -> Plan | None:
    """:func:`~hlo_tools.plan.merge._combine_spans` with the kernel's merge when the
    descendants of ``first`` decide (see :func:`~hlo_tools.plan.reach._descendant_groups`)."""
    if _single_output(plan):
        nodes = _descendants_i32(space, plan.order[s1:e1])
        if nodes is not None:
            state = getattr(plan, "_ars", None)
            found = ks[0].merge(ks[1], _kernel_ar_of(space, state, ks[0]), state, plan, first,
                                s1, e1, second, s2, e2, nodes)
            if found is None:
                return None
            if found is not NotImplemented:
                return _finish_merge(plan, index, *found, True)
    return _combine_spans(space, plan, index, first, s1, e1, second, s2, e2)


def _draws(ks: tuple[Any, Any], bits: Callable[[int], int], n: int, count: int) -> None:
    """``count`` draws of ``rng.choice`` over ``n`` items, in the kernel (results unused)."""
    ks[0].draws(bits, n, count)
