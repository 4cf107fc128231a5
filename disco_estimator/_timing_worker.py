"""Child process of :class:`disco_estimator.ops.standalone.PinnedTimer`:
``python -m disco_estimator._timing_worker``.

Pins itself to one CPU (``--cpu``: an index into the CPUs it may use) *before* jax
starts, so that XLA:CPU's client and every thread it starts run on that CPU, then serves
requests, one JSON object per line on stdin, until stdin closes:

``{"replicas", "repeats", "warmup", "jobs": [TimingJob.to_json(), ...]}`` ->
``{"samples": {module_name: [seconds, ...]}, "errors": {module_name: why}, "cpus": [the
CPUs it runs on]}`` on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disco_estimator._timing_worker")
    parser.add_argument("--cpu", type=int, default=0)
    args = parser.parse_args(argv)
    from disco_estimator.gloo import pin_to_own_cpu

    pin_to_own_cpu(args.cpu)  # before jax starts: XLA's threads inherit it
    from disco_estimator.ops.standalone import TimingJob, run_jobs

    out = sys.stdout
    sys.stdout = sys.stderr  # anything else printed must not corrupt the replies
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        samples, errors = run_jobs([TimingJob.from_json(j) for j in request["jobs"]],
                                   replicas=int(request["replicas"]),
                                   repeats=int(request["repeats"]),
                                   warmup=int(request["warmup"]))
        out.write(json.dumps({"samples": samples, "errors": errors,
                              "cpus": sorted(os.sched_getaffinity(0))}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
