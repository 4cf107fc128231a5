"""``disco_jax.jit``: a drop-in for ``jax.jit`` that runs DisCo's program for the step.

::

    import disco_jax

    @disco_jax.jit                      # instead of @jax.jit; same arguments
    def train_step(params, opt_state, batch): ...

    params, opt_state, loss = train_step(params, opt_state, batch)
    print(train_step.last_run_info)     # what ran: searched / stored / fallback

On the first call for each input signature (shapes, dtypes, shardings, pytree structure,
values of static arguments) the wrapper lowers the function, fingerprints its
pre-optimization HLO (:func:`disco_jax.store.source_fingerprint`) and reads the
environment variable ``ENABLE_SEARCH``:

* ``1`` (search phase): profile, search and choose by measurement
  (:func:`disco_jax.pipeline.optimize.optimize_step`; the first call's budget: the
  ``time_budget_s`` argument, else ``$DISCO_TIME_BUDGET``, else none, shared by the phases
  as :mod:`disco_jax.pipeline.budget` says; plans predicted to
  need more memory than ``$DISCO_MEMORY_BUDGET`` or the device has are refused; fused ops
  priced by the estimator ``$DISCO_FUSED_ESTIMATOR`` names,
  :mod:`disco_jax.costs.fused_choice`), store the winner (:mod:`disco_jax.store`; its record
  names the estimator and its checkpoint's sha256) and run it. Mode ``"searched"``.
* ``0`` (enactment phase): load the stored program for this fingerprint and run it as
  stored (:func:`disco_jax.enactment.build`: compiled with ``exact=True`` for a plan,
  staged or not). Mode ``"stored"``.
* unset: use a stored program when one matches, else plain ``jax.jit``.

In a multi-process job (``jax.process_count() > 1``) process 0 alone searches (the
others take part in its measurements) and stores, or alone reads the store; the activator
(:mod:`disco_jax.activator`) broadcasts its enactment over the job's collective backend and
every process runs it, or all fall back together with the same reason. A process whose
search fails posts it to the job (:mod:`disco_jax.pipeline.sync`): the others' next
exchange with it raises and they fall back within a second, not at the exchanges' 15-min
timeout (each process warns with its own reason). On CPU, the first
call in each process also moves gloo's event loop to ``SCHED_BATCH``
(:func:`disco_estimator.gloo.quiet_gloo_loops`; ``DISCO_GLOO_LOOP=idle`` or ``asis`` to choose
otherwise): at the default policy the loop preempts the compute it shares a CPU with
and costs every small collective a scheduler slice; ``disco bench``'s gloo setups, which
the cost model is fitted to, run the same way.

Before a stored program is trusted for the first time it is verified: it and
``jax.jit``'s program run once on the first call's arguments (nothing donated) and every
output must agree (:data:`VERIFY_RTOL`, :data:`VERIFY_ATOL`). In a job of several
processes every process runs both and compares its own outputs, and one vote decides for
all (a mismatch anywhere refuses the plan everywhere). The verdict is written into the
entry's record (process 0's store; :func:`disco_jax.store.record_verification`): a match
is not checked again by later loads, a mismatch refuses the plan here and in every later
process.

No stored program (under ``0``), a corrupt record, another jax version, backend, device
kind, CPU or device count, another hardware file, a plan that failed verification, HLO
that no longer parses or compiles, a failed search: a
:class:`DiscoFallbackWarning` (once per reason and program) and plain ``jax.jit``; mode
``"fallback"`` with the ``reason``. Later calls with the same signature go straight to the
compiled program: no lowering, no store read, no recompilation.

What stays ``jax.jit``'s: every keyword argument of ``jax.jit`` is passed to it;
``.lower()``, ``.trace()``, ``.eval_shape()`` and other attributes are the plain
``jax.jit`` object's (they describe jax's own program, not DisCo's); calls under a jax
transformation (tracers: ``jax.grad`` of the wrapper, a wrapper called inside another
jit) run plain ``jax.jit``. ``static_argnums``/``static_argnames`` select the program as
in ``jax.jit`` (each value its own entry). ``donate_argnums``: a donated array is deleted
after the call, as with ``jax.jit``, but a program compiled from stored HLO does not
reuse its memory (the search itself never donates: it runs the candidates on the same
arguments many times). Keyword arguments that are arrays (not static) cannot be enacted: such calls
fall back with a warning that says so.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from disco_jax.costs.fused_choice import FUSED_ESTIMATOR_ENV

__all__ = [
    "BUDGET_ENV",
    "MEMORY_ENV",
    "FALLBACK",
    "FLAG_ENV",
    "SEARCHED",
    "STORED",
    "VERIFY_ATOL",
    "VERIFY_RTOL",
    "DiscoFallbackWarning",
    "DiscoJitted",
    "RunInfo",
    "jit",
]

#: The switch between the search phase (``1``) and the enactment phase (``0``).
FLAG_ENV = "ENABLE_SEARCH"
#: The first call's budget in seconds when ``jit``'s ``time_budget_s`` is not given: what
#: DisCo may add to ``jax.jit``'s first call under ``ENABLE_SEARCH=1``.
BUDGET_ENV = "DISCO_TIME_BUDGET"
#: Memory budget of the search per device (a size, e.g. ``8GiB``; default: the device's).
MEMORY_ENV = "DISCO_MEMORY_BUDGET"
#: Scheduling of gloo's event loop in each process of a multi-process CPU job: ``batch``
#: (default), ``idle`` or ``asis`` (:func:`disco_estimator.gloo.quiet_gloo_loops`).
GLOO_LOOP_ENV = "DISCO_GLOO_LOOP"
#: Modes of :attr:`RunInfo.mode`.
SEARCHED, STORED, FALLBACK = "searched", "stored", "fallback"
#: Tolerances of the verification of a stored plan before it is first trusted.
VERIFY_RTOL, VERIFY_ATOL = 1e-5, 1e-6
#: ...or this many times what XLA's own reordering moves an output (:func:`_compare_outputs`).
REORDER_FACTOR = 2.0


class DiscoFallbackWarning(UserWarning):
    """``disco_jax.jit`` runs plain ``jax.jit`` for a program; the message says why."""


class RunInfo(NamedTuple):
    """What the last call of a :class:`DiscoJitted` ran.

    Attributes:
        mode: ``"searched"`` (found by a search in this process), ``"stored"`` (loaded
            from the store) or ``"fallback"`` (plain ``jax.jit``).
        hlo_fingerprint: of what was compiled: the enactment's
            :attr:`~disco_jax.enactment.Enactment.fingerprint`, or for a fallback the
            sha256 of jax's own HLO text.
        source_fingerprint: the store key (sha256 of the pre-optimization HLO), or None
            when the call was not lowered (under a transformation).
        reason: why it fell back (``""`` otherwise).
        choice: the chosen program's name (``"plan_0"``, ``"bucketed_1MiB"``,
            ``"xla_default"``, ...; ``""`` for a fallback).
        predicted_s: its predicted seconds per iteration (None: unknown).
        measured_s: its measured seconds per iteration in the search (None: unknown).
        store_path: the store entry's directory (None: not stored).
    """

    mode: str
    hlo_fingerprint: str | None
    source_fingerprint: str | None
    reason: str = ""
    choice: str = ""
    predicted_s: float | None = None
    measured_s: float | None = None
    store_path: str | None = None


class _Compiled(NamedTuple):
    """A cache entry: how to call the program of one signature."""

    call: Callable[..., Any]
    dynamic_only: bool  # called with the dynamic positional args (else all args, kwargs)
    info: RunInfo
    donate: tuple[int, ...] = ()  # dynamic args whose buffers are deleted after the call
    # jax's compiled program of this signature, called with the positional arguments
    # alone; it raises TypeError or ValueError for arguments of another signature
    fast: Callable[..., Any] | None = None


#: What a compiled program raises for arguments of another signature (shapes, dtypes,
#: pytree, shardings) or for tracers: the fast path then takes the full lookup.
_SIGNATURE_ERRORS = (TypeError, ValueError)


_Tracer: Any = None  # jax.core.Tracer, set when the first wrapper is made (jax imported)
_WARNED: set[tuple[str, str]] = set()
_WARN_LOCK = threading.Lock()
_LOOP_LOCK = threading.Lock()
_LOOP_DONE = False


def _warn(name: str, reason: str) -> None:
    with _WARN_LOCK:
        if (name, reason) in _WARNED:
            return
        _WARNED.add((name, reason))
    warnings.warn(f"disco_jax.jit({name}): {reason}; running plain jax.jit",
                  DiscoFallbackWarning, stacklevel=4)


def _flag() -> str | None:
    value = os.environ.get(FLAG_ENV)
    if value is None or value.strip() == "":
        return None
    value = value.strip()
    if value not in ("0", "1"):
        raise ValueError(f"{FLAG_ENV}={value!r}: use 1 (search and store), 0 (run the stored "
                         "program) or leave it unset (stored program if any)")
    return value


def _settle_gloo_loop() -> None:
    """Once per process of a multi-process CPU job: gloo's event loop at the policy of
    :data:`GLOO_LOOP_ENV` (the same as every gloo setup of ``disco bench``, whose
    measurements the cost model is fitted to)."""
    global _LOOP_DONE
    from disco_estimator.gloo import DEFAULT_LOOP_POLICY, LOOP_CHOICES, quiet_gloo_loops

    policy = os.environ.get(GLOO_LOOP_ENV, "").strip() or DEFAULT_LOOP_POLICY
    if policy not in LOOP_CHOICES:
        raise ValueError(f"{GLOO_LOOP_ENV}={policy!r}: use one of {', '.join(LOOP_CHOICES)}")
    with _LOOP_LOCK:
        if _LOOP_DONE:
            return
        _LOOP_DONE = True
        import jax

        if policy != "asis" and jax.default_backend() == "cpu":
            quiet_gloo_loops(policy)


def _budget(time_budget_s: float | None) -> float | None:
    from disco_jax.units import env_seconds

    if time_budget_s is not None:
        return float(time_budget_s)
    return env_seconds(BUDGET_ENV)


def _positions(fun: Callable[..., Any], nums: Any, names: Any) -> tuple[frozenset, frozenset]:
    """Static (or donated) positions and names, each completed from the other through
    ``fun``'s signature (as ``jax.jit`` does)."""
    nums = (nums,) if isinstance(nums, int) else tuple(nums or ())
    names = (names,) if isinstance(names, str) else tuple(names or ())
    try:
        params = [p for p in inspect.signature(fun).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    count = len(params)
    pos = {n + count if n < 0 and count else n for n in nums}
    pos |= {i for i, p in enumerate(params) if p.name in names}
    nm = set(names) | {params[i].name for i in pos if 0 <= i < count}
    return frozenset(pos), frozenset(nm)


def _leaf_key(x: Any) -> Any:
    return (type(x), getattr(x, "shape", None), getattr(x, "dtype", None),
            getattr(x, "weak_type", None), getattr(x, "sharding", None))


class DiscoJitted:
    """The wrapper :func:`jit` returns; call it like the ``jax.jit`` of the function.

    Attributes:
        last_run_info: the :class:`RunInfo` of the last call (None before the first).
    """

    def __init__(self, fun: Callable[..., Any], *, time_budget_s: float | None = None,
                 store: str | os.PathLike[str] | None = None, hardware: str | None = None,
                 search_options: Mapping[str, Any] | None = None, **jax_jit_kwargs: Any):
        import jax

        global _Tracer
        _Tracer = jax.core.Tracer
        self._fun = fun
        self._jit_kwargs = dict(jax_jit_kwargs)
        self._plain = jax.jit(fun, **jax_jit_kwargs)
        self._time_budget_s = time_budget_s
        self._store = store
        self._hardware = hardware
        self._search_options = dict(search_options or {})
        self._static_pos, self._static_names = _positions(
            fun, jax_jit_kwargs.get("static_argnums"), jax_jit_kwargs.get("static_argnames"))
        donate_pos, donate_names = _positions(
            fun, jax_jit_kwargs.get("donate_argnums"), jax_jit_kwargs.get("donate_argnames"))
        self._donates = bool(donate_pos or donate_names)
        # positions among the dynamic arguments (static ones cannot be donated)
        self._donate_dyn = tuple(sorted(p - sum(s < p for s in self._static_pos)
                                        for p in donate_pos if p not in self._static_pos))
        self._cache: dict[Any, _Compiled] = {}
        self._hot: _Compiled | None = None  # the last entry called, when it has a fast path
        self._lock = threading.Lock()
        self.last_run_info: RunInfo | None = None
        functools.update_wrapper(self, fun)

    # ----------------------------------------------------------------- jax.jit's surface

    def __getattr__(self, name: str) -> Any:
        """``lower``, ``trace``, ``eval_shape`` ...: the plain ``jax.jit`` object's."""
        if name.startswith("__") or name in ("_plain", "_fun"):
            raise AttributeError(name)
        return getattr(self._plain, name)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(fun).lower(...)``: jax's own lowering (DisCo's program is chosen at
        the first call; ``last_run_info`` says which)."""
        return self._plain.lower(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(fun).trace(...)``."""
        return self._plain.trace(*args, **kwargs)

    def clear_cache(self) -> None:
        """Forgets every compiled program (the next call looks again) and clears
        ``jax.jit``'s cache of the function."""
        with self._lock:
            self._cache.clear()
            self._hot = None
        self._plain.clear_cache()

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """Bound like a function when used as a method decorator."""
        return self if obj is None else functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"<disco_jax.jit of {getattr(self._fun, '__qualname__', self._fun)!r}>"

    # ----------------------------------------------------------------- calls

    def _split(self, args: tuple) -> tuple[tuple, tuple]:
        if not self._static_pos:
            return args, ()
        dyn = tuple(a for i, a in enumerate(args) if i not in self._static_pos)
        static = tuple((i, a) for i, a in enumerate(args) if i in self._static_pos)
        return dyn, static

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hot = self._hot
        if hot is not None and not kwargs:
            # jax's own dispatch of the last signature's program checks the arguments in
            # C++; another signature (or a tracer) raises before anything runs
            try:
                out = hot.fast(*args)
            except _SIGNATURE_ERRORS:
                pass
            else:
                self.last_run_info = hot.info
                if hot.donate:
                    _delete_donated(args, hot.donate)
                return out
        return self._lookup_call(args, kwargs)

    def _lookup_call(self, args: tuple, kwargs: dict) -> Any:
        """A call through the signature cache (the first call of a signature fills it)."""
        import jax

        dyn, static = self._split(args)
        if kwargs:
            static += tuple(sorted((k, v) for k, v in kwargs.items()
                                   if k in self._static_names))
            leaves, tree = jax.tree.flatten((dyn, {k: v for k, v in kwargs.items()
                                                   if k not in self._static_names}))
        else:
            leaves, tree = jax.tree.flatten(dyn)
        for x in leaves:
            if isinstance(x, _Tracer):
                return self._plain(*args, **kwargs)  # under a transformation
        key = (tree, tuple(map(_leaf_key, leaves)), static)
        entry = self._cache.get(key)
        if entry is None:
            with self._lock:
                entry = self._cache.get(key)
                if entry is None:
                    entry = self._first_call(args, kwargs, dyn)
                    self._cache[key] = entry
        self.last_run_info = entry.info
        self._hot = entry if entry.fast is not None else None
        if entry.dynamic_only:
            out = entry.call(*dyn)
            if entry.donate:
                _delete_donated(dyn, entry.donate)
            return out
        return entry.call(*args, **kwargs)

    # ----------------------------------------------------------------- the first call

    def _name(self) -> str:
        return getattr(self._fun, "__qualname__", None) or repr(self._fun)

    def _fallback(self, reason: str, source_fp: str | None, plain_fp: str | None, *,
                  warn: bool = True) -> _Compiled:
        if warn:
            _warn(self._name(), reason)
        return _Compiled(self._plain, False, RunInfo(FALLBACK, plain_fp, source_fp, reason))

    def _first_call(self, args: tuple, kwargs: dict, dyn: tuple) -> _Compiled:
        """The program of a new signature, with its fast path. Whatever fails inside
        DisCo becomes a fallback with the reason; a function that jax cannot lower gets
        plain ``jax.jit``, which raises the same error when called."""
        try:
            lowered = self._plain.lower(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the user's error, raised by the plain call
            return _Compiled(self._plain, False, RunInfo(FALLBACK, None, None,
                                                         "jax.jit cannot lower it"))
        from disco_jax.activator import ActivatorError

        try:
            entry = self._first_call_unguarded(args, kwargs, dyn, lowered)
        except Exception as err:  # noqa: BLE001 - never a traceback out of the user's step
            if isinstance(err, ActivatorError) or (isinstance(err, ValueError) and str(
                    err).startswith((FLAG_ENV, BUDGET_ENV, MEMORY_ENV, GLOO_LOOP_ENV,
                                     FUSED_ESTIMATOR_ENV))):
                raise  # the job is broken (jax.jit would hang), or a setting is malformed
            entry = self._fallback(_failure("DisCo failed on the first call", err), None,
                                   None)
        return self._with_fast_path(entry, lowered, kwargs)

    def _with_fast_path(self, entry: _Compiled, lowered: Any, kwargs: dict) -> _Compiled:
        """``entry`` with its fast path: jax's compiled program of the signature, when the
        call takes the positional arguments alone (no static or keyword arguments)."""
        import jax

        if kwargs or self._static_pos or self._static_names:
            return entry
        if entry.info.mode == FALLBACK:
            try:  # jax.jit's own executable of this signature (cached: no new compile)
                fast = lowered.compile()
            except Exception:  # noqa: BLE001 - the plain call reports it as jax.jit does
                return entry
        else:
            fast = entry.call
        if not isinstance(fast, jax.stages.Compiled):
            return entry  # e.g. a staged program (two streams, Python threads)
        return entry._replace(fast=fast)

    def _first_call_unguarded(self, args: tuple, kwargs: dict, dyn: tuple, lowered: Any
                              ) -> _Compiled:
        from disco_jax import store as st
        from hlo_tools.jax_bridge import lowered_text

        flag = _flag()
        if _process_count() > 1:
            _settle_gloo_loop()
        text = lowered_text(lowered)
        source_fp = st.source_fingerprint(text)
        dynamic_kwargs = sorted(k for k in kwargs if k not in self._static_names)
        if dynamic_kwargs:
            return self._fallback(
                f"keyword arguments {dynamic_kwargs} are arrays; pass them positionally (or "
                "make them static) to use DisCo's program", source_fp, source_fp,
                warn=flag is not None)
        if flag == "1":
            return self._search(args, kwargs, dyn, source_fp)
        if _process_count() > 1:
            return self._stored_in_job(args, kwargs, dyn, source_fp, flag)
        setup = st.Setup.current()
        lookup = st.load_entry(source_fp, setup, root=self._store, check_hardware=True)
        if lookup.entry is None:
            warn = flag == "0" or lookup.reason != st.NOT_FOUND
            reason = lookup.reason
            if reason == st.NOT_FOUND:
                reason = (f"no stored plan for this program (key {source_fp[:12]}) in "
                          f"{st.store_dir(self._store)}; run once with ENABLE_SEARCH=1")
            return self._fallback(reason, source_fp, source_fp, warn=warn)
        try:
            run, dynamic_only = self._build(lookup.entry.enactment, args, kwargs, dyn)
        except Exception as err:  # XLA rejected it, or it does not fit the arguments
            return self._fallback(_failure("the stored plan does not compile here", err),
                                  source_fp, source_fp)
        record = lookup.entry.record
        if st.verification(record) is None:  # first trust: run it next to jax.jit once
            why = self._verify_stored(run, lookup.entry, args, kwargs, dyn)
            if why is not None:
                if hasattr(run, "close"):
                    run.close()
                return self._fallback(why, source_fp, source_fp)
        choice = record.get("choice", lookup.entry.enactment.name)
        return _Compiled(run, dynamic_only, RunInfo(
            STORED, lookup.entry.enactment.fingerprint, source_fp, "", choice,
            (record.get("predicted_s") or {}).get(choice),
            (record.get("measured_s") or {}).get(choice), str(lookup.entry.path)),
            self._donate_dyn)

    def _run_both(self, run: Callable[..., Any], args: tuple, kwargs: dict, dyn: tuple
                  ) -> tuple[bool, float | None, str]:
        """Runs ``run`` and ``jax.jit``'s program once on these arguments (nothing donated:
        both read the same buffers) and compares every output (:func:`_compare_outputs`):
        ``(ok, largest absolute difference, what differed)``. Where values differ beyond
        :data:`VERIFY_RTOL` / :data:`VERIFY_ATOL` (in a job: always, every process alike),
        XLA's own program of the step with nothing fused runs too, and sets how far
        floating-point order alone moves each output. Raises what running raises."""
        import jax

        # waited for before jax.jit's program starts: in a job the two programs' all-reduces
        # then reach every process in the same order
        got = jax.block_until_ready(run(*dyn))
        # jax.jit of the function without donation (the user's may donate)
        want = jax.block_until_ready(self._dynamic_jit(args, kwargs)(*dyn) if self._donates
                                     else self._plain(*args, **kwargs))
        verdict = _compare_outputs(got, want)
        if verdict[0] and jax.process_count() == 1:
            return verdict
        # in a job every process runs the reference (its all-reduces), whatever it found
        from hlo_tools.jax_bridge import CompileOptions, InPlaceOf, compile_module

        reference = compile_module(None, InPlaceOf(self._dynamic_jit(args, kwargs), dyn),
                                   CompileOptions(exact=True))
        return _compare_outputs(got, want, jax.block_until_ready(reference(*dyn)))

    def _record_verdict(self, key: str, record: Mapping[str, Any], ok: bool,
                        worst: float | None, detail: str) -> str | None:
        """Writes a verification verdict into the store; None when it was written, else
        why not, in words."""
        from disco_jax import store as st

        try:
            written = st.record_verification(key, enactment_sha256=record.get(
                "enactment_sha256", ""), ok=ok, max_abs_diff=worst, detail=detail,
                root=self._store)
        except OSError as err:
            return f"not recorded: the store cannot be written ({err})"
        return None if written is not None else "not recorded: the entry was replaced meanwhile"

    def _verify_stored(self, run: Callable[..., Any], entry: Any, args: tuple, kwargs: dict,
                       dyn: tuple) -> str | None:
        """Verifies a stored program never verified before (:meth:`_run_both`) and records
        the verdict in the store (:func:`disco_jax.store.record_verification`). Returns why
        the plan is refused, or None when it matches."""
        try:
            ok, worst, detail = self._run_both(run, args, kwargs, dyn)
        except Exception as err:  # noqa: BLE001 - it cannot run here: not trusted
            return _failure("the stored plan failed when run once to verify it", err)
        where = (self._record_verdict(entry.key, entry.record, ok, worst, detail)
                 or "refused in the store")
        if ok:
            return None
        return (f"verification refused the stored plan: it does not compute what jax.jit "
                f"computes on the first call's arguments ({detail}); {where}; run once "
                "with ENABLE_SEARCH=1 to search again")

    def _verify_in_job(self, run: Callable[..., Any], record: Mapping[str, Any],
                       key: str | None, args: tuple, kwargs: dict, dyn: tuple) -> str | None:
        """The verification of :meth:`_verify_stored` in a multi-process job: every process
        runs the program and ``jax.jit``'s once, in the same order (both run collectives),
        compares its own outputs, and one vote (:func:`disco_jax.activator.unanimous`)
        decides for all; process 0 records the verdict in its store (entry ``key``).
        Returns why the plan is refused (the same on every process), or None."""
        import jax

        from disco_jax.activator import unanimous

        try:
            ok, worst, detail = self._run_both(run, args, kwargs, dyn)
        except Exception as err:  # noqa: BLE001 - it cannot run here: vote no
            ok, worst, detail = False, None, _failure("it failed when run", err, limit=200)
        all_ok, reason = unanimous(ok, "" if ok else detail, step="vote on the verification")
        if jax.process_index() == 0 and key is not None:
            unrecorded = self._record_verdict(key, record, all_ok, worst, reason or detail)
            if unrecorded is not None and not all_ok:
                _warn(self._name(), f"the verification's verdict was {unrecorded}")
        if all_ok:
            return None
        return (f"verification refused the stored plan: it does not compute what jax.jit "
                f"computes on the first call's arguments ({reason}); run once with "
                "ENABLE_SEARCH=1 to search again")

    def _stored_in_job(self, args: tuple, kwargs: dict, dyn: tuple, source_fp: str,
                       flag: str | None) -> _Compiled:
        """The stored program in a multi-process job: process 0 reads the store and the
        activator broadcasts its entry; all run it or all fall back."""
        import jax

        from disco_jax import store as st

        local = record = key = None
        reason, warn, path = "", True, None
        if jax.process_index() == 0:
            lookup = st.load_entry(source_fp, st.Setup.current(), root=self._store,
                                   check_hardware=True)
            if lookup.entry is None:
                warn = flag == "0" or lookup.reason != st.NOT_FOUND
                reason = lookup.reason
                if reason == st.NOT_FOUND:
                    reason = (f"no stored plan for this program (key {source_fp[:12]}) in "
                              f"process 0's store {st.store_dir(self._store)}; run once "
                              "with ENABLE_SEARCH=1")
            else:
                local, record = lookup.entry.enactment, lookup.entry.record
                path, key = str(lookup.entry.path), lookup.entry.key
        return self._agreed(local, record, source_fp, args, kwargs, dyn, mode=STORED,
                            reason=reason, warn=warn, path=path, verify_key=key)

    def _agreed(self, local: Any, record: Mapping[str, Any] | None, source_fp: str,
                args: tuple, kwargs: dict, dyn: tuple, *, mode: str, reason: str = "",
                warn: bool = True, path: str | None = None, prebuilt: Any = None,
                verify_key: str | None = None) -> _Compiled:
        """Runs the activator (:func:`disco_jax.activator.agree_on_enactment`) and turns
        its agreement into a cache entry; ``prebuilt`` is ``(enactment, run)`` this
        process compiled already (used when process 0 sends the same enactment). A stored
        program (``mode`` :data:`STORED`) whose record (process 0's, the same everywhere)
        holds no verdict for its enactment is verified first (:meth:`_verify_in_job`);
        ``verify_key`` is process 0's store entry, where the verdict goes."""
        from disco_jax import store as st
        from disco_jax.activator import agree_on_enactment

        def build(enactment: Any) -> tuple[Callable[..., Any], bool]:
            if prebuilt is not None and prebuilt[0].fingerprint == enactment.fingerprint:
                return prebuilt[1], True
            return self._build(enactment, args, kwargs, dyn)

        agreed = agree_on_enactment(local, record, source_fp, reason=reason, warn=warn,
                                    build=build)
        built = agreed.run[0] if agreed.run is not None else None  # (run, dynamic_only)
        if prebuilt is not None and built is not prebuilt[1] \
                and hasattr(prebuilt[1], "close"):
            prebuilt[1].close()
        if agreed.run is None:
            return self._fallback(agreed.reason, source_fp, source_fp, warn=agreed.warn)
        run, dynamic_only = agreed.run
        rec = agreed.record
        if mode == STORED and st.verification(rec) is None:
            why = self._verify_in_job(run, rec, verify_key, args, kwargs, dyn)
            if why is not None:
                if hasattr(run, "close"):
                    run.close()
                return self._fallback(why, source_fp, source_fp)
        choice = rec.get("choice", agreed.enactment.name)
        return _Compiled(run, dynamic_only, RunInfo(
            mode, agreed.enactment.fingerprint, source_fp, "", choice,
            (rec.get("predicted_s") or {}).get(choice),
            (rec.get("measured_s") or {}).get(choice), path), self._donate_dyn)

    def _dynamic_jit(self, args: tuple, kwargs: dict) -> Any:
        """``jax.jit`` of the function of the dynamic positional arguments alone (static
        ones bound, nothing donated): what the search runs and staged programs split."""
        import jax

        static = {i: a for i, a in enumerate(args) if i in self._static_pos}
        total = len(args)
        fun = self._fun

        @functools.wraps(fun)
        def dynamic_step(*dyn: Any) -> Any:
            it = iter(dyn)
            full = [static[i] if i in static else next(it) for i in range(total)]
            return fun(*full, **kwargs)

        drop = ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")
        return jax.jit(dynamic_step, **{k: v for k, v in self._jit_kwargs.items()
                                        if k not in drop})

    def _build(self, enactment: Any, args: tuple, kwargs: dict, dyn: tuple
               ) -> tuple[Callable[..., Any], bool]:
        """Compiles a stored or searched enactment for these arguments; returns the
        callable and whether it takes the dynamic positional arguments alone."""
        import jax

        from disco_jax.enactment import STAGED, build
        from hlo_tools.jax_bridge import fresh_function

        if enactment.kind == STAGED:
            return build(enactment, self._dynamic_jit(args, kwargs), dyn), True
        # a separate jax.jit object: jax's caches of the user's function stay untouched
        own = jax.jit(fresh_function(self._fun), **self._jit_kwargs)
        run = build(enactment, own, args, kwargs=kwargs)
        return getattr(run, "compiled", run), True

    def _search(self, args: tuple, kwargs: dict, dyn: tuple, source_fp: str) -> _Compiled:
        import jax

        from disco_jax import store as st
        from disco_jax.pipeline.optimize import optimize_step
        from disco_jax.pipeline.sync import job_sync
        from disco_jax.progress import FirstCallProgress
        from disco_jax.units import env_bytes

        sync = None
        try:
            budget = _budget(self._time_budget_s)
            memory = env_bytes(MEMORY_ENV)
            sync = job_sync(f"disco_jit_{source_fp[:16]}") if jax.process_count() > 1 \
                else None
            # staged enactment pays where the all-reduces cross processes (gloo, NCCL)
            options = {"staged": ("auto",) if jax.process_count() > 1 else (),
                       **self._search_options}
            with FirstCallProgress(budget, enabled=jax.process_index() == 0) as progress:
                opt = optimize_step(self._dynamic_jit(args, kwargs), dyn,
                                    time_budget_s=budget, hardware=self._hardware, sync=sync,
                                    memory_budget_bytes=memory, progress=progress,
                                    **options)
            if sync is not None:  # a process that failed after the last exchange
                sync.gather("searched", True)
        except ValueError as err:
            _post_failure(sync, err)
            if str(err).startswith((BUDGET_ENV, MEMORY_ENV, FUSED_ESTIMATOR_ENV)):
                raise
            return self._fallback(f"DisCo cannot optimize this step: {err}", source_fp,
                                  source_fp)
        except Exception as err:  # noqa: BLE001 - a compile, profile or run failure
            _post_failure(sync, err)
            return self._fallback(_failure("DisCo's search failed", err), source_fp,
                                  source_fp)
        enactment, report = opt.enactment, opt.report
        run = getattr(opt.run, "compiled", opt.run)
        choice = report.choice
        path = record = None
        multi = jax.process_count() > 1
        if jax.process_index() == 0:  # in a job, process 0's record and store count
            setup = st.Setup.current()
            record = st.make_record(
                source_fp, setup, enactment_fingerprint=enactment.fingerprint, choice=choice,
                hardware=report.hardware, hardware_sha256=_hardware_sha256(
                    report.hardware),
                predicted_s=report.predicted_s, measured_s=report.measured_s,
                search=report.search,
                extra={"calibration": report.calibration, "route": report.route,
                       "fused_estimator": report.fused_estimator,
                       "pipeline_s": report.seconds, **_step_source(self._fun)})
            try:
                path = str(st.write_entry(source_fp, record, enactment, root=self._store))
            except OSError as err:
                _warn(self._name(), f"the plan could not be stored ({err})")
        if multi:  # every process runs process 0's choice, or all fall back
            return self._agreed(enactment, record, source_fp, args, kwargs, dyn,
                                mode=SEARCHED, path=path, prebuilt=(enactment, run))
        return _Compiled(run, True, RunInfo(
            SEARCHED, enactment.fingerprint, source_fp, "", choice,
            report.predicted_s.get(choice), report.measured_s.get(choice), path),
            self._donate_dyn)


def _step_source(fun: Callable[..., Any]) -> dict[str, str | None]:
    """What the store says of a step: ``function`` (its qualified name, with its module)
    and ``source`` (``file:line`` of its definition, None when Python cannot tell)."""
    import inspect

    inner = inspect.unwrap(fun) if callable(fun) else fun
    name = getattr(inner, "__qualname__", None) or repr(inner)
    module = getattr(inner, "__module__", None)
    source = None
    try:
        source = f"{inspect.getsourcefile(inner)}:{inspect.getsourcelines(inner)[1]}"
    except (TypeError, OSError):
        pass
    return {"function": f"{module}.{name}" if module else name, "source": source}


def _post_failure(sync: Any, err: BaseException) -> None:
    """In a job, tells the other processes that this one's search failed (their next wait
    raises, and they fall back at once instead of waiting out the job's timeout); not
    for a failure another process posted (``JobFailed``: they know)."""
    from hlo_tools.jax_bridge.sync import JobFailed

    if sync is not None and not isinstance(err, JobFailed):
        sync.fail(_failure("its search failed", err, limit=200))


def _failure(what: str, err: BaseException, limit: int = 300) -> str:
    """``what`` and the error in one line (its type and first line, at most ``limit``
    characters)."""
    first = (str(err).strip().splitlines() or [""])[0][:limit]
    return f"{what} ({type(err).__name__}: {first})" if first else \
        f"{what} ({type(err).__name__})"


def _process_count() -> int:
    import jax

    return jax.process_count()


def _delete_donated(dyn: tuple, donate: tuple[int, ...]) -> None:
    """Deletes the buffers of donated arguments after a call, as ``jax.jit`` does.

    A program compiled from stored HLO text does not alias its inputs to its outputs
    (:func:`hlo_tools.compile_module` drops jax's buffer donors), so the memory is not
    reused; deleting keeps the contract of ``donate_argnums`` (a donated array cannot be
    used again) the same with and without DisCo.
    """
    import jax

    for i in donate:
        if i < len(dyn):
            for leaf in jax.tree.leaves(dyn[i]):
                if hasattr(leaf, "delete") and not leaf.is_deleted():
                    leaf.delete()


def _hardware_sha256(name: str) -> str | None:
    from disco_jax.store import hardware_sha256

    return hardware_sha256(name)


def _local_values(x: Any) -> Any:
    """What this process holds of an output, as numpy: the whole array when it is
    addressable here, else its local shards stacked in device order (an output sharded
    over the processes of a job, e.g. per-device losses)."""
    import numpy as np

    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    return np.stack([np.asarray(s.data) for s in shards])


def _compare_outputs(got: Any, want: Any, reference: Any = None
                     ) -> tuple[bool, float | None, str]:
    """Whether two output pytrees agree (same structure, shapes and dtypes; values within
    :data:`VERIFY_RTOL` / :data:`VERIFY_ATOL`, NaN where NaN), the largest absolute
    difference (None: not finite), and what differs in words.

    ``reference``: the outputs of another program of the same step that XLA compiled
    with another order of floating-point operations (nothing fused). A value of ``got``
    then also agrees when it is no farther from ``want`` than :data:`REORDER_FACTOR` times
    the reference's largest difference in that output: what reordering alone moves. An
    optimizer step divides by the root of a squared gradient (Adam), so a gradient within
    one rounding of zero can move its parameter by a thousand times the tolerance in
    XLA's own programs of the step (examples/train.py: 31 output values differ between
    jax.jit's program and the one with nothing fused, by up to 4.6e-5)."""
    import jax
    import numpy as np

    g_leaves, g_tree = jax.tree.flatten(got)
    w_leaves, w_tree = jax.tree.flatten(want)
    if g_tree != w_tree:
        return False, None, f"its outputs are {g_tree}, jax.jit's {w_tree}"
    worst, bad = 0.0, []
    for i, (a, b) in enumerate(zip(g_leaves, w_leaves, strict=True)):
        if getattr(a, "shape", None) != getattr(b, "shape", None) or \
                getattr(a, "dtype", None) != getattr(b, "dtype", None):
            return False, None, (f"output {i} is {a.dtype}{list(a.shape)}, jax.jit's "
                                 f"{b.dtype}{list(b.shape)}")
        a, b = _local_values(a), _local_values(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, None, (f"output {i} is {a.dtype}{list(a.shape)}, jax.jit's "
                                 f"{b.dtype}{list(b.shape)}")
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
    within = (f"rtol {VERIFY_RTOL:g}, atol {VERIFY_ATOL:g}" if reference is None else
              f"rtol {VERIFY_RTOL:g}, atol {VERIFY_ATOL:g}, or {REORDER_FACTOR:g} times what "
              "XLA's own reordering moves")
    if bad:
        return False, finite, f"outputs {bad[:8]} differ, largest difference {shown} ({within})"
    return True, finite, f"largest difference {shown} ({within})"


def jit(fun: Callable[..., Any] | None = None, *, time_budget_s: float | None = None,
        store: str | os.PathLike[str] | None = None, hardware: str | None = None,
        search_options: Mapping[str, Any] | None = None, **jax_jit_kwargs: Any) -> Any:
    """A drop-in for ``jax.jit`` that runs DisCo's program for the step (module docstring).

    Args:
        fun: the function (a data-parallel ``shard_map`` train step gains; anything else
            runs as ``jax.jit``). Without it, returns a decorator.
        time_budget_s: what the first call under ``ENABLE_SEARCH=1`` may add to
            ``jax.jit``'s, seconds: profile, search, candidates and final choice share it
            (:mod:`disco_jax.pipeline.budget`; default: ``$DISCO_TIME_BUDGET``, else no
            limit, the search stopping at ``configs/search.toml``'s).
        store: the strategy store's directory (default: ``$DISCO_STORE``, else the user
            cache directory; :func:`disco_jax.store.store_dir`).
        hardware: hardware file of the search's cost model (default: the shipped file of
            the backend, :func:`disco_jax.pipeline.fit.default_hardware`: on CPU ``inproc4``
            for one process, ``gloo2`` for several; fitted in context either way).
        search_options: more keyword arguments of
            :func:`disco_jax.pipeline.optimize.optimize_step` (``top_k``, ``choice_rounds``,
            ``staged``, ``bucket_thresholds``, ``profile_rounds`` ...).
        **jax_jit_kwargs: passed to ``jax.jit`` (``static_argnums``, ``donate_argnums``,
            ``in_shardings`` ...).

    Returns:
        A :class:`DiscoJitted`.

    Raises:
        TypeError: an argument ``jax.jit`` does not take (raised by ``jax.jit``).
    """
    if fun is None:
        return functools.partial(jit, time_budget_s=time_budget_s, store=store,
                                 hardware=hardware, search_options=search_options,
                                 **jax_jit_kwargs)
    if isinstance(search_options, Sequence) or (
            search_options is not None and not isinstance(search_options, Mapping)):
        raise TypeError("search_options must be a mapping of optimize_step's arguments")
    return DiscoJitted(fun, time_budget_s=time_budget_s, store=store, hardware=hardware,
                       search_options=search_options, **jax_jit_kwargs)
