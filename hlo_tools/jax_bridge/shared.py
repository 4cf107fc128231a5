"""One compile per job: process 0 compiles, the other processes load its executable.

In a ``jax.distributed`` job every process compiles the same programs (a step's
candidates, the stages of a staged step). Where the processes share the machine's cores
those compiles contend: XLA:CPU compiles on a thread pool, and in a 2-process job on 2
cores each compile took 2.6 times as long as alone (XLA's default of transformer
``medium``: 16.4 s against 6.2 s). Within :func:`compiles_shared`, each whole-program
or per-device compile of :func:`~hlo_tools.jax_bridge.compile.compile_module` happens in
process 0 alone; it posts the serialized executable through the job's coordination
service and the other processes load it (milliseconds). Every process then runs the same
executable, and a program XLA rejects is rejected in every process with process 0's
error.

A batch of programs known together (:func:`spread`: the stages of a staged step) is
spread over the processes instead: process ``k`` compiles the programs ``k, k + n, ...``
first, at the same time as the others compile theirs, then loads the rest. Processes
with cores of their own (other hosts, or pinned to a CPU each) then build the batch ``n``
times as fast; on shared cores the compiles still contend, but each program is compiled
once, not ``n`` times.

The contract of the block: every process compiles the same programs in the same order
(a batch: the same calls). The programs are matched by their place in that order, and a
posted program carries a digest of its text and options: a process whose own program at
that place differs (its text was written differently there) compiles its own, so a
wrong executable is never loaded. A process waits for the owner's post until the
coordinator's timeout or a failure posted in the job
(:class:`~hlo_tools.jax_bridge.sync.JobFailed`). Process 0 may compile programs the
others do not, after theirs; never the other way round. A program jax cannot serialize
(e.g. one with hoisted constants), or bytes a process cannot load, is compiled in that
process as without the block. The coordination service keeps the bytes until the job
ends.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar

from hlo_tools.jax_bridge.errors import HloCompileError

__all__ = ["SharedCompiles", "compiles_shared", "once", "spread"]

T = TypeVar("T")

# the first byte of a posted value: what follows
_EXECUTABLE, _ERROR, _LOCAL = b"X", b"E", b"L"


class SharedCompiles:
    """The compiles of one :func:`compiles_shared` block, counted in this process.

    Attributes:
        compiled: programs this process compiled and posted (process 0, and each
            process its share of a :func:`spread` batch).
        loaded: programs this process loaded from another process's bytes.
        local: programs this process compiled itself: the owner's could not be shared
            (jax could not serialize it, or the bytes did not load here), or its program
            at that place differed from this process's.
    """

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self.pid = coordinator.pid
        self.compiled = self.loaded = self.local = 0
        self.owner = 0  # the process that compiles what is compiled next
        # the place in the block: "" outside a batch, else the batch and the call; and
        # the compiles made so far at each place
        self.scope = ""
        self.batches = 0
        self.seen: collections.Counter[str] = collections.Counter()

    def once(self, identity: str, compile_it: Callable[[], T], dump: Callable[[T], bytes],
             load: Callable[[bytes], T]) -> T:
        """``compile_it()`` in the owner (:attr:`owner`), posted as ``dump`` writes it;
        elsewhere the owner's program as ``load`` reads it (or its error, raised here),
        when its digest is this process's own."""
        digest = hashlib.sha256(identity.encode()).hexdigest()[:32].encode()
        self.seen[self.scope] += 1
        key = f"exe{self.scope}/{self.seen[self.scope]}"
        if self.pid != self.owner:
            data = self.coordinator.share_bytes(key, None, self.pid, self.owner)
            tag, theirs, body = data[:1], data[1:33], data[33:]
            if theirs == digest and tag == _ERROR:
                raise HloCompileError(body.decode())
            if theirs == digest and tag == _EXECUTABLE:
                try:
                    out = load(body)
                    self.loaded += 1
                    return out
                except Exception:  # noqa: BLE001 - compile it here, as without sharing
                    pass
            self.local += 1
            return compile_it()
        try:
            out = compile_it()
        except Exception as err:
            reason = str(err) if isinstance(err, HloCompileError) else (
                f"process {self.pid} could not compile the program: "
                f"{type(err).__name__}: {err}")
            self.coordinator.share_bytes(key, _ERROR + digest + reason.encode(), self.pid,
                                         self.pid)
            raise
        try:
            data = _EXECUTABLE + digest + dump(out)
        except Exception:  # noqa: BLE001 - jax cannot serialize it: each compiles its own
            data = _LOCAL + digest
        self.coordinator.share_bytes(key, data, self.pid, self.pid)
        self.compiled += 1
        return out


_ACTIVE: ContextVar[SharedCompiles | None] = ContextVar("hlo_tools_shared_compiles",
                                                        default=None)


@contextlib.contextmanager
def compiles_shared(coordinator: Any) -> Iterator[SharedCompiles | None]:
    """Within the block, process 0 compiles and the others load its executables.

    Args:
        coordinator: the job's :class:`~hlo_tools.jax_bridge.sync.Coordinator` (its
            prefix keeps the block's keys apart from other uses; use one per block).
            None, or a job of one process: compiles as without the block.

    Yields:
        The block's :class:`SharedCompiles` counts (None where nothing is shared).
    """
    if coordinator is None or coordinator.n < 2:
        yield None
        return
    shared = SharedCompiles(coordinator)
    token = _ACTIVE.set(shared)
    try:
        yield shared
    finally:
        _ACTIVE.reset(token)


def once(identity: str, compile_it: Callable[[], T], dump: Callable[[T], bytes],
         load: Callable[[bytes], T]) -> T:
    """``compile_it()``, or within :func:`compiles_shared` process 0's program of the
    same ``identity`` (the text that tells programs apart: the program and its options).

    Args:
        identity: what is compiled, as text.
        compile_it: compiles it here.
        dump: the compiled program as bytes.
        load: the compiled program from ``dump``'s bytes.
    """
    shared = _ACTIVE.get()
    if shared is None:
        return compile_it()
    return shared.once(identity, compile_it, dump, load)


def spread(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Each call's result, in order; within :func:`compiles_shared` the calls (each
    compiling one program) are spread over the processes: process ``k`` owns the calls
    ``k, k + n, ...`` and makes them first, then the others, whose programs it loads.

    Every process makes the same calls. A call that fails (an XLA rejection, here or in
    its owner) does not stop the others, so that every process posts its share; then the
    first failure in call order is raised, the same in every process.

    Args:
        calls: calls that compile a program each (e.g. of
            :func:`~hlo_tools.jax_bridge.compile.compile_module`).
    """
    shared = _ACTIVE.get()
    if shared is None:
        return [call() for call in calls]
    n = shared.coordinator.n
    shared.batches += 1
    mine = [i for i in range(len(calls)) if i % n == shared.pid]
    order = mine + [i for i in range(len(calls)) if i % n != shared.pid]
    results: dict[int, Any] = {}
    failed: dict[int, Exception] = {}
    for i in order:
        shared.owner, shared.scope = i % n, f"/batch{shared.batches}/{i}"
        try:
            results[i] = calls[i]()
        except Exception as err:  # noqa: BLE001 - raised below, after the others posted
            failed[i] = err
        finally:
            shared.owner, shared.scope = 0, ""
    if failed:
        raise failed[min(failed)]
    return [results[i] for i in range(len(calls))]
