"""Child processes of the AllReduce microbenchmarks (``python -m disco_estimator._gloo_worker``).

``measure``: measures psum in this process (``--devices N`` host devices, or one device
of a gloo job with ``--coordinator/--num-processes/--process-id``) and writes the points
as JSON; with ``--probes`` also the in-program latency and overlap probes
(:mod:`disco_estimator.probes`). ``launch``: starts a gloo job of ``measure`` workers on a free
127.0.0.1 port, optionally first limiting the loopback with ``tc`` (only allowed inside a
private network namespace, i.e. under ``unshare -n``), bounds it in time and merges the
results. The process and network helpers are those of :mod:`disco_estimator.gloo`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from disco_estimator.gloo import free_port, pin_to_own_cpu, run_local_job, set_loopback_rate


def _log(tag: str, text: str) -> None:
    print(f"[{tag}] {text}", file=sys.stderr, flush=True)


def _facts() -> dict[str, Any]:
    import jax

    return {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "num_devices": jax.device_count(), "local_devices": jax.local_device_count(),
            "num_processes": jax.process_count(), "jax_version": jax.__version__,
            "host_cpus": os.cpu_count() or 0}


def _measure(args: argparse.Namespace) -> None:
    if args.pin_cpus:
        pin_to_own_cpu(args.process_id)
    import jax

    if args.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=60)
    from disco_estimator.allreduce import measure_psum

    expected = args.num_processes if args.coordinator else args.devices
    if jax.device_count() != expected:
        raise SystemExit(f"expected {expected} devices, got {jax.device_count()}")
    sizes = [int(s) for s in args.sizes.split(",")]
    show = args.process_id == 0 and not args.silent
    tag = f"{args.tag} p0" if args.coordinator else args.tag
    points = measure_psum(sizes, quick=args.quick,
                          progress=(lambda s: _log(tag, s)) if show else None)
    result = {"facts": _facts(), "processes": [[p.to_json() for p in points]]}
    if args.probes:
        from disco_estimator.probes import measure_probes

        if show:
            _log(tag, "probes: in-program all-reduce latency and overlap")
        share = None
        if args.coordinator:
            import numpy as np
            from jax.experimental import multihost_utils

            def share(k: int) -> int:
                return int(multihost_utils.broadcast_one_to_all(np.int32(k)))
        result["probes"] = [measure_probes(repeats=9 if args.quick else 15,
                                           share=share).to_json()]
    Path(args.out).write_text(json.dumps(result))
    if args.coordinator:
        jax.distributed.shutdown()


def _launch(args: argparse.Namespace) -> None:
    qdisc = set_loopback_rate(args.rate, args.parent_netns) if args.rate else ""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="disco_gloo_") as tmp:
        outs = [Path(tmp) / f"p{i}.json" for i in range(args.num_processes)]
        try:
            rcs = run_local_job(lambda i, coordinator: _worker_cmd(args, coordinator, i, outs[i]),
                                args.num_processes, timeout_s=args.timeout,
                                failed=lambda procs: False, raise_on_timeout=True,
                                port=port)
        except TimeoutError:
            raise SystemExit(124) from None
        if any(rcs):
            raise SystemExit(f"gloo workers exited with {rcs}")
        results = [json.loads(o.read_text()) for o in outs]
    facts = dict(results[0]["facts"], port=port, rate=args.rate or "", qdisc=qdisc)
    merged = {"facts": facts, "processes": [r["processes"][0] for r in results]}
    if args.probes:
        merged["probes"] = [r["probes"][0] for r in results]
    Path(args.out).write_text(json.dumps(merged))


def _worker_cmd(args: argparse.Namespace, coordinator: str, i: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "disco_estimator._gloo_worker", "measure", "--out", str(out),
            "--tag", args.tag, "--sizes", args.sizes, "--coordinator", coordinator,
            "--num-processes", str(args.num_processes), "--process-id", str(i)] + (
                ["--quick"] * args.quick) + (["--silent"] * args.silent) + (
                ["--pin-cpus"] * args.pin_cpus) + (["--probes"] * args.probes)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m disco_estimator._gloo_worker")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("measure", "launch"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--sizes", required=True, help="comma-separated bytes per device")
        p.add_argument("--tag", default="allreduce")
        p.add_argument("--quick", action="store_true")
        p.add_argument("--silent", action="store_true")
        p.add_argument("--num-processes", type=int, default=1)
        p.add_argument("--pin-cpus", action="store_true",
                       help="pin each process to a CPU of its own")
        p.add_argument("--probes", action="store_true",
                       help="also run the latency and overlap probes (disco_estimator.probes)")
    m = sub.choices["measure"]
    m.add_argument("--devices", type=int, default=1)
    m.add_argument("--coordinator", default="")
    m.add_argument("--process-id", type=int, default=0)
    la = sub.choices["launch"]
    la.add_argument("--rate", default="", help="tc rate limit of lo, e.g. 1gbit")
    la.add_argument("--timeout", type=float, default=300.0, help="seconds")
    la.add_argument("--parent-netns", default="",
                    help="readlink /proc/self/ns/net of the caller; --rate needs a different one")
    args = ap.parse_args(argv)
    _measure(args) if args.cmd == "measure" else _launch(args)


if __name__ == "__main__":
    main()
