"""``disco_jax.jit``: a drop-in for ``jax.jit`` that runs DisCo's program for the step.

::

    import disco_jax

    @disco_jax.jit                      # instead of @jax.jit; same arguments
    def train_step(params, opt_state, batch): ...

    params, opt_state, loss = train_step(params, opt_state, batch)
    print(train_step.last_run_info)     # what ran: searched / stored / fallback

On the first call for each input signature (shapes, dtypes, shardings, pytree structure,
values of static arguments) the wrapper lowers the function and
:func:`disco_jax.first_call.decide` picks its program from the environment variable
``ENABLE_SEARCH``:

* ``1`` (search phase): profile, search and choose by measurement
  (:func:`disco_jax.pipeline.optimize.optimize_step`; the first call's budget: the
  ``time_budget_s`` argument, else ``$DISCO_TIME_BUDGET``, else none; plans predicted to
  need more memory than ``$DISCO_MEMORY_BUDGET`` or the device has are refused; fused ops
  priced by the estimator ``$DISCO_FUSED_ESTIMATOR`` names), store the winner
  (:mod:`disco_jax.store`) and run it. Mode ``"searched"``.
* ``0`` (enactment phase): run the stored program for the step's fingerprint, verified
  against ``jax.jit``'s on the first call's arguments before it is first trusted
  (:mod:`disco_jax.verify`). Mode ``"stored"``.
* unset: use a stored program when one matches, else plain ``jax.jit``.

In a multi-process job (``jax.process_count() > 1``) process 0 alone searches (the
others take part in its measurements) and stores, or alone reads the store; the activator
(:mod:`disco_jax.activator`) broadcasts its choice and every process runs it, or all fall
back together. Anything that fails inside DisCo gives a :class:`DiscoFallbackWarning`
(once per reason and program) and plain ``jax.jit``; mode ``"fallback"`` with the
``reason``. Later calls with the same signature go straight to the compiled program: no
lowering, no store read, no recompilation.

What stays ``jax.jit``'s: every keyword argument of ``jax.jit`` is passed to it;
``.lower()``, ``.trace()``, ``.eval_shape()`` and other attributes are the plain
``jax.jit`` object's (they describe jax's own program, not DisCo's); calls under a jax
transformation (tracers: ``jax.grad`` of the wrapper, a wrapper called inside another
jit) run plain ``jax.jit``. ``static_argnums``/``static_argnames`` select the program as
in ``jax.jit`` (each value its own entry). ``donate_argnums``: a donated array is deleted
after the call, as with ``jax.jit``, but a program compiled from stored HLO does not
reuse its memory (the search itself never donates: it runs the candidates on the same
arguments many times). Keyword arguments that are arrays (not static) cannot be enacted:
such calls fall back with a warning that says so.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from disco_jax.first_call import (
    BUDGET_ENV,
    FALLBACK,
    FLAG_ENV,
    MEMORY_ENV,
    Call,
    DiscoFallbackWarning,
    RunInfo,
    Step,
    decide,
)

__all__ = ["BUDGET_ENV", "FLAG_ENV", "MEMORY_ENV", "DiscoFallbackWarning", "DiscoJitted",
           "RunInfo", "jit"]

#: What a compiled program raises for arguments of another signature (shapes, dtypes,
#: pytree, shardings) or for tracers: the fast path then takes the full lookup.
_SIGNATURE_ERRORS = (TypeError, ValueError)
_Tracer: Any = None  # jax.core.Tracer, set when the first wrapper is made (jax imported)


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
        self._plain = jax.jit(fun, **jax_jit_kwargs)
        static_pos, static_names = _positions(
            fun, jax_jit_kwargs.get("static_argnums"), jax_jit_kwargs.get("static_argnames"))
        donate_pos, _ = _positions(
            fun, jax_jit_kwargs.get("donate_argnums"), jax_jit_kwargs.get("donate_argnames"))
        self._step = Step(
            fun, self._plain, dict(jax_jit_kwargs), static_pos, static_names,
            # positions among the dynamic arguments (static ones cannot be donated)
            tuple(sorted(p - sum(s < p for s in static_pos)
                         for p in donate_pos if p not in static_pos)),
            time_budget_s, store, hardware, dict(search_options or {}))
        self._cache: dict[Any, Call] = {}
        self._hot: Call | None = None  # the last entry called, when it has a fast path
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
        if not self._step.static_pos:
            return args, ()
        dyn = tuple(a for i, a in enumerate(args) if i not in self._step.static_pos)
        static = tuple((i, a) for i, a in enumerate(args) if i in self._step.static_pos)
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
                                   if k in self._step.static_names))
            leaves, tree = jax.tree.flatten((dyn, {k: v for k, v in kwargs.items()
                                                   if k not in self._step.static_names}))
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

    def _first_call(self, args: tuple, kwargs: dict, dyn: tuple) -> Call:
        """The program of a new signature, with its fast path. A function that jax cannot
        lower gets plain ``jax.jit``, which raises the same error when called."""
        try:
            lowered = self._plain.lower(*args, **kwargs)
        except Exception:  # noqa: BLE001 - the user's error, raised by the plain call
            return Call(self._plain, False, RunInfo(FALLBACK, None, None,
                                                    "jax.jit cannot lower it"))
        entry = decide(self._step, args, kwargs, dyn, lowered)
        return self._with_fast_path(entry, lowered, kwargs)

    def _with_fast_path(self, entry: Call, lowered: Any, kwargs: dict) -> Call:
        """``entry`` with its fast path: jax's compiled program of the signature, when the
        call takes the positional arguments alone (no static or keyword arguments)."""
        import jax

        if kwargs or self._step.static_pos or self._step.static_names:
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
