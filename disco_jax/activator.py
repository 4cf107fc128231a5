"""The activator: every process of a multi-process job runs the same program, process 0's.

In the paper's enactment phase the activator on the master reads the optimized HLO and
broadcasts it to the workers, which then train with it together. Here the broadcast goes
over the job's own collective backend (gloo on CPU, NCCL on GPU), through
``jax.experimental.multihost_utils``:

1. **barrier** (``jax.distributed``'s coordination service, bounded by
   :data:`TIMEOUT_ENV`): every process has reached the activator for this program; a
   process that never arrives gives the others a clear :class:`ActivatorError` instead of
   a collective that waits forever;
2. **broadcast**: process 0's payload (its enactment as JSON, the store record, or why it
   has none) is broadcast to all: its length first (``int32``), then its bytes
   (``uint8``), each with ``broadcast_one_to_all`` (every process must pass an array of the
   same shape);
3. **check and build**: every process checks the payload against its own lowering — the
   source fingerprint of the program, jax/jaxlib version, backend, device kind, device
   and process counts (:meth:`disco_jax.store.Setup.mismatch`), that the HLO parses — and
   compiles it (``build``; compiling runs no collective);
4. **vote**: ``process_allgather`` of one fixed-size ``uint8`` row per process (its 0/1
   vote and the first bytes of its reason). Every process sees the same rows, so either
   all run the enactment or all fall back to plain ``jax.jit`` with the same reason: a
   split decision (which would hang the job in its first collective) cannot happen.

Typical use (what :func:`disco_jax.jit` does when ``jax.process_count() > 1``)::

    agreed = agree_on_enactment(entry.enactment if pid == 0 else None,
                                record, source_fp, build=compile_it)
    if agreed.run is None:
        warn(agreed.reason); run = plain_jit

Timeouts and the knobs that bound a stuck job:

* :data:`TIMEOUT_ENV` (``DISCO_ACTIVATOR_TIMEOUT``, seconds, default 600): the barrier of
  step 1; past it :class:`ActivatorError` names the step and the process.
* ``jax.distributed.initialize(initialization_timeout=...)`` (default 300 s): how long
  a process waits for the others to join the job at start-up.
* ``jax.distributed.initialize(heartbeat_timeout_seconds=...)`` (default 100 s): a
  process that dies is noticed by the coordination service after this long and the
  others are stopped with an error (instead of waiting in a collective).
* ``shutdown_timeout_seconds`` of the same call: the barrier of
  ``jax.distributed.shutdown()`` at exit.
* XLA collective timeouts: on GPU, NCCL's own (``NCCL_TIMEOUT``-style settings of the
  runtime, and ``--xla_gpu_nccl_termination_timeout_seconds`` in ``XLA_FLAGS``); on CPU,
  gloo waits inside a collective until the coordination service's heartbeat stops the
  job.

:func:`initialize_from_env` starts ``jax.distributed`` from the variables ``disco launch``
sets (:data:`COORDINATOR_ENV`, :data:`NUM_PROCESSES_ENV`, :data:`PROCESS_ID_ENV`); without
them it does nothing, so one script runs alone or in a job.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = [
    "COORDINATOR_ENV",
    "NUM_PROCESSES_ENV",
    "PROCESS_ID_ENV",
    "REASON_BYTES",
    "TIMEOUT_ENV",
    "ActivatorError",
    "Agreement",
    "agree_on_enactment",
    "broadcast_bytes",
    "check_payload",
    "read_payload_record",
    "initialize_from_env",
    "unanimous",
]

#: Seconds a process waits at the activator's barrier for the others.
TIMEOUT_ENV = "DISCO_ACTIVATOR_TIMEOUT"
_DEFAULT_TIMEOUT_S = 600.0
#: ``host:port`` of the job's coordinator (process 0), set by ``disco launch``.
COORDINATOR_ENV = "DISCO_COORDINATOR"
#: Processes of the job, set by ``disco launch``.
NUM_PROCESSES_ENV = "DISCO_NUM_PROCESSES"
#: This process's id (0 .. N-1), set by ``disco launch``.
PROCESS_ID_ENV = "DISCO_PROCESS_ID"
#: Bytes of a reason carried by the vote (longer reasons are cut).
REASON_BYTES = 480

_COUNTER = itertools.count()
_COUNTER_LOCK = threading.Lock()


class ActivatorError(RuntimeError):
    """A step of the activator failed or timed out on this process (the message names
    the step and the process)."""


class Agreement(NamedTuple):
    """What every process of the job agreed on.

    Attributes:
        enactment: process 0's :class:`~disco_jax.enactment.Enactment` when all run it,
            else None.
        run: what ``build`` returned on this process (None: fall back).
        record: process 0's :class:`~disco_jax.store.Record` (None without one).
        reason: why all fall back (``""`` when they run it); the same on every process.
        warn: whether the fallback deserves a warning (process 0's judgement, so every
            process warns or none does).
        payload_bytes: size of the broadcast payload.
    """

    enactment: Any
    run: Any
    record: Any
    reason: str = ""
    warn: bool = True
    payload_bytes: int = 0


def _timeout_s() -> float:
    """Seconds the activator's barrier waits (``DISCO_ACTIVATOR_TIMEOUT``)."""
    from disco_jax.units import env_seconds

    seconds = env_seconds(TIMEOUT_ENV)
    return _DEFAULT_TIMEOUT_S if seconds is None else seconds


def _step_error(step: str, err: BaseException) -> ActivatorError:
    import jax

    first = (str(err).strip().splitlines() or [""])[0][:300]
    return ActivatorError(
        f"disco_jax activator: step {step!r} failed on process {jax.process_index()} of "
        f"{jax.process_count()} ({type(err).__name__}: {first}); every process of the job "
        "must call the wrapped step with the same program (raise "
        f"{TIMEOUT_ENV} if a process is only slow)")


def broadcast_bytes(data: bytes | None, *, step: str = "broadcast") -> bytes:
    """Process 0's ``data`` on every process, over the collective backend.

    The length goes first (``int32``), then the bytes (``uint8``): both are
    ``broadcast_one_to_all`` calls, which need arrays of one shape on every process.

    Args:
        data: the bytes (process 0); ignored elsewhere (pass None).
        step: the step's name in errors.

    Returns:
        Process 0's bytes (in a one-process job, ``data`` itself).

    Raises:
        ActivatorError: a collective failed.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    source = jax.process_index() == 0
    data = (data or b"") if source else b""
    if jax.process_count() == 1:
        return data
    if len(data) >= 2**31:
        raise ActivatorError(f"disco_jax activator: payload of {len(data)} bytes is too large")
    try:
        length = multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int32))
        n = int(np.asarray(length)[0])
        if n == 0:
            return b""
        buf = np.frombuffer(data, np.uint8) if source else np.zeros(n, np.uint8)
        out = multihost_utils.broadcast_one_to_all(buf)
    except Exception as err:  # noqa: BLE001 - any runtime error: name the step
        raise _step_error(f"{step} (length, then bytes)", err) from err
    return np.asarray(out, np.uint8).tobytes()


def unanimous(ok: bool, reason: str = "", *, step: str = "vote") -> tuple[bool, str]:
    """One collective vote: True on every process if every process voted ``ok``.

    Each process contributes one ``uint8`` row (its vote, then up to
    :data:`REASON_BYTES` bytes of its reason); ``process_allgather`` gives every process
    all rows, so all reach the same answer.

    Args:
        ok: this process's vote.
        reason: why not (when not ``ok``).
        step: the step's name in errors.

    Returns:
        ``(all_ok, reason)`` (in a one-process job, this process's own): the reason of the
        first process that voted no (prefixed with its id when it is not this one), ``""``
        when all voted yes.

    Raises:
        ActivatorError: the collective failed.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return ok, "" if ok else reason
    row = np.zeros(REASON_BYTES + 1, np.uint8)
    row[0] = 1 if ok else 0
    raw = reason.encode("utf-8")[:REASON_BYTES]
    row[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
    try:
        rows = np.asarray(multihost_utils.process_allgather(row), np.uint8)
    except Exception as err:  # noqa: BLE001
        raise _step_error(step, err) from err
    rows = rows.reshape(-1, REASON_BYTES + 1)
    me = jax.process_index()
    for pid, r in enumerate(rows):
        if not r[0]:
            text = r[1:].tobytes().rstrip(b"\0").decode("utf-8", "replace")
            return False, text if pid == me else f"process {pid}: {text}"
    return True, ""


def check_payload(payload: Mapping[str, Any], own_fingerprint: str,
                  setup: Any = None, record: Any = None) -> str | None:
    """Why process 0's payload cannot run on this process (a sentence), or None.

    Args:
        payload: the broadcast payload (``source_fingerprint``, ``record``,
            ``enactment``).
        own_fingerprint: the source fingerprint of this process's lowering.
        setup: this process's :class:`disco_jax.store.Setup` (None: the record's setup
            is not checked).
        record: the payload's record as read (:func:`read_payload_record`), when it was
            read already.
    """
    if payload.get("source_fingerprint") != own_fingerprint:
        return (f"process 0 lowered another program (key "
                f"{str(payload.get('source_fingerprint'))[:12]}, here {own_fingerprint[:12]}); "
                "every process must call the step with the same program")
    if setup is None:
        return None
    if record is None:
        record, why = read_payload_record(payload.get("record"))
        if why:
            return why
    return setup.mismatch(record) if record is not None else \
        "corrupt record from process 0: none came with its plan"


def read_payload_record(data: Any) -> tuple[Any, str]:
    """Process 0's :class:`~disco_jax.store.Record` from the payload's JSON, and why it
    cannot be read (``""`` when it can; ``(None, "")`` for no record)."""
    from disco_jax.store import Record

    try:
        return (Record.from_json(data) if data is not None else None), ""
    except ValueError as err:
        return None, f"{err} (process 0's)"


def agree_on_enactment(local: Any, record: Any, own_fingerprint: str, *,
                       reason: str = "", warn: bool = True,
                       build: Callable[[Any], Any] | None = None, setup: Any = None,
                       check_record: bool = True, share_compiles: bool = False) -> Agreement:
    """Process 0's enactment, broadcast, checked and built everywhere, or an agreed
    fallback. Every process of the job must call it for the same program, in the same
    order. In a one-process job nothing is broadcast or voted on: the steps pass this
    process's own values through (the plan is checked and built, or why not is the
    fallback's reason), so one path serves both.

    Args:
        local: process 0: the :class:`~disco_jax.enactment.Enactment` to run, or None
            (then ``reason`` says why). Ignored on the other processes.
        record: process 0: its :class:`~disco_jax.store.Record` (ignored elsewhere).
        own_fingerprint: this process's source fingerprint of the program.
        reason: process 0: why there is no enactment.
        warn: process 0: whether a fallback warns.
        build: ``build(enactment) -> run`` on each process (compiles, runs no
            collective); an exception is a vote to fall back. None: run is the
            enactment.
        setup: this process's :class:`disco_jax.store.Setup` (default: the current one).
        check_record: check the record's setup (off when process 0 just searched and the
            record is its own).
        share_compiles: ``build`` compiles in every process (none holds the program
            already): process 0 compiles each program and the others load it
            (:func:`hlo_tools.jax_bridge.compiles_shared`). The same in every process.

    Returns:
        The :class:`Agreement`: the same ``enactment``/``reason`` on every process.

    Raises:
        ActivatorError: a process did not reach the activator in time
            (:data:`TIMEOUT_ENV`) or a collective failed; the message names the step.
    """
    import jax

    from disco_jax import store as st
    from disco_jax.enactment import Enactment
    from hlo_tools.jax_bridge import Coordinator, compiles_shared

    solo = jax.process_count() == 1
    if not solo:
        with _COUNTER_LOCK:
            count = next(_COUNTER)
        try:
            Coordinator(f"disco_activator_{own_fingerprint[:16]}_{count}",
                        int(_timeout_s() * 1000)).barrier("enter")
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - a timeout or a lost coordinator
            raise _step_error("barrier before the broadcast (are all processes calling "
                              "the step?)", err) from err

    def payload_of(enactment: Any, record_json: Any) -> dict[str, Any]:
        return {"source_fingerprint": own_fingerprint, "record": record_json,
                "reason": reason, "warn": bool(warn), "enactment": enactment}

    if solo:  # nothing to broadcast: the payload is this process's own, not serialized
        data, payload = b"", payload_of(local, None)
        p_record, record_why = record, ""
    else:
        data = json.dumps(payload_of(
            local.to_json() if local is not None else None,
            record.to_json() if record is not None else None), sort_keys=True).encode(
                "utf-8") if jax.process_index() == 0 else None
        data = broadcast_bytes(data, step="broadcast of the enactment")
        try:
            payload = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            payload = {"enactment": None, "warn": True, "record": None,
                       "reason": f"corrupt broadcast from process 0 ({err})"}
        p_record, record_why = read_payload_record(payload.get("record"))
    p_reason = str(payload.get("reason") or "")
    p_warn = bool(payload.get("warn", True))
    if payload.get("enactment") is None:
        # nothing to run: every process received the same payload, no vote is needed
        return Agreement(None, None, p_record, p_reason or "process 0 has no plan", p_warn,
                         len(data))

    why, enactment, run = None, None, None
    whose = "the plan" if solo else "the plan from process 0"
    why = record_why if check_record and record_why else check_payload(
        payload, own_fingerprint, (setup or st.Setup.current()) if check_record else None,
        p_record)
    if why is None:
        try:
            enactment = local if solo else Enactment.from_json(payload["enactment"])
        except ValueError as err:
            why = f"{whose} cannot be read here ({err})"
    # process 0 compiles the plan's programs and the others load them: in a job whose
    # processes share the cores their compiles would contend; a process that does not
    # build posts why, so that no other waits for its compiles
    shared = None if solo or not share_compiles else Coordinator(
        f"disco_build_{own_fingerprint[:16]}_{count}", int(_timeout_s() * 1000),
        watch_failures=True)
    if why is None:
        try:
            with compiles_shared(shared):
                run = build(enactment) if build is not None else enactment
        except Exception as err:  # noqa: BLE001 - XLA rejected it: vote no
            first = (str(err).strip().splitlines() or [""])[0][:300]
            why = f"{whose} does not compile here ({type(err).__name__}: {first})"
    if why is not None and shared is not None:
        shared.fail(why)
    ok, agreed_reason = unanimous(why is None, why or "", step="vote on running the plan")
    if ok:
        return Agreement(enactment, run, p_record, "", p_warn, len(data))
    built = run[0] if isinstance(run, tuple) else run  # build may return (run, extra)
    if built is not None and hasattr(built, "close"):
        built.close()
    return Agreement(None, None, p_record, agreed_reason if solo else
                     f"not every process can run the plan, all fall back: {agreed_reason}",
                     True, len(data))


def initialize_from_env(**kwargs: Any) -> bool:
    """Starts ``jax.distributed`` from ``disco launch``'s variables; a no-op without them.

    Reads :data:`COORDINATOR_ENV`, :data:`NUM_PROCESSES_ENV` and :data:`PROCESS_ID_ENV`.
    On CPU it selects gloo collectives first. Call it before any other jax call.

    Args:
        **kwargs: more arguments of ``jax.distributed.initialize``
            (``initialization_timeout``, ``heartbeat_timeout_seconds``, ...).

    Returns:
        True if it initialized a job, False when the variables are not set.

    Raises:
        ValueError: the variables are set but malformed (the message says which).
    """
    coordinator = os.environ.get(COORDINATOR_ENV)
    if not coordinator:
        return False
    try:
        num = int(os.environ[NUM_PROCESSES_ENV])
        pid = int(os.environ[PROCESS_ID_ENV])
    except (KeyError, ValueError):
        raise ValueError(f"{COORDINATOR_ENV} is set, so {NUM_PROCESSES_ENV} and "
                         f"{PROCESS_ID_ENV} must be integers (got "
                         f"{os.environ.get(NUM_PROCESSES_ENV)!r}, "
                         f"{os.environ.get(PROCESS_ID_ENV)!r})") from None
    if not 0 <= pid < num:
        raise ValueError(f"{PROCESS_ID_ENV}={pid} is not in 0..{num - 1}")
    import jax

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms in ("", "cpu") or platforms.startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs.setdefault("initialization_timeout", 120)
    jax.distributed.initialize(coordinator, num_processes=num, process_id=pid, **kwargs)
    return True
