"""The first call of an input signature: which program runs it, decided on one path.

:func:`decide` reads ``ENABLE_SEARCH`` (:data:`FLAG_ENV`) and proposes a program on
process 0 — the search's winner (``1``: :func:`disco_jax.pipeline.optimize.optimize_step`,
stored with :func:`disco_jax.store.write_entry`) or the stored one (``0`` or unset:
:func:`disco_jax.store.load_entry`) — and the activator
(:func:`disco_jax.activator.agree_on_enactment`) makes every process of the job build it
or all fall back together. A job of one process takes the same path: its broadcast and
its vote pass its own values through. A stored program never verified before then runs
once next to ``jax.jit``'s (:func:`disco_jax.verify.run_both`), one vote decides for all
processes, and process 0 records the verdict in its store.

Whatever fails inside DisCo becomes a fallback: a :class:`DiscoFallbackWarning` (once per
reason and step) and plain ``jax.jit``. Two things are raised instead: an
:class:`~disco_jax.activator.ActivatorError` (a process of the job did not come: running
``jax.jit`` would hang in its first collective) and a malformed setting (``ValueError``
naming the variable).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from disco_estimator.costs.fused_choice import FUSED_ESTIMATOR_ENV

__all__ = [
    "BUDGET_ENV",
    "FALLBACK",
    "FLAG_ENV",
    "GLOO_LOOP_ENV",
    "MEMORY_ENV",
    "SEARCHED",
    "STORED",
    "Call",
    "DiscoFallbackWarning",
    "RunInfo",
    "Step",
    "decide",
    "fallback",
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

_SETTINGS = (FLAG_ENV, BUDGET_ENV, MEMORY_ENV, GLOO_LOOP_ENV, FUSED_ESTIMATOR_ENV)
_WARNED: set[tuple[str, str]] = set()
_WARN_LOCK = threading.Lock()
_LOOP_LOCK = threading.Lock()
_LOOP_DONE = False


class DiscoFallbackWarning(UserWarning):
    """``disco_jax.jit`` runs plain ``jax.jit`` for a program; the message says why."""


class RunInfo(NamedTuple):
    """What the last call of a :class:`~disco_jax.jit.DiscoJitted` ran.

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


class Call(NamedTuple):
    """How to call the program of one signature (an entry of the wrapper's cache).

    Attributes:
        call: the program.
        dynamic_only: it takes the dynamic positional arguments alone (else all
            arguments, keywords too: plain ``jax.jit``).
        info: what it is.
        donate: dynamic arguments whose buffers are deleted after the call.
        fast: jax's compiled program of this signature, called with the positional
            arguments alone; it raises ``TypeError`` or ``ValueError`` for arguments of
            another signature (None: no fast path).
    """

    call: Callable[..., Any]
    dynamic_only: bool
    info: RunInfo
    donate: tuple[int, ...] = ()
    fast: Callable[..., Any] | None = None


class Step(NamedTuple):
    """The wrapped step as the first call needs it.

    Attributes:
        fun: the user's function.
        plain: ``jax.jit(fun, **jit_kwargs)``.
        jit_kwargs: the keyword arguments of ``jax.jit``.
        static_pos: positions of static arguments.
        static_names: names of static arguments.
        donate_dyn: donated positions among the dynamic arguments.
        time_budget_s: the first call's budget (None: :data:`BUDGET_ENV`, else none).
        store: the store's directory (None: :func:`disco_jax.store.store_dir`'s).
        hardware: the search's hardware file (None: the backend's default).
        search_options: more keyword arguments of ``optimize_step``.
    """

    fun: Callable[..., Any]
    plain: Any
    jit_kwargs: Mapping[str, Any]
    static_pos: frozenset
    static_names: frozenset
    donate_dyn: tuple[int, ...]
    time_budget_s: float | None
    store: Any
    hardware: str | None
    search_options: Mapping[str, Any]

    @property
    def name(self) -> str:
        return getattr(self.fun, "__qualname__", None) or repr(self.fun)

    def dynamic_jit(self, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        """``jax.jit`` of the function of the dynamic positional arguments alone (static
        ones bound, nothing donated): what the search runs and staged programs split."""
        import jax

        static = {i: a for i, a in enumerate(args) if i in self.static_pos}
        total, fun = len(args), self.fun

        @functools.wraps(fun)
        def dynamic_step(*dyn: Any) -> Any:
            it = iter(dyn)
            return fun(*[static[i] if i in static else next(it) for i in range(total)],
                       **kwargs)

        drop = ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")
        return jax.jit(dynamic_step, **{k: v for k, v in self.jit_kwargs.items()
                                        if k not in drop})

    def build(self, enactment: Any, args: tuple, kwargs: Mapping[str, Any], dyn: tuple
              ) -> Callable[..., Any]:
        """Compiles an enactment for these arguments: a program of the dynamic positional
        arguments (:func:`disco_jax.enactment.build`)."""
        import jax

        from disco_jax import enactment as en
        from hlo_tools.jax_bridge import fresh_function

        if enactment.kind == en.STAGED:
            return en.build(enactment, self.dynamic_jit(args, kwargs), dyn)
        # a separate jax.jit object: jax's caches of the user's function stay untouched
        own = jax.jit(fresh_function(self.fun), **self.jit_kwargs)
        run = en.build(enactment, own, args, kwargs=kwargs)
        return getattr(run, "compiled", run)


class _Proposal(NamedTuple):
    """What process 0 proposes to run (its values count; the others' are ignored)."""

    mode: str  # SEARCHED or STORED
    enactment: Any = None  # None: nothing to run, ``reason`` says why
    record: Any = None  # its disco_jax.store.Record
    reason: str = ""
    warn: bool = True
    path: str | None = None  # the store entry
    key: str | None = None  # where a verification's verdict goes
    prebuilt: tuple[Any, Callable[..., Any]] | None = None  # (enactment, run) compiled here


def warn(name: str, reason: str) -> None:
    """One :class:`DiscoFallbackWarning` per step and reason."""
    with _WARN_LOCK:
        if (name, reason) in _WARNED:
            return
        _WARNED.add((name, reason))
    warnings.warn(f"disco_jax.jit({name}): {reason}; running plain jax.jit",
                  DiscoFallbackWarning, stacklevel=5)


def failure(what: str, err: BaseException, limit: int = 300) -> str:
    """``what`` and the error in one line (its type and first line, at most ``limit``
    characters)."""
    first = (str(err).strip().splitlines() or [""])[0][:limit]
    return f"{what} ({type(err).__name__}: {first})" if first else \
        f"{what} ({type(err).__name__})"


def fallback(step: Step, reason: str, source_fp: str | None, *, warn_user: bool = True
             ) -> Call:
    """Plain ``jax.jit`` for this signature, with the reason."""
    if warn_user:
        warn(step.name, reason)
    return Call(step.plain, False, RunInfo(FALLBACK, source_fp, source_fp, reason))


def _flag() -> str | None:
    value = (os.environ.get(FLAG_ENV) or "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{FLAG_ENV}={value!r}: use 1 (search and store), 0 (run the stored "
                         "program) or leave it unset (stored program if any)")
    return value or None


def _settle_gloo_loop() -> None:
    """Once per process of a multi-process CPU job: gloo's event loop at the policy of
    :data:`GLOO_LOOP_ENV` (the same as every gloo setup of ``disco bench``, whose
    measurements the cost model is fitted to)."""
    global _LOOP_DONE
    import jax

    from disco_estimator.gloo import DEFAULT_LOOP_POLICY, LOOP_CHOICES, quiet_gloo_loops

    policy = os.environ.get(GLOO_LOOP_ENV, "").strip() or DEFAULT_LOOP_POLICY
    if policy not in LOOP_CHOICES:
        raise ValueError(f"{GLOO_LOOP_ENV}={policy!r}: use one of {', '.join(LOOP_CHOICES)}")
    with _LOOP_LOCK:
        if not _LOOP_DONE and policy != "asis" and jax.default_backend() == "cpu":
            quiet_gloo_loops(policy)
        _LOOP_DONE = True


def decide(step: Step, args: tuple, kwargs: Mapping[str, Any], dyn: tuple, lowered: Any
           ) -> Call:
    """The program of a new signature (without its fast path).

    Args:
        step: the wrapped step.
        args: the call's positional arguments.
        kwargs: its keyword arguments.
        dyn: its dynamic positional arguments.
        lowered: ``step.plain.lower(*args, **kwargs)``.

    Raises:
        ActivatorError: a process of the job did not reach the activator.
        ValueError: a malformed setting (the message names the variable).
    """
    from disco_jax.activator import ActivatorError

    try:
        return _decide(step, args, kwargs, dyn, lowered)
    except Exception as err:  # noqa: BLE001 - never a traceback out of the user's step
        if isinstance(err, ActivatorError) or (
                isinstance(err, ValueError) and str(err).startswith(_SETTINGS)):
            raise
        return fallback(step, failure("DisCo failed on the first call", err), None)


def _decide(step: Step, args: tuple, kwargs: Mapping[str, Any], dyn: tuple, lowered: Any
            ) -> Call:
    import jax

    from disco_jax import store as st
    from hlo_tools.jax_bridge import lowered_text

    flag = _flag()
    if jax.process_count() > 1:
        _settle_gloo_loop()
    source_fp = st.source_fingerprint(lowered_text(lowered))
    dynamic_kwargs = sorted(k for k in kwargs if k not in step.static_names)
    if dynamic_kwargs:
        return fallback(step, f"keyword arguments {dynamic_kwargs} are arrays; pass them "
                        "positionally (or make them static) to use DisCo's program",
                        source_fp, warn_user=flag is not None)
    if flag == "1":
        proposal = _search(step, args, kwargs, dyn, source_fp)
        if isinstance(proposal, Call):  # the search failed in this process
            return proposal
    else:
        proposal = _stored(step, source_fp, flag)
    return _enact(step, proposal, source_fp, args, kwargs, dyn)


def _search(step: Step, args: tuple, kwargs: Mapping[str, Any], dyn: tuple, source_fp: str
            ) -> _Proposal | Call:
    """Searches (every process of the job takes part), stores the winner on process 0
    and proposes it; a failure is a fallback here and posted to the job
    (:meth:`~disco_jax.pipeline.sync.Sync.fail`), so the others fall back at once."""
    import jax

    from disco_jax import store as st
    from disco_jax.pipeline.optimize import optimize_step
    from disco_jax.pipeline.sync import job_sync
    from disco_jax.progress import FirstCallProgress
    from disco_jax.units import env_bytes, env_seconds
    from hlo_tools.jax_bridge.sync import JobFailed

    sync = None
    try:
        budget = step.time_budget_s if step.time_budget_s is not None else \
            env_seconds(BUDGET_ENV)
        memory = env_bytes(MEMORY_ENV)
        sync = job_sync(f"disco_jit_{source_fp[:16]}")
        # staged enactment pays where the all-reduces cross processes (gloo, NCCL)
        options = {"staged": ("auto",) if jax.process_count() > 1 else (),
                   **step.search_options}
        with FirstCallProgress(budget, enabled=jax.process_index() == 0) as progress:
            opt = optimize_step(step.dynamic_jit(args, kwargs), dyn, time_budget_s=budget,
                                hardware=step.hardware, sync=sync,
                                memory_budget_bytes=memory, progress=progress, **options)
        sync.gather("searched", True)  # a process that failed after the last exchange
    except Exception as err:  # noqa: BLE001 - a compile, profile or run failure
        if sync is not None and not isinstance(err, JobFailed):  # None: job_sync failed
            sync.fail(failure("its search failed", err, limit=200))
        if isinstance(err, ValueError) and str(err).startswith(_SETTINGS):
            raise
        if isinstance(err, ValueError):  # the step is not one DisCo can optimize
            return fallback(step, f"DisCo cannot optimize this step: {err}", source_fp)
        return fallback(step, failure("DisCo's search failed", err), source_fp)
    report, path, record = opt.report, None, None
    if jax.process_index() == 0:  # in a job, process 0's record and store count
        record = st.make_record(
            source_fp, st.Setup.current(), enactment_fingerprint=opt.enactment.fingerprint,
            choice=report.choice, hardware=report.hardware,
            hardware_sha256=st.hardware_sha256(report.hardware),
            predicted_s=report.predicted_s, measured_s=report.measured_s,
            search=report.search,
            extra={"calibration": report.calibration, "route": report.route,
                   "fused_estimator": report.fused_estimator, "pipeline_s": report.seconds,
                   **_step_source(step.fun)})
        try:
            path = str(st.write_entry(source_fp, record, opt.enactment, root=step.store))
        except OSError as err:
            warn(step.name, f"the plan could not be stored ({err})")
    return _Proposal(SEARCHED, opt.enactment, record, path=path,
                     prebuilt=(opt.enactment, getattr(opt.run, "compiled", opt.run)))


def _stored(step: Step, source_fp: str, flag: str | None) -> _Proposal:
    """Process 0's stored program for this step, or why there is none (the others
    propose nothing: process 0's proposal counts)."""
    import jax

    from disco_jax import store as st

    if jax.process_index() != 0:
        return _Proposal(STORED)
    try:
        lookup = st.load_entry(source_fp, st.Setup.current(), root=step.store,
                               check_hardware=True)
    except Exception as err:  # noqa: BLE001 - an unreadable store: every process falls back
        return _Proposal(STORED, reason=failure("the store cannot be read", err))
    if lookup.entry is None:
        reason = lookup.reason
        if reason == st.NOT_FOUND:
            whose = "process 0's store " if jax.process_count() > 1 else ""
            reason = (f"no stored plan for this program (key {source_fp[:12]}) in {whose}"
                      f"{st.store_dir(step.store)}; run once with ENABLE_SEARCH=1")
        return _Proposal(STORED, reason=reason,
                         warn=flag == "0" or lookup.reason != st.NOT_FOUND)
    entry = lookup.entry
    return _Proposal(STORED, entry.enactment, entry.record, path=str(entry.path),
                     key=entry.key)


def _close(run: Any) -> None:
    if hasattr(run, "close"):
        run.close()


def _enact(step: Step, proposal: _Proposal, source_fp: str, args: tuple,
           kwargs: Mapping[str, Any], dyn: tuple) -> Call:
    """Every process builds process 0's proposal (or all fall back), and a stored program
    not verified before is verified."""
    from disco_jax.activator import agree_on_enactment

    prebuilt = proposal.prebuilt

    def build(enactment: Any) -> Callable[..., Any]:
        if prebuilt is not None and prebuilt[0].fingerprint == enactment.fingerprint:
            return prebuilt[1]
        return step.build(enactment, args, kwargs, dyn)

    agreed = agree_on_enactment(proposal.enactment, proposal.record, source_fp,
                                reason=proposal.reason, warn=proposal.warn, build=build,
                                share_compiles=proposal.mode == STORED)
    if prebuilt is not None and agreed.run is not prebuilt[1]:
        _close(prebuilt[1])
    if agreed.run is None:
        return fallback(step, agreed.reason, source_fp, warn_user=agreed.warn)
    record = agreed.record  # process 0's, checked on every process before it voted
    if proposal.mode == STORED and record.verdict is None:
        why = _verify(step, agreed.run, record, proposal.key, args, kwargs, dyn)
        if why is not None:
            _close(agreed.run)
            return fallback(step, why, source_fp)
    return Call(agreed.run, True, RunInfo(
        proposal.mode, agreed.enactment.fingerprint, source_fp, "", record.choice,
        record.predicted_s.get(record.choice), record.measured_s.get(record.choice),
        proposal.path), step.donate_dyn)


def _verify(step: Step, run: Callable[..., Any], record: Any, key: str | None,
            args: tuple, kwargs: Mapping[str, Any], dyn: tuple) -> str | None:
    """Runs a stored program never verified before next to ``jax.jit``'s
    (:func:`disco_jax.verify.run_both`); one vote of the job decides, and process 0 records
    the verdict in its store entry ``key`` (:func:`disco_jax.store.record_verification`).
    Returns why the plan is refused, or None when it matches."""
    import jax

    from disco_jax import store as st
    from disco_jax.activator import unanimous
    from disco_jax.verify import Verdict, run_both

    def want() -> Any:  # jax.jit's program, donating nothing
        if step.donate_dyn:
            return step.dynamic_jit(args, kwargs)(*dyn)
        return step.plain(*args, **kwargs)

    try:
        verdict = run_both(run, dyn, want, lambda: step.dynamic_jit(args, kwargs))
    except Exception as err:  # noqa: BLE001 - it cannot run here: not trusted
        verdict = Verdict(False, None, failure("it failed when run once to verify it", err,
                                               limit=200))
    ok, reason = unanimous(verdict.ok, "" if verdict.ok else verdict.detail,
                           step="vote on the verification")
    where = ""
    if jax.process_index() == 0 and key is not None:
        try:
            written = st.record_verification(
                key, enactment_sha256=record.enactment_sha256, ok=ok,
                max_abs_diff=verdict.max_abs_diff, detail=reason or verdict.detail,
                root=step.store)
            where = "refused in the store" if written is not None else \
                "not recorded: the entry was replaced meanwhile"
        except OSError as err:
            where = f"not recorded: the store cannot be written ({err})"
    if ok:
        return None
    return ("verification refused the stored plan: it does not compute what jax.jit "
            f"computes on the first call's arguments ({reason}){'; ' + where if where else ''}"
            "; run once with ENABLE_SEARCH=1 to search again")


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
