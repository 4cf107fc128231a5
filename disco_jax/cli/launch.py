"""``disco launch -n N [--port P] [--timeout S] -- python script.py ...``: a local job.

Starts N processes of the command on this machine, each a CPU-only jax process
(``JAX_PLATFORMS=cpu``, one host device each unless ``--devices-per-process``), with gloo
collectives and the coordinator on ``127.0.0.1:P`` (a free port by default). Each process
finds its place in the job in the environment:

* ``DISCO_COORDINATOR`` (``127.0.0.1:P``), ``DISCO_NUM_PROCESSES`` (N),
  ``DISCO_PROCESS_ID`` (0 .. N-1): read by
  :func:`disco_jax.activator.initialize_from_env`, which the script calls before any
  other jax call (``examples/train.py`` does);
* the same under jax's own names (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
  ``JAX_PROCESS_ID``) for scripts that call ``jax.distributed.initialize`` themselves.

The job is bounded: after ``--timeout`` seconds, or 20 s after a process failed, the rest
are killed (each process runs in its own process group). The exit code is that of the
first process to fail (0 when all succeed; 124 after a timeout). Output of process ``i``
goes to this terminal, each line prefixed with ``[i]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from disco_jax.cli import EXIT_INTERRUPTED, UserError

__all__ = ["launch", "register"]

#: What ``disco launch --help`` says (the module docstring is for developers).
HELP = """Run a command as an N-process jax job on this machine (CPU, gloo).

Starts N processes of the command, one host CPU device each (--devices-per-process), with
the coordinator on 127.0.0.1 and a free port. Each process finds its place in the job in
DISCO_COORDINATOR, DISCO_NUM_PROCESSES and DISCO_PROCESS_ID (and jax's own names); the
script calls disco_jax.activator.initialize_from_env() before its first jax call. Output
lines are prefixed with [i]. After --timeout seconds, or 20 s after a process failed, the
rest are killed; the exit code is the first failure's (124 after a timeout)."""

#: Examples, after the options in ``--help``.
EXAMPLES = """example:
  ENABLE_SEARCH=1 disco launch -n 2 -- python examples/train.py"""

#: Exit code after the job ran past ``--timeout``.
EXIT_TIMEOUT = 124
#: Seconds the other processes get after one failed.
GRACE_S = 20.0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``disco launch``."""
    p = subparsers.add_parser(
        "launch", help="run a command as an N-process local jax job (gloo on CPU)",
        description=HELP, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--num-processes", type=int, required=True,
                   help="processes of the job")
    p.add_argument("--port", type=int, default=None,
                   help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--devices-per-process", type=int, default=1,
                   help="host CPU devices of each process (default 1)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="kill the job after this many seconds (default 3600)")
    p.add_argument("cmd", nargs=argparse.REMAINDER,
                   help="the command after '--', e.g. -- python examples/train.py")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UserError("give the command after '--', e.g. disco launch -n 2 -- python "
                        "examples/train.py")
    if args.num_processes < 1:
        raise UserError(f"-n must be >= 1, got {args.num_processes}")
    if args.devices_per_process < 1:
        raise UserError(f"--devices-per-process must be >= 1, got {args.devices_per_process}")
    if args.port is not None and not 0 < args.port < 65536:
        raise UserError(f"--port {args.port} is not a TCP port")
    if not args.timeout > 0:
        raise UserError(f"--timeout must be > 0 seconds, got {args.timeout}")
    try:
        return launch(cmd, args.num_processes, port=args.port, timeout_s=args.timeout,
                      devices_per_process=args.devices_per_process)
    except FileNotFoundError as err:
        raise UserError(f"cannot start {cmd[0]!r}: {err}") from None


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.buffer.write(prefix.encode() + line)
        out.flush()
    stream.close()


def launch(cmd: Sequence[str], num_processes: int, *, port: int | None = None,
           timeout_s: float = 3600.0, devices_per_process: int = 1,
           prefix_output: bool = True) -> int:
    """Runs ``cmd`` as an N-process local job; returns the job's exit code.

    Args:
        cmd: the command of every process.
        num_processes: N.
        port: the coordinator's port on 127.0.0.1 (None: a free one).
        timeout_s: bound on the whole job, seconds.
        devices_per_process: host CPU devices of each process.
        prefix_output: prefix each output line with ``[i] `` (else pass it through).

    Returns:
        0 when every process exits with 0; else the exit code of the first process to
        fail (``124`` when the job ran past ``timeout_s``; ``130`` after Ctrl-C).
    """
    from disco_estimator.gloo import child_env, free_port

    port = port or free_port()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    first_failure: int | None = None
    try:
        for i in range(num_processes):
            extra = {"DISCO_COORDINATOR": f"127.0.0.1:{port}",
                     "DISCO_NUM_PROCESSES": str(num_processes), "DISCO_PROCESS_ID": str(i),
                     "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                     "JAX_NUM_PROCESSES": str(num_processes), "JAX_PROCESS_ID": str(i),
                     "PYTHONUNBUFFERED": "1"}
            child = child_env(devices_per_process, extra)
            pipe = subprocess.PIPE if prefix_output else None
            proc = subprocess.Popen(list(cmd), env=child, start_new_session=True,
                                    stdout=pipe, stderr=subprocess.STDOUT if pipe else None)
            procs.append(proc)
            if prefix_output:
                t = threading.Thread(target=_pump, args=(proc.stdout, f"[{i}] ", sys.stdout),
                                     daemon=True)
                t.start()
                pumps.append(t)
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            for p in procs:
                rc = p.poll()
                if rc not in (None, 0) and first_failure is None:
                    first_failure = rc
                    deadline = min(deadline, time.monotonic() + GRACE_S)
            if time.monotonic() > deadline:
                if first_failure is None:
                    first_failure = EXIT_TIMEOUT
                    print(f"disco launch: the job ran past {timeout_s:g} s; killing it",
                          file=sys.stderr)
                break
            time.sleep(0.1)
        for p in procs:
            if p.returncode not in (None, 0) and first_failure is None:
                first_failure = p.returncode
    except KeyboardInterrupt:
        first_failure = EXIT_INTERRUPTED
    finally:
        _kill_all(procs)
        for t in pumps:
            t.join(timeout=5)
    if first_failure is None:
        return 0
    return first_failure if first_failure > 0 else 128 - first_failure


def _kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """Kills the process group of every process still running (each has its own)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()
