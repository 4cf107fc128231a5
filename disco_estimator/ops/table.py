"""The op-time table: single-op times by op key, and the analytic fallback for the rest.

* :class:`OpTimes`: single-op times by :class:`~disco_estimator.ops.keys.OpKey` from every
  source -- a whole-program profile (:class:`~disco_estimator.ops.trace.ProgramProfile`),
  a stored :class:`OpProfile`, standalone timings (:mod:`disco_estimator.ops.standalone`)
  -- the first source to time a key wins; an op no source timed gets the fallback
  model's time, flagged *estimated*.
* :class:`OpCostModel`: the analytic fallback, ``time = a + b * bytes + c * flops`` per
  opcode class (:class:`LinearOpCost`), fitted on measured ops.
* :class:`OpProfile`: the measured per-op times of one program on one backend, keyed by
  op and storable as JSON (:func:`build_op_profile`, :func:`profile_ops`).

Times are seconds, sizes bytes, work flops throughout.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from disco_estimator.ops.cache import OpTiming
from disco_estimator.ops.keys import (
    OpInfo,
    OpKey,
    analyze_module,
    describe_instruction,
    is_library_fusion,
    library_info,
    library_key,
    module_view,
    op_status,
)
from disco_estimator.ops.trace import ProgramProfile, profile_program
from hlo_tools.dirs import write_atomic
from hlo_tools.ir import HloComputation, HloInstruction, HloModule

__all__ = [
    "LinearOpCost",
    "OpCostModel",
    "OpEstimate",
    "OpProfile",
    "OpRecord",
    "OpTimes",
    "build_op_profile",
    "profile_ops",
]

PROFILE_SCHEMA = 1
_MIN_TIME_S = 1e-7
#: Steps :func:`_original_path` walks from a kernel without ``op_name`` to its op.
_CHAIN = 8


# --------------------------------------------------------------------------- fallback model


@dataclasses.dataclass(frozen=True)
class LinearOpCost:
    """``time = a_s + b_s_per_byte * bytes + c_s_per_flop * flops`` (all coefficients >= 0).

    Attributes:
        a_s: fixed cost per op, seconds.
        b_s_per_byte: seconds per byte moved (operands + result).
        c_s_per_flop: seconds per flop.
        n_samples: ops the coefficients were fitted on (0: defaults).
        floor_s: smallest time ever predicted, seconds (> 0).
    """

    a_s: float
    b_s_per_byte: float
    c_s_per_flop: float
    n_samples: int = 0
    floor_s: float = _MIN_TIME_S

    def predict(self, nbytes: float, flops: float) -> float:
        """Predicted time in seconds (never below ``floor_s``)."""
        t = self.a_s + self.b_s_per_byte * nbytes + self.c_s_per_flop * flops
        return max(t, self.floor_s, _MIN_TIME_S)


#: Used for a class with no profiled op: ~2 us launch, ~5 GB/s, ~10 GFLOP/s (one CPU core).
DEFAULT_OP_COST = LinearOpCost(2e-6, 2e-10, 1e-10, 0, _MIN_TIME_S)


def _fit_linear(rows: Sequence[tuple[float, float, float]]) -> LinearOpCost:
    """Non-negative least squares on relative error of ``(bytes, flops, time)`` rows.

    If the rows show no size dependence (both slopes fit to zero, e.g. a single op), the
    default bandwidth term is kept so that bigger unseen ops never come out as cheap as
    the measured small ones.
    """
    from scipy.optimize import nnls

    data = np.asarray(rows, dtype=float)
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    t = np.maximum(data[:, 2], _MIN_TIME_S)
    scale = np.maximum(x.max(axis=0), 1e-30)
    coef, _ = nnls(x / scale / t[:, None], np.ones(len(data)))
    coef = coef / scale
    floor = max(float(t.min()) * 0.5, _MIN_TIME_S)
    b = float(coef[1]) if coef[1] > 0 or coef[2] > 0 else DEFAULT_OP_COST.b_s_per_byte
    return LinearOpCost(float(coef[0]), b, float(coef[2]), len(data), floor)


def _enough(rows: Sequence[tuple[float, float, float]]) -> bool:
    """A class gets its own fit with >= 3 ops of >= 2 distinct sizes (else the global fit)."""
    return len(rows) >= 3 and len({r[0] for r in rows}) >= 2


@dataclasses.dataclass
class OpCostModel:
    """Per-class analytic fallback for ops with no measured time.

    Attributes:
        classes: opcode class -> cost fitted on that class's profiled ops.
        default: cost for classes with too few profiled ops: fitted on all profiled ops,
            or :data:`DEFAULT_OP_COST` if there are none.
    """

    classes: dict[str, LinearOpCost]
    default: LinearOpCost = DEFAULT_OP_COST

    @classmethod
    def fit(cls, samples: Iterable[tuple[str, float, float, float]]) -> OpCostModel:
        """Fits from ``(class, bytes, flops, time_s)`` samples of profiled ops."""
        by_cls: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
        for c, nbytes, flops, t in samples:
            if t > 0:
                by_cls[c].append((float(nbytes), float(flops), float(t)))
        rows = [r for rs in by_cls.values() for r in rs]
        default = _fit_linear(rows) if rows else DEFAULT_OP_COST
        own = {c: _fit_linear(rs) for c, rs in by_cls.items() if _enough(rs)}
        return cls(own, default)

    def predict(self, cls: str, nbytes: float, flops: float) -> float:
        """Predicted time (seconds, > 0) of an op of class ``cls``."""
        return self.classes.get(cls, self.default).predict(nbytes, flops)


# --------------------------------------------------------------------------- stored profiles


@dataclasses.dataclass(frozen=True)
class OpEstimate:
    """A time for one op.

    Attributes:
        time_s: seconds (> 0).
        estimated: False if measured for this key, True if from the fallback model.
        source: ``"measured"`` or ``"model:<class>"``.
    """

    time_s: float
    estimated: bool
    source: str


@dataclasses.dataclass
class OpRecord:
    """Measured time of one op key.

    Attributes:
        key: the op key.
        time_s: seconds of one execution, median over the instructions with this key.
        cls: opcode class.
        bytes: operand + result bytes.
        flops: estimated flops.
        count: instructions that contributed.
    """

    key: OpKey
    time_s: float
    cls: str
    bytes: int
    flops: float
    count: int = 1


@dataclasses.dataclass
class OpProfile:
    """Measured per-op times of a program on one backend, storable as JSON.

    Attributes:
        backend: ``jax.default_backend()`` when measured.
        device_kind: ``device_kind`` of the first device.
        jax_version: jax version when measured.
        program_hash: sha256 prefix of the compiled HLO text.
        module: compiled module name.
        created: ISO timestamp.
        records: ``OpKey.encode()`` -> measured record (time of one execution).
        instructions: compiled instruction -> ``{"key", "time_s", "count",
            "per_device_s", "op_names"}``; ``time_s`` and ``per_device_s`` are totals per
            iteration (``count`` executions).
        iteration_times_s: host wall time per profiled iteration.
        trace_iteration_s: per iteration, first instruction start to last end.
    """

    backend: str
    device_kind: str
    jax_version: str
    program_hash: str
    module: str
    created: str
    records: dict[str, OpRecord]
    instructions: dict[str, dict[str, Any]]
    iteration_times_s: list[float]
    trace_iteration_s: list[float]
    _model: OpCostModel | None = dataclasses.field(default=None, repr=False, compare=False)

    def cost_model(self) -> OpCostModel:
        """The fallback model fitted on this profile's records (cached)."""
        if self._model is None:
            self._model = OpCostModel.fit(
                (r.cls, r.bytes, r.flops, r.time_s) for r in self.records.values())
        return self._model

    def estimate(self, info: OpInfo) -> OpEstimate:
        """Measured time of ``info.key`` if profiled, else the fallback model's (flagged)."""
        rec = self.records.get(info.key.encode())
        if rec is not None and rec.time_s > 0:
            return OpEstimate(rec.time_s, False, "measured")
        t = self.cost_model().predict(info.cls, info.bytes, info.flops)
        return OpEstimate(t, True, f"model:{info.cls}")

    def merge(self, other: OpProfile) -> None:
        """Adds the other profile's records for keys this one has not measured."""
        for k, rec in other.records.items():
            self.records.setdefault(k, rec)
        self._model = None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (schema :data:`PROFILE_SCHEMA`)."""
        recs = {k: {"time_s": r.time_s, "class": r.cls, "bytes": r.bytes, "flops": r.flops,
                    "count": r.count} for k, r in sorted(self.records.items())}
        return {"schema": PROFILE_SCHEMA, "backend": self.backend,
                "device_kind": self.device_kind, "jax_version": self.jax_version,
                "program_hash": self.program_hash, "module": self.module,
                "created": self.created, "iteration_times_s": self.iteration_times_s,
                "trace_iteration_s": self.trace_iteration_s, "op_times": recs,
                "instructions": self.instructions}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OpProfile:
        """Inverse of :meth:`to_json`."""
        if data.get("schema") != PROFILE_SCHEMA:
            raise ValueError(f"unsupported profile schema {data.get('schema')!r}")
        recs = {k: OpRecord(OpKey.decode(k), float(v["time_s"]), v["class"], int(v["bytes"]),
                            float(v["flops"]), int(v.get("count", 1)))
                for k, v in data["op_times"].items()}
        return cls(data["backend"], data["device_kind"], data["jax_version"],
                   data["program_hash"], data["module"], data["created"], recs,
                   dict(data["instructions"]), list(data["iteration_times_s"]),
                   list(data["trace_iteration_s"]))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the profile as JSON atomically (temporary file + ``os.replace``)."""
        write_atomic(path, json.dumps(self.to_json(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> OpProfile:
        """Reads a profile written by :meth:`save`."""
        with open(path) as f:
            return cls.from_json(json.load(f))


def _records(times: Mapping[str, float], counts: Mapping[str, float],
             infos: Mapping[str, OpInfo]) -> dict[str, OpRecord]:
    """Time of one execution per op key (median over instructions with the same key)."""
    grouped: dict[str, list[tuple[OpInfo, float]]] = defaultdict(list)
    for name, t in times.items():
        if name in infos and t > 0:
            one = t / max(counts.get(name, 1.0), 1.0)
            grouped[infos[name].key.encode()].append((infos[name], one))
    out = {}
    for k, items in grouped.items():
        info = items[0][0]
        med = statistics.median(t for _, t in items)
        out[k] = OpRecord(info.key, med, info.cls, info.bytes, info.flops, len(items))
    return out


def build_op_profile(prof: ProgramProfile) -> OpProfile:
    """Keys a :class:`ProgramProfile`'s instruction times by op (needs ``hlo_tools``)."""
    import jax

    import hlo_tools

    infos = analyze_module(hlo_tools.parse(prof.hlo_text))
    instrs = {}
    for name, t in prof.times_s.items():
        info = infos.get(name)
        instrs[name] = {
            "key": info.key.encode() if info else None, "time_s": t,
            "count": prof.counts.get(name, 1.0),
            "per_device_s": {str(d): v[name] for d, v in prof.per_device_s.items() if name in v},
            "op_names": list(info.op_names) if info else [],
        }
    return OpProfile(
        backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind,
        jax_version=jax.__version__,
        program_hash=hashlib.sha256(prof.hlo_text.encode()).hexdigest()[:16],
        module=prof.module, created=datetime.datetime.now().isoformat(timespec="seconds"),
        records=_records(prof.times_s, prof.counts, infos), instructions=instrs,
        iteration_times_s=prof.wall_times_s, trace_iteration_s=prof.trace_iteration_s)


def profile_ops(fn: Any, *args: Any, iterations: int = 10, warmup: int = 3,
                donated: bool = False) -> OpProfile:
    """Profiles a program and returns its times keyed by op (see :func:`profile_program`)."""
    prof = profile_program(fn, *args, iterations=iterations, warmup=warmup, donated=donated)
    return build_op_profile(prof)


# --------------------------------------------------------------------------- op times


class OpTimes:
    """Single-op times by :class:`~disco_estimator.ops.keys.OpKey`, with the analytic fallback.

    Sources are added in priority order: the first time stored for a key wins. Times of
    multi-op fusions are never stored (a fusion is always predicted from its members);
    a profiled single-op fusion (XLA:CPU's ``wrapped_<op>``) counts as its op.
    """

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.sources: dict[str, str] = {}
        self._rows: list[tuple[str, float, float, float]] = []
        self._wrapped: dict[str, float] = {}
        self._fallback: OpCostModel | None = None

    def add(self, key: str, time_s: float, source: str, cls: str = "other",
            nbytes: float = 0.0, flops: float = 0.0) -> bool:
        """Stores a measured time unless the key has one; returns whether it was stored."""
        if key in self.times or not math.isfinite(time_s) or time_s < 0:
            return False
        self.times[key] = float(time_s)
        self.sources[key] = source
        if time_s > 0:
            self._rows.append((cls, float(nbytes), float(flops), float(time_s)))
        self._fallback = None
        return True

    def add_timings(self, timings: Mapping[str, OpTiming],
                    source: str = "op_bench") -> int:
        """Adds standalone timings (failed ones are skipped); returns how many were new."""
        return sum(self.add(k, t.time_s, source, t.cls, t.bytes, t.flops)
                   for k, t in timings.items() if t.ok)

    def add_op_profile(self, profile: OpProfile, source: str = "profile") -> int:
        """Adds the records of a stored profile (``disco profile`` / ``OpProfile.save``).

        Plain ops are stored by key; single-op fusions are matched later, when an op is
        looked up, by the key its XLA:CPU wrapper fusion would have (multi-op fusions
        can never match: their bodies differ from every wrapper's).
        """
        added = 0
        for key, rec in profile.records.items():
            if not rec.key.opcode.startswith("fusion"):
                added += self.add(key, rec.time_s, source, rec.cls, rec.bytes, rec.flops)
            elif key not in self._wrapped and rec.time_s > 0:
                self._wrapped[key] = rec.time_s
                self._rows.append((rec.cls, float(rec.bytes), float(rec.flops), rec.time_s))
                added += 1
        self._fallback = None
        return added

    def add_program_profile(self, profile: ProgramProfile,
                            original: HloModule | None = None, source: str = "profile") -> int:
        """Adds the per-execution times of a whole-program profile, each keyed by the
        single op it ran (multi-op fusions are skipped); a key's time is the mean over
        its ops.

        Args:
            profile: a profile of a program compiled without fusion (``exact=True``).
            original: the module that program was compiled from. Its instructions are
                found through the ``op_name`` XLA records (see
                :func:`~disco_estimator.ops.keys.map_to_original`), so ops XLA reshaped while
                compiling (a 3-D dot run as a 2-D one, a transpose run as a copy) still
                get their in-context time, keyed as in ``original``. Without it, or for
                ops not found, the compiled op's own key is used.

        Returns:
            How many keys got a time.
        """
        import hlo_tools

        compiled = hlo_tools.parse(profile.hlo_text)
        view = module_view(compiled)
        by_key: dict[str, list[float]] = {}
        infos: dict[str, OpInfo] = {}
        # an op the program ran on the kernel library: its time as the library runs it,
        # and, unless the program also ran it on XLA's emitter, as the op's own time --
        # a plan compiled like this program (library dots) runs it the same way
        on_library: dict[str, list[float]] = {}
        for key_info, one, library in _map_single_ops(profile, view, original):
            if library:
                on_library.setdefault(key_info.key.encode(), []).append(one)
                infos.setdefault(key_info.key.encode(), key_info)
                key_info = library_info(key_info)
            by_key.setdefault(key_info.key.encode(), []).append(one)
            infos.setdefault(key_info.key.encode(), key_info)
        for name, total in profile.times_s.items():
            instr = view.instr.get(name)
            inner = _single_op(compiled, instr) if instr is not None else None
            if inner is None or op_status(inner)[0] != "bench":
                continue
            info = describe_instruction(view, inner)
            if is_library_fusion(instr):
                info = library_info(info)
            one = total / max(profile.counts.get(name, 1.0), 1.0)
            by_key.setdefault(info.key.encode(), []).append(one)
            infos.setdefault(info.key.encode(), info)
        # the mean over the ops of one key (each already a median over iterations), so
        # that they cost in sum what the trace measured: their times are skewed by their
        # context (what ran before, what the caches hold), and a median is below it
        added = 0
        for key, times in [*by_key.items(), *on_library.items()]:
            info = infos[key]
            added += self.add(key, float(np.mean(times)), source, info.cls, info.bytes,
                              info.flops)
        return added

    def fallback_model(self) -> OpCostModel:
        """The analytic model fitted on every measured time (cached)."""
        if self._fallback is None:
            self._fallback = OpCostModel.fit(self._rows)
        return self._fallback

    def estimate(self, view: Any, instr: HloInstruction, library: bool = False
                 ) -> OpEstimate:
        """The time of one op: measured if any source has its key, else the fallback.

        ``library``: the op runs inside a library fusion of XLA's plan; its time as the
        library runs it (:func:`~disco_estimator.ops.keys.library_key`) is used when known,
        else the op's own time, as if it ran unwrapped.
        """
        info = describe_instruction(view, instr)
        if library:
            key = library_key(info.key).encode()
            if key in self.times:
                return OpEstimate(self.times[key], False, self.sources[key])
        key = info.key.encode()
        t = self.times.get(key)
        if t is not None:
            return OpEstimate(t, False, self.sources[key])
        if self._wrapped:
            t = self._wrapped.get(_wrapped_key(view, instr))
            if t is not None:
                return OpEstimate(t, False, "profile")
        return OpEstimate(self.fallback_model().predict(info.cls, info.bytes, info.flops),
                             True, f"model:{info.cls}")

    def __len__(self) -> int:
        return len(self.times)


def _map_single_ops(profile: ProgramProfile, compiled: Any, original: HloModule | None
                    ) -> list[tuple[OpInfo, float, bool]]:
    """``(info of the original op, seconds per execution, whether it ran on the kernel
    library)`` for every instance of an op of ``original`` that ran as single-op
    kernels.

    An instance is one ``op_name`` path: a computation called from several call sites is
    inlined once per site, and each copy of its op (``"jit_norm_.168/reduce_sum.5"``,
    ``"jit_norm_.170/reduce_sum.5"``) is one execution of ``reduce_sum.5``; the kernels of
    one instance (e.g. the ``reduce-window`` and ``reduce`` of a tree reduction) are
    summed. (Summing every instance instead priced an optimizer's norm, called once per
    parameter, at 36 times its cost, and pushed the fitted compute scale down.)

    Args:
        profile: the profile.
        compiled: :func:`~disco_estimator.ops.keys.module_view` of the compiled module.
        original: the module that was compiled (None: nothing is mapped).
    """
    if original is None:
        return []
    view = module_view(original)
    users: dict[str, list[str]] = {}
    for _, instr in compiled.module.instructions():
        for o in instr.operands:
            users.setdefault(o, []).append(instr.name)
    totals: dict[str, float] = {}
    library: set[str] = set()
    for name, total in profile.times_s.items():
        path = _original_path(compiled, users, name, lambda p: _target(p) in view.instr)
        if path is None:
            continue
        folded = _folded_producer(view, path, _single_op(compiled.module,
                                                         compiled.instr[name]))
        if folded is not None:
            totals.setdefault(path, 0.0)  # it ran inside its producer's kernel
            path = folded
        one = total / max(profile.counts.get(name, 1.0), 1.0)
        totals[path] = totals.get(path, 0.0) + one
        if is_library_fusion(compiled.instr[name]):
            library.add(path)
    out = []
    for path, one in totals.items():
        instr = view.instr[_target(path)]
        if op_status(instr)[0] == "bench":
            out.append((describe_instruction(view, instr), one, path in library))
    return out


def _target(path: str) -> str:
    """The original instruction's name in an ``op_name`` path (its last component)."""
    return path.rsplit("/", 1)[-1]


def _folded_producer(view: Any, path: str, kernel: HloInstruction) -> str | None:
    """The instance of the producer an op was folded into, when the kernel that carries
    the op's ``op_name`` runs its operand's opcode instead: XLA's simplifier rewrites
    ``transpose(dot(a, b))`` as one dot with the transpose's metadata, so that kernel's
    time is the dot's and the transpose took none. None: the kernel runs the op itself
    (or something else: a divide run as a multiply by the reciprocal)."""
    op = view.instr[_target(path)]
    if kernel.opcode == op.opcode:
        return None
    found = [o for o in dict.fromkeys(op.operands)
             if o in view.instr and view.instr[o].opcode == kernel.opcode]
    if len(found) != 1:
        return None
    return path[:path.rfind("/") + 1] + found[0]  # same call sites, the producer


def _original_path(compiled: Any, users: Mapping[str, list[str]], name: str,
                   known: Callable[[str], bool]) -> str | None:
    """The ``op_name`` of the original op instance a compiled single-op kernel came from:
    the original instruction's name prefixed by the call sites it was inlined through
    (``known`` says which paths name an op of the original module).

    A kernel without ``op_name`` that XLA split off an op belongs to that op: the op of
    its only user chain (the ``reduce-window`` of a tree reduction), else the nearest op
    downstream through any users (XLA:CPU expands ``select-and-scatter`` into iotas and
    a variadic ``reduce-window`` without ``op_name``, which reach the ``scatter`` that
    carries the op's through several tuple elements). A kernel left unmapped is time
    the original program's ops lack, which the fitted compute scale would spread over
    every op and then charge again in a program that runs that kernel itself."""
    chain = name
    for _ in range(_CHAIN):
        inner = _kernel_op(compiled, chain)
        if inner is None:
            return None
        if inner.op_name:
            return inner.op_name if known(inner.op_name) else None
        if len(users.get(chain, ())) != 1:
            break
        chain = users[chain][0]
    seen, frontier = {name}, [name]
    for _ in range(_CHAIN):  # breadth first: the nearest users first
        ahead = []
        for user in (u for n in frontier for u in users.get(n, ())):
            if user in seen:
                continue
            seen.add(user)
            ahead.append(user)
            inner = _kernel_op(compiled, user)
            if inner is not None and inner.op_name and known(inner.op_name):
                return inner.op_name
        frontier = ahead
    return None


def _kernel_op(compiled: Any, name: str) -> HloInstruction | None:
    """The op the compiled instruction ``name`` runs (:func:`_single_op`; None: no such
    instruction, or not a single op)."""
    instr = compiled.instr.get(name)
    return _single_op(compiled.module, instr) if instr is not None else None


def _single_op(module: HloModule, instr: HloInstruction) -> HloInstruction | None:
    """The op a compiled instruction runs: itself, or the only op of a wrapper fusion."""
    if instr.opcode != "fusion":
        return instr
    comps = [module.computation(c) for c in instr.called_computations]
    body = [i for c in comps for i in c.instructions if i.opcode != "parameter"]
    if len(body) != 1 or body[0].opcode == "fusion":
        return None
    return body[0]


def _wrapped_key(view: Any, instr: HloInstruction) -> str:
    """The key XLA:CPU's ``fusion-wrapper`` gives the single-op fusion around ``instr``.

    The wrapper's computation has one parameter per distinct operand followed by the op;
    the fusion is ``kind=kLoop`` with the distinct operands.
    """
    Instr = HloInstruction
    by_name = view.instr
    distinct = list(dict.fromkeys(instr.operands))
    params = [Instr(f"w.p{k}", "parameter", by_name[o].shape, payload=str(k))
              for k, o in enumerate(distinct)]
    rename = {o: p.name for o, p in zip(distinct, params)}
    op = instr.copy(name="w.op", operands=[rename[o] for o in instr.operands])
    body = HloComputation("w.body", [*params, op], "w.op")
    outer = [Instr(o, "parameter", by_name[o].shape, payload=str(k))
             for k, o in enumerate(distinct)]
    fusion = Instr("w.fusion", "fusion", instr.shape, distinct,
                   {"kind": "kLoop", "calls": "w.body"})
    entry = HloComputation("w.entry", [*outer, fusion], "w.fusion", is_entry=True)
    callees = [view.comps[c] for c in dict.fromkeys(_callees(view.comps, instr))]
    wrapper = HloModule("w", {}, [*callees, body, entry])
    return describe_instruction(wrapper, fusion).key.encode()


def _callees(comps: Mapping[str, HloComputation], instr: HloInstruction) -> Iterable[str]:
    stack = list(instr.called_computations)
    while stack:
        name = stack.pop()
        if name in comps:
            yield name
            stack.extend(n for i in comps[name].instructions for n in i.called_computations)

