"""What DisCo runs for a train step: one value, written by ``disco optimize``, kept by the
strategy store, broadcast by the activator.

An :class:`Enactment` is either

* **single-module**: one whole-program HLO module and how it is compiled (XLA's fusion
  passes off or on, the kernel library, extra XLA options), run with
  :func:`hlo_tools.compile_module` in place of the step's own lowering; or
* **staged**: a :class:`disco_jax.enactment.staged.StagedPlan` (per-device stage modules, the
  communication buckets, the launch schedule), run by :class:`disco_jax.enactment.staged.StagedStep`
  on a compute stream and a communication thread.

It is plain data (HLO text, numbers, strings): :meth:`Enactment.to_json` and
:meth:`Enactment.from_json` round-trip it exactly, and nothing in it is executed when it
is read. :attr:`Enactment.fingerprint` names it (sha256 over its kind, texts and options).

Typical use::

    enactment = Enactment.single("bucketed_1MiB", text, exact=False,
                                 compiler_options=options)
    run = build(enactment, step, args)       # compiled; run(*args) == jax.jit(step)(*args)
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from disco_jax.enactment.staged import CHUNK_BYTES, StagedPlan, StagedStep

__all__ = [
    "FORMAT",
    "SINGLE",
    "STAGED",
    "STAGED_ENV",
    "Enactment",
    "build",
    "single_module",
]

#: ``DISCO_STAGED=0`` (or ``off``) in every process of a job: staged enactments are built
#: as their single-module program (as when the self-test finds no overlap).
STAGED_ENV = "DISCO_STAGED"
#: Version of the JSON form (:meth:`Enactment.to_json`).
FORMAT = 1
#: One whole-program module.
SINGLE = "single"
#: Compute stages and communication programs on two streams.
STAGED = "staged"


class Enactment(NamedTuple):
    """A train step's program as DisCo runs it.

    Attributes:
        name: what it is, for people (``"plan_0"``, ``"bucketed_1MiB"``, ``"staged_4"``).
        kind: :data:`SINGLE` or :data:`STAGED`.
        text: the whole-program HLO module (single-module; ``""`` when staged).
        exact: compile with XLA's fusion and combining passes off (the text's fusions
            and all-reduces are what runs); staged: for every stage.
        library: with ``exact``, dots and convolutions on XLA's kernel library.
        compiler_options: extra XLA options (JSON values), single-module only.
        staged: the stages and schedule (staged only).
        chunk_bytes: staged only: each bucket is reduced in collectives of at most this
            many bytes (0: one collective per bucket).
    """

    name: str
    kind: str
    text: str = ""
    exact: bool = True
    library: bool = False
    compiler_options: Mapping[str, Any] = {}
    staged: StagedPlan | None = None
    chunk_bytes: int = CHUNK_BYTES or 0

    @classmethod
    def single(cls, name: str, text: str, *, exact: bool = True, library: bool = False,
               compiler_options: Mapping[str, Any] | None = None) -> Enactment:
        """A single-module enactment of HLO ``text``."""
        return cls(name, SINGLE, text, exact, library, dict(compiler_options or {}))

    @classmethod
    def of_stages(cls, name: str, plan: StagedPlan, *, exact: bool = False,
                  chunk_bytes: int | None = CHUNK_BYTES) -> Enactment:
        """A staged enactment of ``plan`` (``chunk_bytes`` None or 0: one collective per
        bucket)."""
        return cls(name, STAGED, exact=exact, staged=plan, chunk_bytes=chunk_bytes or 0)

    @property
    def texts(self) -> tuple[str, ...]:
        """Every HLO module it compiles: the one module, or the stages in order."""
        if self.kind == STAGED:
            return tuple(st.text for st in self.staged.stages)
        return (self.text,)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict; :meth:`from_json` inverts it exactly."""
        out: dict[str, Any] = {"format": FORMAT, "name": self.name, "kind": self.kind,
                               "exact": self.exact, "library": self.library}
        if self.kind == STAGED:
            out["staged"] = self.staged.to_json()
            out["chunk_bytes"] = self.chunk_bytes
        else:
            out["text"] = self.text
            out["compiler_options"] = dict(self.compiler_options)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Enactment:
        """Reads :meth:`to_json`'s dict.

        Raises:
            ValueError: another format version, an unknown kind, a missing or malformed
                field (the message says which).
        """
        if not isinstance(data, Mapping):
            raise ValueError("malformed enactment: not a JSON object")
        if data.get("format") != FORMAT:
            raise ValueError(f"enactment format {data.get('format')!r}, this version reads "
                             f"{FORMAT}")
        try:
            name, kind = str(data["name"]), data["kind"]
            exact, library = bool(data["exact"]), bool(data["library"])
            if kind == STAGED:
                return cls.of_stages(name, StagedPlan.from_json(data["staged"]),
                                     exact=exact, chunk_bytes=int(data["chunk_bytes"]))
            if kind == SINGLE:
                text = data["text"]
                if not isinstance(text, str):
                    raise TypeError("text is not a string")
                return cls.single(name, text, exact=exact, library=library,
                                  compiler_options=dict(data["compiler_options"]))
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed enactment: {err!r}") from None
        raise ValueError(f"unknown enactment kind {kind!r}")

    @property
    def fingerprint(self) -> str:
        """sha256 (hex) of everything that decides what runs (not the name)."""
        key = {k: v for k, v in self.to_json().items() if k != "name"}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def build(enactment: Enactment, step: Callable[..., Any], args: Sequence[Any], *,
          kwargs: Mapping[str, Any] | None = None, self_test: bool = True
          ) -> Callable[..., Any]:
    """Compiles an enactment for ``step`` on arguments like ``args``.

    A staged enactment first runs :meth:`~disco_jax.enactment.staged.StagedStep.self_test` on
    ``args`` (every process of a job must call ``build`` alike: it runs collectives).
    When the two streams do not overlap here (or ``DISCO_STAGED=0``), it warns with the
    reason and falls back to the single-module enactment of the same buckets (flat
    all-reduces in one program, XLA's fusion on), which computes the same values.

    Args:
        enactment: what to run.
        step: the train step whose calling convention it keeps (plain or jitted).
        args: its positional arguments (arrays placed as they will be at run time, or
            ``ShapeDtypeStruct`` for a single-module enactment).
        kwargs: keyword arguments to lower ``step`` on (single-module only).

    Returns:
        ``run(*args)`` returning what ``jax.jit(step)(*args)`` returns. A staged run owns
        a communication thread: call ``run.close()`` when done (it is a
        :class:`~disco_jax.enactment.staged.StagedStep`).

    Raises:
        hlo_tools.jax_bridge.HloCompileError: XLA rejected a module.
        ValueError: the enactment does not fit ``step``'s arguments.
    """
    from hlo_tools import jax_bridge

    if enactment.kind == STAGED:
        if kwargs:
            raise ValueError("a staged enactment takes positional arguments only")
        out_tree = jax.tree.structure(jax.eval_shape(step, *args))
        run = StagedStep.for_args(enactment.staged, args, out_tree, exact=enactment.exact,
                                  chunk_bytes=enactment.chunk_bytes or None)
        if not self_test:
            return run
        off = os.environ.get(STAGED_ENV, "").strip().lower() in ("0", "off", "false", "no")
        check = None if off else run.self_test(*args)
        if check is not None and check.overlaps:
            return run
        run.close()
        reason = f"{STAGED_ENV}={os.environ[STAGED_ENV]}" if off else check.reason
        warnings.warn(f"staged enactment {enactment.name!r} falls back to one program: "
                      f"{reason}", RuntimeWarning, stacklevel=2)
        return build(single_module(enactment, step, args), step, args)
    return jax_bridge.compile_module(
        enactment.text, jax_bridge.InPlaceOf(step, args, kwargs),
        jax_bridge.CompileOptions(exact=enactment.exact, library=enactment.library,
                                  extra=enactment.compiler_options))


def single_module(enactment: Enactment, step: Callable[..., Any], args: Sequence[Any]
                  ) -> Enactment:
    """The single-module enactment of a staged one: the step's own module with the same
    buckets as flat all-reduces (:func:`hlo_tools.baselines.apply_buckets`), compiled
    with XLA's fusion on, as the ``bucketed`` baseline is."""
    import hlo_tools
    from hlo_tools import baselines
    from hlo_tools.jax_bridge import fresh_function

    if enactment.kind != STAGED:
        return enactment
    module = hlo_tools.parse(hlo_tools.extract(fresh_function(step), *args))
    buckets = [list(b.members) for b in enactment.staged.comms if len(b.members) > 1]
    text = hlo_tools.to_text(baselines.apply_buckets(module, buckets))
    platform = jax.devices()[0].platform
    return Enactment.single(f"{enactment.name}_single", text, exact=False,
                            compiler_options=baselines.baseline_options(
                                baselines.BUCKETED, platform))
