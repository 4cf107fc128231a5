"""Helpers of multi-process gloo jobs on one host: the one home of them.

Used by the AllReduce microbenchmarks (:mod:`disco_estimator.allreduce` and its worker
``disco_estimator._gloo_worker``) and by the simulator accuracy benchmark's worker.

* processes: :func:`child_env` (the environment of a CPU-only jax child),
  :func:`run_bounded` (run a command in its own process group, bounded in time),
  :func:`wait_all` (wait for the processes of a job, kill them after a deadline),
  :func:`pin_to_own_cpu`, :func:`quiet_gloo_loops` (gloo's event loop at ``SCHED_BATCH`` or
  ``SCHED_IDLE``);
* network: :func:`free_port` on 127.0.0.1, :func:`in_private_netns` and
  :func:`set_loopback_rate` (``tc`` on ``lo``, only ever inside a private network
  namespace made with ``unshare -n``, so the host's network is never touched).

Importing this module does not import jax.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = [
    "DEFAULT_LOOP_POLICY",
    "LOOP_CHOICES",
    "LOOP_POLICIES",
    "child_env",
    "free_port",
    "gloo_loop_threads",
    "in_private_netns",
    "pin_to_own_cpu",
    "quiet_gloo_loops",
    "run_bounded",
    "run_local_job",
    "set_loopback_rate",
    "wait_all",
]

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


# --------------------------------------------------------------------------- processes


def child_env(num_local_devices: int = 1,
              extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a jax worker process: CPU only, ``num_local_devices`` host
    devices.

    Args:
        num_local_devices: host devices of the child (``XLA_FLAGS``'
            ``--xla_force_host_platform_device_count``, dropped from the parent's flags and
            set only when > 1).
        extra: further variables to set (e.g. ``{"PYTHONHASHSEED": "0"}``).

    Returns:
        A copy of ``os.environ`` with ``XLA_FLAGS``, ``JAX_PLATFORMS=cpu``, ``extra``, and
        the directory holding the ``estimator`` package first on ``PYTHONPATH`` (so
        ``python -m estimator...`` finds this copy from a checkout too).
    """
    env = dict(os.environ)
    flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S+", "", env.get("XLA_FLAGS", "")).strip()
    if num_local_devices > 1:
        flags = f"{flags} {_DEVICE_COUNT_FLAG}={num_local_devices}".strip()
    env["XLA_FLAGS"] = flags
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra or {})
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def run_bounded(cmd: Sequence[str], env: Mapping[str, str], timeout_s: float, *,
                cwd: str | os.PathLike[str] | None = None, check: bool = True) -> int:
    """Runs ``cmd`` in its own process group; kills that whole group after ``timeout_s``.

    Args:
        cmd: the command.
        env: its environment (see :func:`child_env`).
        timeout_s: bound on its run, seconds.
        cwd: its working directory (None: this process's).
        check: raise on a timeout or a non-zero exit status instead of returning it.

    Returns:
        The exit status; ``-9`` after a timeout (with ``check=False``).

    Raises:
        TimeoutError: ``check`` and it ran past ``timeout_s``.
        RuntimeError: ``check`` and it exited with a non-zero status.
    """
    cmd = list(cmd)
    proc = subprocess.Popen(cmd, env=dict(env), start_new_session=True, cwd=cwd)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if check:
            raise TimeoutError(f"{' '.join(cmd[:4])} ... took over {timeout_s:.0f} s") \
                from None
        return -signal.SIGKILL
    if check and rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with status {rc}")
    return rc


def wait_all(procs: Sequence[subprocess.Popen], deadline: float,
             failed: Callable[[], bool] | None = None, *, grace_s: float = 10.0,
             poll_s: float = 0.2, raise_on_timeout: bool = False) -> list[int]:
    """Waits for every process until ``deadline``; then kills the rest (by pid).

    Args:
        procs: the job's processes.
        deadline: ``time.monotonic()`` value after which the running ones are killed.
        failed: checked while waiting; once it returns True (e.g. "some process has
            failed"), the others get at most ``grace_s`` more seconds. None: no grace
            rule, the deadline alone bounds the wait.
        grace_s: see ``failed``.
        poll_s: how often the processes are polled, seconds.
        raise_on_timeout: after killing processes, raise instead of returning.

    Returns:
        The exit status of each process (``-9`` for those killed).

    Raises:
        TimeoutError: ``raise_on_timeout`` and some process had to be killed.
    """
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed is not None and failed():
            deadline = min(deadline, now + grace_s)
        if now > deadline:
            killed = [p.pid for p in procs if p.poll() is None]
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            if raise_on_timeout and killed:
                raise TimeoutError(f"processes {killed} still ran at the deadline; killed")
            break
        time.sleep(max(0.0, min(poll_s, deadline - now)))
    return [p.returncode for p in procs]


def pin_to_own_cpu(process_id: int) -> int:
    """Pins this process (and the threads it starts later) to CPU ``process_id`` modulo
    the CPU count; returns that CPU.

    Each process then behaves like one device with a core of its own: its compute never
    competes with the other process's, and how long a gloo receive waits for the CPU
    depends less on where the scheduler happened to place the two processes. Unpinned,
    on this 2-vCPU VM the latency of one small all-reduce flips between about 0.3 ms and
    about 3.5 ms (one scheduler tick, waiting behind a spinning thread) from run to run;
    pinned, it was about 3.8 ms in six runs in a row, 0.7 ms in a later one. The
    spinning thread is gloo's own event loop (:func:`quiet_gloo_loops`).
    """
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[process_id % len(cpus)]
    os.sched_setaffinity(0, {cpu})
    return cpu


# Linux x86-64 number of epoll_wait, and the arguments gloo's TCP event loop passes it
# (gloo/transport/tcp/loop.cc: ``epoll_wait(fd_, events.data(), 64, 10)``).
_EPOLL_WAIT = {"x86_64": 232}
_GLOO_LOOP_MAX_EVENTS, _GLOO_LOOP_TIMEOUT_MS = 64, 10


def gloo_loop_threads(attempts: int = 1) -> list[int]:
    """Thread ids of this process's gloo TCP event loops (one per gloo device; jaxlib's
    CPU client makes its device, and so starts the loop, when the backend starts).

    A loop is found by what it waits in: ``epoll_wait`` for 64 events with a 10 ms
    timeout (read from ``/proc/self/task/<tid>/syscall``). A loop that is running at
    the moment of the read is missed: up to ``attempts`` reads are made, 2 ms apart,
    until one finds a loop. Empty off Linux x86-64.
    """
    number = _EPOLL_WAIT.get(os.uname().machine)
    if number is None or not os.path.isdir("/proc/self/task"):
        return []
    for attempt in range(max(1, attempts)):
        if attempt:
            time.sleep(0.002)
        found = _waiting_in_epoll(number)
        if found:
            return found
    return []


def _waiting_in_epoll(number: int) -> list[int]:
    """Threads of this process waiting in syscall ``number`` as gloo's loop does."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/syscall").read_text().split()
        except OSError:
            continue
        if (len(fields) > 4 and fields[0] == str(number)
                and int(fields[3], 16) == _GLOO_LOOP_MAX_EVENTS
                and int(fields[4], 16) == _GLOO_LOOP_TIMEOUT_MS):
            out.append(int(tid))
    return sorted(out)


#: How :func:`quiet_gloo_loops` may schedule gloo's loop: the Linux policy of each name
#: (Linux's numbers where ``os`` lacks the names; no loop is ever found there).
LOOP_POLICIES = {"batch": getattr(os, "SCHED_BATCH", 3), "idle": getattr(os, "SCHED_IDLE", 5)}
#: What every gloo job of this project does with its loops unless told otherwise
#: (``disco bench --gloo-loop``, ``disco_jax.jit``'s ``DISCO_GLOO_LOOP``); ``"asis"``
#: leaves them as jaxlib starts them.
DEFAULT_LOOP_POLICY = "batch"
#: Every value a caller may choose: leave the loops, or one of :data:`LOOP_POLICIES`.
LOOP_CHOICES = ("asis", *LOOP_POLICIES)


def quiet_gloo_loops(policy: str = DEFAULT_LOOP_POLICY, attempts: int = 50) -> list[int]:
    """Moves this process's gloo event loops to ``SCHED_BATCH`` (or ``SCHED_IDLE``);
    returns their thread ids.

    Why: gloo's TCP loop wakes on every message and, at the default policy, preempts
    the thread it shares a CPU with; it then polls ``epoll`` without sleeping until the
    scheduler takes the CPU back, a slice lost to the compute and to the collective
    that would have consumed the message (likely because the preempted thread holds
    the connection's lock, which the loop only tries to take). Nice levels do not help
    (the loop still preempts); ``SCHED_BATCH``, which only stops wakeup preemption,
    does (``benchmarks/gloo_loop_policies.py``). On this 2-vCPU VM, 2 processes pinned
    to a CPU each (``benchmarks/gloo_loop_probe.py``): 16 dependent all-reduces of 16
    KiB take 6.2-7.9 ms (p90 22-32 ms) with the loop as jaxlib leaves it, 2.7-2.8 ms
    (p90 2.9-3.1 ms) at ``SCHED_BATCH`` and 2.7-2.9 ms at ``SCHED_IDLE``; with 4 small
    matmuls before each all-reduce 24-27 ms, 9.1-9.2 ms and 9.4-9.5 ms.

    Policies:
        ``"batch"`` (default): the loop keeps its fair share of the CPU but never
            preempts on wakeup; it runs when the CPU is free or the running thread's
            slice ends. Collectives in flight beside compute keep going: at 1 Gbit/s
            staged rnnlm and bert large keep their 1.27x and 1.32x over hand bucketing
            (``benchmarks/results/bench_large_1gbit_loop-batch.json``).
        ``"idle"``: the loop runs only when nothing else of the CPU wants to. Quietest,
            but a collective in flight beside compute stalls: at 1 Gbit/s the same
            models went to 1.00x and 0.99x (``bench_large_1gbit_loop-asis-vs-idle.json``),
            and an exact no-fusion program ran 129 ms against 44 ms.

    Call it after the backend has started (e.g. after ``jax.devices()``) in a process
    of a gloo job. Returns the loops it moved: an empty list where no loop was found
    (no gloo backend, or not Linux x86-64) or none could be moved; the process is then
    unchanged.

    Raises:
        ValueError: ``policy`` is not a key of :data:`LOOP_POLICIES`.
    """
    if policy not in LOOP_POLICIES:
        raise ValueError(f"unknown loop policy {policy!r}; valid: {', '.join(LOOP_POLICIES)}")
    moved = []
    for tid in gloo_loop_threads(attempts):
        try:
            os.sched_setscheduler(tid, LOOP_POLICIES[policy], os.sched_param(0))
        except OSError:  # the thread ended meanwhile
            continue
        moved.append(tid)
    return moved


# --------------------------------------------------------------------------- network


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a gloo coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local_job(argv: Callable[[int, str], Sequence[str]], num_processes: int, *,
                  timeout_s: float, env: Mapping[str, str] | None = None,
                  grace_s: float = 20.0,
                  failed: Callable[[Sequence[subprocess.Popen]], bool] | None = None,
                  raise_on_timeout: bool = False, cwd: str | Path | None = None,
                  port: int | None = None) -> list[int]:
    """Runs a ``jax.distributed`` job of ``num_processes`` processes on this machine and
    waits for it: process ``i`` runs ``argv(i, coordinator)``, the coordinator on
    ``127.0.0.1`` and a free port. The one launcher of every local job (``disco bench``'s,
    the benchmarks', ``disco calibrate``'s); a slow link is the caller's to set up first
    (:func:`set_loopback_rate`).

    Args:
        argv: the command of process ``i`` given the coordinator address.
        num_processes: processes of the job.
        timeout_s: the whole job's bound, seconds; the processes left are then killed.
        env: their environment (None: this process's).
        grace_s: once a process has failed, how long the others may still run.
        failed: when the others get ``grace_s`` (given the processes; default: one of
            them exited with a non-zero status).
        raise_on_timeout: raise instead of returning when processes were killed.
        cwd: their working directory.
        port: the coordinator's port (default: a free one, :func:`free_port`).

    Returns:
        Each process's exit status (``-9`` for those killed).

    Raises:
        TimeoutError: ``raise_on_timeout`` and some process had to be killed.
    """
    coordinator = f"127.0.0.1:{port or free_port()}"
    # each in its own session: a signal to the caller's process group does not reach the
    # job half-way; the caller ends it (the deadline, the grace after a failure)
    procs = [subprocess.Popen(list(argv(i, coordinator)), env=None if env is None else dict(env),
                              cwd=cwd, start_new_session=True) for i in range(num_processes)]
    check = failed or (lambda ps: any(p.poll() not in (None, 0) for p in ps))
    return wait_all(procs, time.monotonic() + timeout_s, lambda: check(procs),
                    grace_s=grace_s, raise_on_timeout=raise_on_timeout)


def in_private_netns(parent_netns: str) -> bool:
    """True if this process's network namespace differs from the parent's.

    Args:
        parent_netns: ``os.readlink("/proc/self/ns/net")`` of the parent, taken before it
            started this process under ``unshare -n``; "" is never private.
    """
    try:
        return bool(parent_netns) and os.readlink("/proc/self/ns/net") != parent_netns
    except OSError:
        return False


def set_loopback_rate(rate: str, parent_netns: str, burst: str = "1mb") -> str:
    """Brings ``lo`` up and limits it to ``rate`` (``tc`` ``tbf`` with the given burst,
    latency 100ms), or removes the limit (``rate == ""``).

    Only inside a private network namespace (see :func:`in_private_netns`): the host's
    network is never touched.

    Args:
        rate: a ``tc`` rate (``"1gbit"``), or "" for no limit.
        parent_netns: see :func:`in_private_netns`.
        burst: the token bucket's size (``tc`` size). While the link idles the bucket
            fills up to this many bytes, which then pass at memory speed.

    Returns:
        The output of ``tc qdisc show dev lo``.

    Raises:
        SystemExit: not in a private network namespace.
        subprocess.CalledProcessError: ``ip`` or ``tc`` failed.
    """
    if not in_private_netns(parent_netns):
        raise SystemExit("refusing to change lo outside a private network namespace "
                         "(run under `unshare -n`)")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
    if rate:
        subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate,
                        "burst", burst, "latency", "100ms"], check=True, timeout=10)
    else:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False, timeout=10,
                       capture_output=True)
    out = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], check=True, timeout=10,
                         capture_output=True, text=True)
    return out.stdout.strip()
