"""End-to-end simulator accuracy: predicted vs measured per-iteration time of real plans.

For every zoo model (``tiny``) and every setup (``gloo2``: two processes, gloo over TCP
on 127.0.0.1, one CPU device each; ``gloo2-1gbit``: the same with the loopback of a
private network namespace limited to 1 Gbit/s by ``tc``), the benchmark

1. **measures** XLA's default plan, the no-fusion plan and ``--plans`` random legal plans
   (:func:`hlo_tools.plan.random_moves`, seeded, ``--moves`` cycling over several
   counts so that the plans range from lightly to heavily fused) enacted with
   ``exact=True``. Both setups run in one gloo job per model (the job's private
   namespace switches its loopback limit between setups, so each program is compiled
   once per process), variants interleaved in shared random orders, ``--repeats`` samples each after
   warm-up; per sample the minimum over the two processes. Reported: median, p25, p75.
   See ``benchmarks/accuracy_worker.py`` for the details (barriers, traces, crash
   handling: a plan that aborts XLA:CPU is screened alone, reported, and replaced by
   the next seed).
2. **predicts** each variant with :class:`disco_estimator.costs.cost_model.CostModel` on the setup's
   hardware file: single-op times from the in-context profile of the no-fusion program
   (measured in the same job and setup: one traced iteration after each timed round,
   median over rounds, then over processes), then standalone timings
   (:mod:`disco_estimator.ops.standalone`, cached) for ops only XLA's plan has (the ops of its
   library fusions as the library runs them); plans through
   :func:`disco_estimator.costs.lower.sim_graph`, XLA's default from its post-optimization HLO as
   written (:func:`disco_estimator.costs.lower.sim_graph_from_module`).
3. **calibrates** the backend constants per setup -- overlap phi, per-kernel overhead
   ``kernel_launch_s`` (a small grid), and the AllReduce ``C``/``D`` *inside the real
   program* (``--fit-scale``: ``compute_scale`` too; by default it stays at the hardware
   file's 1, since op times are measured in the program's own context, and an in-sample
   fit with it free is reported as a diagnostic) -- by minimizing the mean absolute
   percentage error (MAPE, each model weighted equally) with Nelder-Mead from a linear
   least-squares start (:func:`disco_estimator.costs.constants_fit.fit_constants`), and reports the
   error three ways: with the hardware files as they are (``shipped``), **in-sample**
   (constants fitted on every model: what ``--write-config`` puts into the hardware
   files) and **leave-one-model-out** (each model predicted with constants fitted on
   the other models: the honest number).
   Two simulator models are compared: ``costs`` (:mod:`disco_estimator.costs.cost_model`: a
   combined, tuple-shaped all-reduce of XLA's plan pays one latency ``D`` per operand, as XLA:CPU's
   gloo collectives reduce each buffer separately) and the ablation
   ``one_d_per_allreduce`` (one ``D`` per all-reduce).

Per model and setup: MAPE mean and max, the Spearman rank correlation between
predicted and measured medians, and the pairs of variants that the measurement itself
separates (p25..p75 ranges apart) which the prediction orders right (Spearman also
counts the order of plans that tie within the noise); overall rows pool every variant. Writes
``benchmarks/results/simulator_accuracy.json`` atomically and prints the table.

Run from the repository root (as root: ``unshare -n`` and ``tc``)::

    python benchmarks/simulator_accuracy.py                      # all models
    python benchmarks/simulator_accuracy.py --quick --models vgg,bert
    python benchmarks/simulator_accuracy.py --reuse               # re-analyse stored runs
    python benchmarks/simulator_accuracy.py --reuse --write-config     # shipped files
    python benchmarks/simulator_accuracy.py --reuse --write-config DIR # DIR/<setup>.toml

Traces: ``--trace-model vgg --trace-setup gloo2 --trace-variant xla_default`` (the
default) also writes ``benchmarks/results/trace_measured_vgg.json`` (one measured
iteration, from the profiler trace of process 0, via
:func:`disco_estimator.ops.measured_chrome_trace`) and
``benchmarks/results/trace_simulated_vgg.json`` (the simulation of the same program with
the calibrated constants, via :func:`disco_estimator.costs.trace.write_trace`): open both in
https://ui.perfetto.dev (per device: tid 0 compute, tid 1 communication).

Raw measurements are kept per model in ``$DISCO_CACHE_DIR/accuracy`` (default
``~/.cache/disco_jax/accuracy``); ``--reuse`` analyses them again without measuring.
Compiled programs are kept in jax's persistent compilation cache next to them, which
only process 0 can use (see ``benchmarks/accuracy_worker.py``): every run compiles
about 12 programs per model in process 1, most of the run time on this machine.
``--regimes keep_awake`` (experimental) runs each job with one ``SCHED_IDLE`` busy loop
per CPU, so that idle vCPUs of this VM do not halt between collectives (see
``benchmarks/accuracy_worker.py``); in its one trial (vgg and bert, while other jobs
kept the machine busy) it did not narrow the spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from disco_estimator.costs.constants_fit import (
    BOUNDS,
    FREE_ALL,
    LAUNCH_GRID,
    Constants,
    FitCase,
    calibrated_hardware_text,
    fit_constants,
)
from disco_estimator.gloo import child_env, run_bounded
from disco_estimator.hardware import shipped_hardware_dir
from hlo_tools import dirs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.provenance import write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
#: The child processes' script, run by path (the repository on ``PYTHONPATH``).
WORKER = Path(__file__).resolve().with_name("accuracy_worker.py")
#: Where the benchmark writes its results unless told otherwise (relative to REPO).
DEFAULT_OUT = "benchmarks/results/simulator_accuracy.json"
DEFAULT_MODELS = ("vgg", "resnet", "transformer", "rnnlm", "rnnlm_unrolled", "bert",
                  "reformer")
SETUP_RATES = {"gloo2": "", "gloo2-1gbit": "1gbit"}
MOVES = (25, 50, 100, 200, 400)

__all__ = ["main", "measure_model", "variant_specs"]


def log(text: str) -> None:
    """A progress line on stderr."""
    print(f"[accuracy] {text}", file=sys.stderr, flush=True)


def write_json(path: str | os.PathLike[str], data: Any, indent: int | None = 1) -> Path:
    """Writes JSON atomically (temporary file + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=indent)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def raw_dir() -> Path:
    """Where raw measurements are kept (``$DISCO_CACHE_DIR/accuracy``)."""
    return dirs.cache_dir("accuracy")


# --------------------------------------------------------------------------- measuring


def variant_specs(plans: int, first_seed: int = 0) -> list[dict[str, Any]]:
    """XLA's default, the no-fusion plan and ``plans`` random plans (seeds from
    ``first_seed``, move counts cycling over :data:`MOVES`)."""
    out: list[dict[str, Any]] = [{"name": "xla_default", "kind": "xla_default"},
                                 {"name": "no_fusion", "kind": "plan", "moves": 0}]
    return out + [plan_spec(s) for s in range(first_seed, first_seed + plans)]


def plan_spec(seed: int) -> dict[str, Any]:
    """The random plan variant of one seed."""
    moves = MOVES[seed % len(MOVES)]
    return {"name": f"s{seed}_m{moves}", "kind": "plan", "seed": seed, "moves": moves}


def _worker_env(devices: int = 1) -> dict[str, str]:
    """The environment of a worker: CPU only, ``devices`` host devices, the repository
    first on ``PYTHONPATH`` (:func:`disco_estimator.gloo.child_env`)."""
    return child_env(devices, {"PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1"})


def _run_bounded(cmd: list[str], env: Mapping[str, str], timeout_s: float) -> int:
    """Runs ``cmd`` from the repository in its own process group (killed after
    ``timeout_s``); its exit code (``-9`` after a timeout)."""
    return run_bounded(cmd, env, timeout_s, cwd=REPO, check=False)


def _unfinished(progress: Path) -> list[str]:
    """Variants whose compile started but never finished, over every process."""
    out = []
    for f in sorted(progress.glob("p*.log")):
        started: list[str] = []
        for line in f.read_text().splitlines():
            what, _, name = line.partition(" ")
            if what == "start":
                started.append(name)
            elif name in started:
                started.remove(name)
        out += [n for n in started if n not in out]
    return out


def _screen(spec_path: Path, name: str, timeout_s: float) -> int:
    """Compiles one variant alone (two host devices); its exit code."""
    cmd = [sys.executable, str(WORKER), "screen", "--spec",
           str(spec_path), "--variant", name]
    return _run_bounded(cmd, _worker_env(2), timeout_s)


def _launch(spec_path: Path, out_dir: Path, timeout_s: float) -> int:
    netns = os.readlink("/proc/self/ns/net")
    cmd = ["unshare", "-n", sys.executable, str(WORKER), "launch",
           "--spec", str(spec_path), "--out-dir", str(out_dir), "--timeout",
           str(timeout_s - 10), "--parent-netns", netns]
    return _run_bounded(cmd, _worker_env(1), timeout_s)


def measure_model(model: str, opts: argparse.Namespace,
                  regime: str = "default") -> dict[str, Any]:
    """Runs one model's gloo job (relaunching without plans that abort XLA:CPU)."""
    variants = variant_specs(opts.plans)
    next_seed = opts.plans
    crashed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=f"disco_acc_{model}_") as tmp:
        tmpd = Path(tmp)
        for attempt in range(opts.max_attempts):
            spec = _job_spec(model, variants, opts, tmpd, regime)
            spec_path = write_json(tmpd / "spec.json", spec)
            progress = Path(spec["progress_dir"])
            shutil.rmtree(progress, ignore_errors=True)
            progress.mkdir()
            t0, load_before = time.monotonic(), os.getloadavg()
            rc = _launch(spec_path, tmpd, opts.timeout)
            if rc == 0:
                outs = [json.loads((tmpd / f"p{i}.json").read_text()) for i in range(2)]
                log(f"{model}: job took {time.monotonic() - t0:.0f} s")
                return {"model": model, "regime": regime, "spec": spec, "processes": outs,
                        "crashed": crashed, "load_avg_before": list(load_before),
                        "load_avg_after": list(os.getloadavg()),
                        "attempts": attempt + 1, "job_s": time.monotonic() - t0}
            suspects = _unfinished(progress)
            log(f"{model}: job failed (rc {rc}) after {time.monotonic() - t0:.0f} s; "
                f"unfinished compiles: {suspects}")
            bad = [n for n in suspects if _screen(spec_path, n, opts.timeout / 2) != 0]
            if not bad:
                raise RuntimeError(f"{model}: gloo job failed with rc {rc} and no variant "
                                   "crashed alone")
            for name in bad:
                log(f"{model}: {name} aborts XLA:CPU when compiled; replaced")
                crashed.append(next(v for v in variants if v["name"] == name))
                variants = [v for v in variants if v["name"] != name]
                variants.append(plan_spec(next_seed))
                next_seed += 1
    raise RuntimeError(f"{model}: gave up after {opts.max_attempts} attempts")


def _job_spec(model: str, variants: list[dict[str, Any]], opts: argparse.Namespace,
              tmpd: Path, regime: str = "default") -> dict[str, Any]:
    trace = None
    if model == opts.trace_model:
        trace = {"setup": opts.trace_setup, "variant": opts.trace_variant}
    return {"model": model, "size": opts.size, "num_processes": 2, "num_devices": 2,
            "variants": variants,
            "setups": [{"name": s, "rate": SETUP_RATES[s]} for s in opts.setups],
            "repeats": opts.repeats, "warmup": opts.warmup,
            "min_sample_s": opts.min_sample_ms * 1e-3,
            "profile_iterations": opts.profile_iterations, "trace": trace,
            "keep_awake": regime == "keep_awake", "pin_cpus": regime == "pinned",
            "cache_dir": str(opts.compile_cache), "progress_dir": str(tmpd / "progress")}


# --------------------------------------------------------------------------- loading


def merge_samples(per_process: Sequence[Sequence[float]]) -> list[float]:
    """Per sample, the minimum over processes (the last to arrive measures the iteration
    from the moment every participant is there)."""
    return [min(vals) for vals in zip(*per_process)]


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, p25 and p75 of a list of seconds (``n`` samples)."""
    import numpy as np

    a = np.asarray(samples, dtype=float)
    return {"median_s": float(np.median(a)), "p25_s": float(np.percentile(a, 25)),
            "p75_s": float(np.percentile(a, 75)), "n": int(a.size)}


@dataclasses.dataclass
class Measured:
    """One model in one setup: what was measured and what the simulator needs.

    Attributes:
        model: zoo model.
        setup: setup name (= hardware file).
        times: variant -> :func:`summarize` of the merged samples.
        module: the pre-optimization module (parsed from process 0's text).
        graph: its per-device graph.
        plans: plan variant -> its :class:`~hlo_tools.plan.Plan`.
        xla_module: XLA's post-optimization module of ``xla_default`` (None if missing).
        profile: the no-fusion program's in-context profile (process 0).
        stats: variant -> per traced iteration stats (process 0).
    """

    model: str
    setup: str
    times: dict[str, dict[str, float]]
    module: Any
    graph: Any
    plans: dict[str, Any]
    xla_module: Any
    profile: Any
    stats: dict[str, list[dict[str, float]]]


def _plan_from_json(data: Mapping[str, Any]) -> Any:
    from array import array

    from hlo_tools.plan import Plan

    order = array("i", data["order"])
    pos = array("i", [0] * len(order))
    for k, node in enumerate(order):
        pos[node] = k
    return Plan(order, pos, array("i", data["group"]),
                frozenset((int(p), int(g)) for p, g in data["dups"]))


def _program_profile(data: Mapping[str, Any]) -> Any:
    from disco_estimator.ops import ProgramProfile

    return ProgramProfile(
        data["module"], data["hlo_text"], dict(data["times_s"]),
        {int(d): v for d, v in data["per_device_s"].items()},
        {int(d): v for d, v in data["samples_s"].items()}, dict(data["counts"]),
        list(data["wall_times_s"]), list(data["trace_iteration_s"]))


def merged_profile(profiles: Sequence[Any]) -> Any:
    """One no-fusion profile from every process's: per instruction, the median of the
    processes' per-iteration times (each process runs the same program on its own CPU,
    so this halves the weight of one process's slow phase). None if there is none."""
    if not profiles:
        return None
    first = profiles[0]
    times = {name: statistics.median(p.times_s[name] for p in profiles if name in p.times_s)
             for name in first.times_s}
    return dataclasses.replace(first, times_s=times)


def load_measured(raw: Mapping[str, Any]) -> list[Measured]:
    """The per-setup views of one model's raw job output."""
    import hlo_tools
    from hlo_tools.baselines import module_from_compiled

    p0 = raw["processes"][0]
    module = hlo_tools.parse(p0["hlo_text"])
    graph = hlo_tools.device_graph(module)
    plans = {n: _plan_from_json(v["plan"]) for n, v in p0["variants"].items()
             if v.get("plan")}
    xla_text = p0.get("xla_default_text")
    xla_module = module_from_compiled(xla_text) if xla_text else None
    out = []
    for setup, s0 in p0["setups"].items():
        per = [p["setups"][setup]["samples_s"] for p in raw["processes"]]
        times = {n: summarize(merge_samples([p[n] for p in per])) for n in s0["samples_s"]}
        prof = merged_profile([_program_profile(p["setups"][setup]["program_profile"])
                               for p in raw["processes"]
                               if "program_profile" in p["setups"].get(setup, {})])
        out.append(Measured(raw["model"], setup, times, module, graph, plans, xla_module,
                            prof, s0.get("stats", {})))
    return out


# --------------------------------------------------------------------------- predicting


def _missing_ops(module: Any, times: Any) -> list[Any]:
    """Benchable kernel instructions of ``module`` whose op key has no time yet (one
    per key)."""
    from disco_estimator.ops import benchable_ops

    return [instr for key, (instr, _) in benchable_ops(module).items()
            if key not in times.times]


def op_times_for(m: Measured, bench: bool = True) -> Any:
    """Single-op times: the in-context no-fusion profile, then standalone timings
    (:mod:`disco_estimator.ops.standalone`, cached) of the ops the profile lacks (both
    modules; the ops inside XLA's library fusions are timed as the library runs them)."""
    from disco_estimator.ops import OpTimes, bench_ops

    times = OpTimes()
    if m.profile is not None:
        times.add_program_profile(m.profile, original=m.module)
    if bench:
        for module in (m.module, m.xla_module):
            if module is None:
                continue
            todo = _missing_ops(module, times)
            if todo:
                times.add_timings(bench_ops(module, todo, replicas=1, progress=False))
    return times


class Predictor:
    """Simulated per-iteration times of one model's variants in one setup.

    SimGraphs are built once per ``(kernel_launch_s, mem_s_per_byte)`` (the fused-op
    estimates depend on them); the other constants only rescale durations: compute
    nodes by ``compute_scale``, communication nodes are re-timed as
    ``c * bytes + d * operands`` (``operands`` is 1 unless ``tuple_latency``: then a
    combined tuple all-reduce of XLA's plan pays ``d`` per operand, as XLA:CPU's gloo
    collectives reduce each buffer separately); tiny ones (at most the hardware file's
    ``small_bytes``) as ``c * bytes + d_small_s``, as :mod:`disco_estimator.costs.cost_model` does.
    """

    def __init__(self, m: Measured, hardware: Any, op_times: Any, tuple_latency: bool = False):
        self.m = m
        self.hardware = hardware
        self.op_times = op_times
        self.tuple_latency = tuple_latency
        self._cache: dict[tuple[float, float], dict[str, tuple[Any, Any, Any, Any]]] = {}

    @property
    def names(self) -> list[str]:
        """Variants that can be predicted (measured and simulable)."""
        return [n for n in sorted(self.m.times)
                if n in self.m.plans or (n == "xla_default" and self.m.xla_module is not None)]

    def _cost_model(self, launch: float, mem: float) -> Any:
        from disco_estimator.costs.cost_model import BackendConstants, CostModel

        consts = BackendConstants(0.0, launch, mem, "simulator_accuracy", 1.0)
        return CostModel(self.hardware, op_times=self.op_times, constants=consts)

    def graphs(self, launch: float, mem: float) -> dict[str, tuple[Any, Any, Any, Any]]:
        """Variant -> ``(SimGraph, comm mask, comm bytes, comm operands)``."""
        key = (launch, mem)
        if key not in self._cache:
            from disco_estimator.costs.lower import sim_graph, sim_graph_from_module

            costs = self._cost_model(launch, mem)
            out = {}
            for name in self.names:
                if name == "xla_default":
                    sg = sim_graph_from_module(self.m.xla_module, costs)
                    ops = self._operands(sg, self.m.xla_module)
                else:
                    sg = sim_graph(self.m.graph, self.m.plans[name], costs)
                    ops = self._operands(sg, self.m.module)
                out[name] = (sg, sg.is_comm.copy(), sg.out_bytes.astype(float), ops)
            self._cache[key] = out
        return self._cache[key]

    def _operands(self, sg: Any, module: Any) -> Any:
        """Latencies each node pays, shape ``(2, nodes)``: row 0 counts ``D``, row 1
        ``d_small_s`` (buffers of at most ``small_bytes``). An all-reduce pays one per
        buffer if ``tuple_latency`` (a tuple has one buffer per operand), else one."""
        import numpy as np

        from hlo_tools.graph import device_graph

        small = self.hardware.allreduce.small_bytes
        ops = np.zeros((2, len(sg.names)))
        instrs = {i.name: i for i in device_graph(module).computation.instructions}
        for k in np.flatnonzero(sg.is_comm):
            instr = instrs.get(sg.names[k])
            if self.tuple_latency and instr is not None and instr.shape.is_tuple:
                sizes = [leaf.byte_size() for leaf in instr.shape.tuple_shapes]
            else:
                sizes = [int(sg.out_bytes[k])]
            tiny = sum(0 < b <= small for b in sizes)
            ops[:, k] = (max(len(sizes) - tiny, 0), tiny)
        return ops

    def sim(self, name: str, c: Constants) -> tuple[Any, Any]:
        """``(SimResult, SimGraph)`` of one variant under constants ``c``."""
        from disco_estimator.costs.simulator import simulate

        sg, comm, nbytes, ops = self.graphs(c.kernel_launch_s, c.mem_s_per_byte)[name]
        dur = sg.duration_s * c.compute_scale
        dur[comm] = (c.c_s_per_byte * nbytes[comm] + c.d_s * ops[0][comm]
                     + self.hardware.allreduce.d_small_s * ops[1][comm])
        graph = sg._replace(duration_s=dur)
        return simulate(graph, c.overlap, check=False), graph

    def predict(self, c: Constants) -> dict[str, float]:
        """Variant -> predicted seconds per iteration."""
        return {n: self.sim(n, c)[0].iteration_s for n in self.names}

    def comm_terms(self, c: Constants) -> dict[str, tuple[float, float]]:
        """Variant -> ``(bytes on the channel, latencies D paid)`` under ``c``'s
        ``kernel_launch_s`` and ``mem_s_per_byte`` (see
        :class:`disco_estimator.costs.constants_fit.FitCase`)."""
        out = {}
        for n, (_, comm, nbytes, ops) in self.graphs(c.kernel_launch_s,
                                                     c.mem_s_per_byte).items():
            out[n] = (nbytes[comm].sum(), ops[0][comm].sum())
        return out

    def case(self) -> FitCase:
        """This model's variants as a case of
        :func:`disco_estimator.costs.constants_fit.fit_constants`."""
        measured = {n: t["median_s"] for n, t in self.m.times.items()}
        return FitCase(measured, self.predict, self.comm_terms)


# --------------------------------------------------------------------------- scoring


def score(pred: Mapping[str, float], m: Measured) -> dict[str, Any]:
    """Absolute percentage errors per variant, their mean and max, and the Spearman rank
    correlation between predicted and measured medians."""
    names = [n for n in sorted(pred) if n in m.times]
    meas = [m.times[n]["median_s"] for n in names]
    prd = [pred[n] for n in names]
    errs = {n: abs(p - t) / t for n, p, t in zip(names, prd, meas)}
    return {"mape_mean": float(statistics.fmean(errs.values())),
            "mape_max": float(max(errs.values())), "spearman": spearman(prd, meas),
            **separated_pairs(pred, m), "ape": errs, "predicted_s": dict(zip(names, prd))}


def separated_pairs(pred: Mapping[str, float], m: Measured) -> dict[str, int]:
    """The ranking on the pairs that the measurement itself tells apart.

    Two variants are *separated* when their measured interquartile ranges (p25..p75 of
    the samples) do not overlap; such a pair is *ordered* when the prediction puts the
    faster one first. Variants whose ranges overlap are ties within the noise, whose
    order no model can be expected to get right (they still count in Spearman).
    """
    names = [n for n in sorted(pred) if n in m.times]
    sep = ordered = 0
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ta, tb = m.times[a], m.times[b]
            if ta["p75_s"] < tb["p25_s"] or tb["p75_s"] < ta["p25_s"]:
                sep += 1
                ordered += (pred[a] < pred[b]) == (ta["median_s"] < tb["median_s"])
    return {"separated_pairs": sep, "ordered_pairs": ordered}


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (None for fewer than 3 points or constant input)."""
    import numpy as np
    from scipy.stats import spearmanr

    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    return float(spearmanr(a, b).statistic)


def pooled(rows: Sequence[dict[str, Any]], ms: Sequence[Measured]) -> dict[str, Any]:
    """Every variant of several models together: MAPE mean/max, pooled Spearman and the
    mean of the per-model Spearman values."""
    errs = [e for r in rows for e in r["ape"].values()]
    prd = [p for r in rows for p in r["predicted_s"].values()]
    meas = [m.times[n]["median_s"] for r, m in zip(rows, ms) for n in r["predicted_s"]]
    rhos = [r["spearman"] for r in rows if r["spearman"] is not None]
    return {"mape_mean": float(statistics.fmean(errs)), "mape_max": float(max(errs)),
            "spearman_pooled": spearman(prd, meas),
            "spearman_mean": float(statistics.fmean(rhos)) if rhos else None,
            "separated_pairs": sum(r["separated_pairs"] for r in rows),
            "ordered_pairs": sum(r["ordered_pairs"] for r in rows),
            "variants": len(errs)}


# --------------------------------------------------------------------------- evaluating

#: The simulator models compared: ``costs`` is :mod:`disco_estimator.costs.cost_model` (a
#: combined, tuple-shaped all-reduce of XLA's plan pays the latency D once per operand);
#: ``one_d_per_allreduce`` is the ablation that charges it once per all-reduce.
SIM_MODELS = {"costs": True, "one_d_per_allreduce": False}


def evaluate_setup(setup: str, ms: Sequence[Measured], op_times: Sequence[Any],
                   tuple_latency: bool, lomo: bool = True,
                   free: Sequence[str] = ("overlap", "d_s")) -> dict[str, Any]:
    """Shipped, in-sample and leave-one-model-out errors of one setup for one simulator
    model; in-sample constants are fitted on every model, each held-out model's on the
    others."""
    from disco_estimator.hardware import load_hardware

    hw = load_hardware(setup)
    preds = [Predictor(m, hw, t, tuple_latency) for m, t in zip(ms, op_times)]
    shipped = Constants.from_hardware(hw)
    t0 = time.monotonic()
    fitted, obj = fit_constants([p.case() for p in preds], shipped, free)
    out: dict[str, Any] = {"shipped": _rows(preds, shipped),
                           "in_sample": _rows(preds, fitted) | {"objective": obj}}
    out["shipped"]["constants"] = shipped.to_json()
    out["in_sample"]["constants"] = fitted.to_json()
    if tuple(free) != FREE_ALL:  # diagnostic: every constant free
        every, every_obj = fit_constants([p.case() for p in preds], shipped, FREE_ALL)
        out["in_sample_all_free"] = {"constants": every.to_json(), "objective": every_obj,
                                     "overall": _rows(preds, every)["overall"]}
    if lomo and len(preds) > 2:
        out["lomo"] = _lomo(preds, shipped, free)
    out["free"] = list(free)
    out["fit_seconds"] = time.monotonic() - t0
    return out


def _rows(preds: Sequence[Predictor], c: Constants) -> dict[str, Any]:
    rows = {p.m.model: score(p.predict(c), p.m) for p in preds}
    return {"models": rows, "overall": pooled(list(rows.values()), [p.m for p in preds])}


def _lomo(preds: Sequence[Predictor], base: Constants,
          free: Sequence[str]) -> dict[str, Any]:
    """Each model predicted with constants fitted on the other models."""
    rows, consts = {}, {}
    for i, held in enumerate(preds):
        train = [p for j, p in enumerate(preds) if j != i]
        c, _ = fit_constants([p.case() for p in train], base, free)
        rows[held.m.model] = score(held.predict(c), held.m)
        consts[held.m.model] = c.to_json()
        log(f"  LOMO {held.m.setup} {held.m.model}: MAPE "
            f"{rows[held.m.model]['mape_mean'] * 100:.1f}%")
    return {"models": rows, "overall": pooled(list(rows.values()), [p.m for p in preds]),
            "constants": consts}


def diagnostics(m: Measured, pred: Predictor, c: Constants) -> dict[str, Any]:
    """Per variant: measured (traced, process 0) vs simulated compute and communication.

    ``compute_ratio`` = simulated kernel time / measured busy kernel time (the union of
    the kernels' intervals: a ``while`` thunk's event encloses its body's events): how
    well op times and the fused-op estimator describe the compiled program."""
    out = {}
    for name in pred.names:
        stats = m.stats.get(name) or []
        if not stats:
            continue
        _, graph = pred.sim(name, c)
        comp = float(graph.duration_s[~graph.is_comm].sum())
        comm = float(graph.duration_s[graph.is_comm].sum())
        meas_comp = statistics.median(s["compute_busy_s"] for s in stats)
        meas_comm = statistics.median(s["comm_sum_s"] for s in stats)
        out[name] = {"measured_compute_s": meas_comp, "simulated_compute_s": comp,
                     "compute_ratio": comp / meas_comp if meas_comp > 0 else None,
                     "measured_comm_s": meas_comm, "simulated_comm_s": comm,
                     "measured_kernels": statistics.median(s["kernels"] for s in stats),
                     "measured_span_s": statistics.median(s["span_s"] for s in stats),
                     "measured_comm_events": statistics.median(s["comm_events"]
                                                               for s in stats)}
    return out


# --------------------------------------------------------------------------- traces


def write_traces(raw: Mapping[str, Any], pred: Predictor, c: Constants, out_dir: Path,
                 setup: str) -> list[Path]:
    """``trace_measured_<model>.json`` (process 0's traced iteration) and
    ``trace_simulated_<model>.json`` (the same program simulated with ``c``)."""
    from disco_estimator.costs.trace import write_trace
    from disco_estimator.ops import OpEvent, measured_chrome_trace

    trace = raw["processes"][0]["setups"].get(setup, {}).get("trace")
    if not trace or trace["variant"] not in pred.names:
        log(f"no measured trace of {raw['model']} in {setup}; traces not written")
        return []
    model, variant = raw["model"], trace["variant"]
    events = [OpEvent(**e) for e in trace["events"]]
    measured = measured_chrome_trace(events, comm=trace["comm"],
                                     label=f"{model} {variant} {setup} (measured, process 0)")
    paths = [write_json(out_dir / f"trace_measured_{model}.json", measured, indent=None)]
    result, graph = pred.sim(variant, c)
    paths.append(write_trace(out_dir / f"trace_simulated_{model}.json", result, graph,
                             label=f"{model} {variant} {setup} (simulated)"))
    return paths


# --------------------------------------------------------------------------- hardware files


def provenance(sim_model: str, results: str = DEFAULT_OUT) -> list[str]:
    """The comment written above the calibrated ``[costs]`` table (see
    :func:`disco_estimator.costs.constants_fit.costs_table`): where the constants come from
    (``results``: the JSON that holds the errors)."""
    return [
        "calibrated inside real training steps by",
        f"benchmarks/simulator_accuracy.py ({sim_model} simulator model, fitted on every",
        f"measured zoo model; {results} has the",
        "leave-one-model-out errors). The microbenchmark fit is kept as [allreduce]",
        "microbenchmark_c_s_per_byte / microbenchmark_d_s. Rerunning",
        "benchmarks/allreduce_fit.py --write-config rewrites this file without them.",
    ]


def write_config(setup: str, c: Constants, sim_model: str, free: Sequence[str],
                 directory: Path | None = None, results: str = DEFAULT_OUT) -> Path:
    """Writes the calibrated constants into ``<directory>/<setup>.toml`` atomically: the
    hardware file with a ``[costs]`` table and the in-program AllReduce ``C``/``D``
    (previous values kept as ``microbenchmark_*`` keys), see
    :func:`disco_estimator.costs.constants_fit.calibrated_hardware_text`.

    Args:
        setup: the setup (= hardware file name).
        c: the calibrated constants.
        sim_model: the simulator model they were fitted with (named in the comment).
        free: the fitted constants' names.
        directory: where to write (default: the folder of the hardware files shipped
            with the package, :func:`disco_estimator.hardware.shipped_hardware_dir`). The file
            rewritten is ``<directory>/<setup>.toml`` if it exists, else the one
            :func:`disco_estimator.hardware.load_hardware` finds for ``setup``.
        results: the results JSON named in the comment.

    Returns:
        The written path.
    """
    from disco_estimator.hardware import find_hardware, load_hardware, write_hardware_text

    directory = Path(directory) if directory is not None else shipped_hardware_dir()
    path = directory / f"{setup}.toml"
    source = path if path.is_file() else find_hardware(setup)
    hw = load_hardware(source)
    text = calibrated_hardware_text(source.read_text(), hw.raw, c, free,
                                    provenance(sim_model, results))
    return write_hardware_text(setup, text, directory)


# --------------------------------------------------------------------------- report


def _pct(x: float | None) -> str:
    return "   -  " if x is None else f"{x * 100:5.1f}%"


def _rho(x: float | None) -> str:
    return "   - " if x is None else f"{x:5.2f}"


def _cell(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return f"{'':21}"
    rho = row.get("spearman", row.get("spearman_mean"))
    return f"{_pct(row['mape_mean'])} {_pct(row['mape_max'])} {_rho(rho)}"


def _pairs(row: Mapping[str, Any]) -> str:
    return f"{row['ordered_pairs']:>3}/{row['separated_pairs']:<3}"


def print_table(result: Mapping[str, Any]) -> None:
    """Per simulator model: per model x setup MAPE mean/max and Spearman, shipped,
    in-sample and leave-one-model-out, then the overall rows."""
    for sim_model, per_setup in result["evaluation"].items():
        print(f"\nsimulator model: {sim_model}   (MAPE mean, MAPE max, Spearman)")
        print(f"{'model':16} {'setup':12} {'n':>3} {'measured ms':>15}  "
              f"{'shipped constants':21}  {'in-sample fit':21}  {'leave-one-model-out':21}"
              f"  {'pairs':>7}")
        for setup, ev in per_setup.items():
            for model, row in ev["in_sample"]["models"].items():
                times = [result["measured"][model][setup][n]["median_s"] * 1e3
                         for n in row["ape"]]
                rng = f"{min(times):6.1f}-{max(times):6.1f}"
                lomo = ev.get("lomo", {}).get("models", {}).get(model)
                print(f"{model:16} {setup:12} {len(times):3} {rng:>15}  "
                      f"{_cell(ev['shipped']['models'][model])}  {_cell(row)}  {_cell(lomo)}"
                      f"  {_pairs(lomo or row)}")
            lomo = ev.get("lomo", {}).get("overall")
            print(f"{'overall':16} {setup:12} {ev['in_sample']['overall']['variants']:3} "
                  f"{'':>15}  {_cell(ev['shipped']['overall'])}  "
                  f"{_cell(ev['in_sample']['overall'])}  {_cell(lomo)}"
                  f"  {_pairs(lomo or ev['in_sample']['overall'])}")
        for setup, ev in per_setup.items():
            c = ev["in_sample"]["constants"]
            print(f"  {setup}: in-sample constants: phi {c['overlap']:.3f}, kernel_launch "
                  f"{c['kernel_launch_s'] * 1e6:.2f} us, compute_scale {c['compute_scale']:.3f},"
                  f" C {c['c_s_per_byte']:.3g} s/B, D {c['d_s'] * 1e3:.3f} ms")
    print("\n(overall Spearman: mean of the per-model values; pooled values in the JSON;"
          "\n pairs: of the variant pairs whose measured p25..p75 ranges do not overlap,"
          "\n how many the leave-one-model-out prediction orders right)")


# --------------------------------------------------------------------------- main


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help="comma-separated zoo models (default: every shard_map model)")
    ap.add_argument("--setups", default="gloo2,gloo2-1gbit",
                    help=f"comma-separated, from {', '.join(SETUP_RATES)}")
    ap.add_argument("--plans", type=int, default=10, help="random plans per model")
    ap.add_argument("--size", default="tiny", help="zoo size")
    ap.add_argument("--quick", action="store_true", help="fewer repeats (7 instead of 15)")
    ap.add_argument("--repeats", type=int, default=None, help="timed samples per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per variant")
    ap.add_argument("--min-sample-ms", type=float, default=20.0,
                    help="each sample averages enough back-to-back iterations to last this")
    ap.add_argument("--profile-iterations", type=int, default=3,
                    help="traced iterations per variant and setup")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per gloo job")
    ap.add_argument("--max-attempts", type=int, default=5,
                    help="relaunches per model after plans that abort XLA:CPU")
    ap.add_argument("--regimes", default="default",
                    help="comma-separated: default (the machine as it is), keep_awake "
                         "(one SCHED_IDLE busy loop per CPU during each job, so that idle "
                         "vCPUs do not halt) and/or pinned (each gloo process on a CPU of "
                         "its own); see benchmarks/accuracy_worker.py")
    ap.add_argument("--reuse", action="store_true",
                    help="analyse the stored raw measurements instead of measuring")
    ap.add_argument("--no-lomo", action="store_true", help="skip leave-one-model-out fits")
    ap.add_argument("--fit-scale", action="store_true",
                    help="fit compute_scale too (default: keep the hardware file's value, 1 "
                         "for gloo2: op times are measured in the program's own context)")
    ap.add_argument("--fit-c", action="store_true",
                    help="fit the AllReduce C too (default: keep the microbenchmark's C, "
                         "which large messages determine; the zoo's tiny gradients do not)")
    ap.add_argument("--no-bench", action="store_true",
                    help="no standalone op timings (profile and analytic model only)")
    ap.add_argument("--write-config", nargs="?", type=Path, const=shipped_hardware_dir(),
                    default=None,
                    metavar="DIR",
                    help="write the in-sample constants (costs model) into DIR/<setup>.toml "
                         "(without DIR: the hardware files shipped with the package, "
                         "disco_estimator/hardware_files in a checkout)")
    ap.add_argument("--trace-model", default="vgg", help="model whose traces are written")
    ap.add_argument("--trace-setup", default="gloo2", help="setup of the traces")
    ap.add_argument("--trace-variant", default="xla_default", help="variant of the traces")
    ap.add_argument("--out", type=Path, default=REPO / DEFAULT_OUT)
    ap.add_argument("--compile-cache", type=Path, default=None,
                    help="jax persistent compilation cache (default: next to the raw data)")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.setups = [s for s in args.setups.split(",") if s]
    unknown = [s for s in args.setups if s not in SETUP_RATES]
    if unknown:
        ap.error(f"unknown setups {unknown}; choose from {', '.join(SETUP_RATES)}")
    args.regimes = [r for r in args.regimes.split(",") if r]
    if not args.regimes or any(r not in REGIMES for r in args.regimes):
        ap.error(f"--regimes: choose from {', '.join(REGIMES)}")
    args.repeats = args.repeats or (7 if args.quick else 15)
    args.free = ("overlap",) + ("compute_scale",) * args.fit_scale + (
        "c_s_per_byte",) * args.fit_c + ("d_s",)
    args.compile_cache = args.compile_cache or raw_dir().parent / "jax_cache"
    return args


REGIMES = ("default", "keep_awake", "pinned")


def _raw(model: str, args: argparse.Namespace, regime: str) -> dict[str, Any]:
    """One model's raw measurements: stored ones with ``--reuse``, else a new job."""
    path = raw_dir() / ("" if regime == "default" else regime) / f"{model}.json"
    if args.reuse:
        return json.loads(path.read_text())
    raw = measure_model(model, args, regime)
    write_json(path, raw, indent=None)
    return raw


def _measured_table(raws: Sequence[Mapping[str, Any]],
                    ms: Sequence[Measured]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in ms:
        raw = next(r for r in raws if r["model"] == m.model)
        p0 = raw["processes"][0]
        ks = p0["setups"][m.setup]["k"]
        rows = {}
        for n, t in m.times.items():
            info = p0["variants"].get(n, {})
            rows[n] = t | {"k": ks.get(n), "loss": info.get("loss"),
                           "compile_s": info.get("compile_s")}
        out.setdefault(m.model, {})[m.setup] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    """Measures, predicts, calibrates, writes the JSON and prints the table."""
    args = _parse_args(argv)
    t_start = time.monotonic()
    result: dict[str, Any] = {"meta": {}, "regimes": {}}
    all_raws = []
    for regime in args.regimes:
        raws = []
        for model in args.models:
            log(f"{model}: {'loading' if args.reuse else 'measuring'} ({regime})")
            raws.append(_raw(model, args, regime))
        all_raws += raws
        result["regimes"][regime] = analyse(raws, args, primary=regime == args.regimes[0])
    result["meta"] = _meta(args, all_raws)
    result["meta"]["total_seconds"] = time.monotonic() - t_start
    write_result(args.out, result)
    for regime, res in result["regimes"].items():
        print(f"\n=== regime: {regime} ===")
        print_table(res)
    log(f"wrote {args.out} ({result['meta']['total_seconds']:.0f} s)")
    return 0


def analyse(raws: Sequence[Mapping[str, Any]], args: argparse.Namespace,
            primary: bool) -> dict[str, Any]:
    """Predictions, calibration and errors of one regime's measurements; the primary
    regime also writes the traces (and, with ``--write-config``, the hardware files)."""
    t0 = time.monotonic()
    ms = [m for r in raws for m in load_measured(r) if m.setup in args.setups]
    log("op times (in-context profiles; standalone timings for the rest)")
    op_times = {(m.model, m.setup): op_times_for(m, not args.no_bench) for m in ms}
    out: dict[str, Any] = {"measured": _measured_table(raws, ms), "evaluation": {},
                           "diagnostics": {},
                           "job_seconds": {r["model"]: r.get("job_s") for r in raws},
                           "load_avg": {r["model"]: [r.get("load_avg_before"),
                                                     r.get("load_avg_after")] for r in raws},
                           "crashed_plans": {r["model"]: r.get("crashed", []) for r in raws}}
    for sim_model, tuple_latency in SIM_MODELS.items():
        out["evaluation"][sim_model] = {}
        for setup in args.setups:
            sel = [m for m in ms if m.setup == setup]
            log(f"calibrating {setup} ({sim_model})")
            out["evaluation"][sim_model][setup] = evaluate_setup(
                setup, sel, [op_times[(m.model, setup)] for m in sel], tuple_latency,
                lomo=not args.no_lomo, free=args.free)
    _finish(out, raws, ms, op_times, args, primary)
    out["analysis_seconds"] = time.monotonic() - t0
    return out


def _finish(result: dict[str, Any], raws: Sequence[Mapping[str, Any]], ms: Sequence[Measured],
            op_times: Mapping[tuple[str, str], Any], args: argparse.Namespace,
            primary: bool) -> None:
    """Diagnostics, traces and hardware files from the costs model's in-sample fit."""
    from disco_estimator.hardware import load_hardware

    for setup in args.setups:
        fitted = Constants(**result["evaluation"]["costs"][setup]["in_sample"]["constants"])
        hw = load_hardware(setup)
        for m in (m for m in ms if m.setup == setup):
            pred = Predictor(m, hw, op_times[(m.model, setup)], tuple_latency=True)
            result["diagnostics"].setdefault(m.model, {})[setup] = diagnostics(m, pred, fitted)
            if primary and m.model == args.trace_model and setup == args.trace_setup:
                raw = next(r for r in raws if r["model"] == m.model)
                for path in write_traces(raw, pred, fitted, args.out.parent, setup):
                    log(f"wrote {path}")
        if primary and args.write_config is not None:
            path = write_config(setup, fitted, "costs", args.free, args.write_config,
                                results=_shown(args.out))
            log(f"wrote {path}")


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it."""
    try:
        return str(path.resolve().relative_to(REPO.resolve()))
    except ValueError:
        return str(path)


def _meta(args: argparse.Namespace, raws: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    import platform

    return {"models": args.models, "setups": args.setups, "size": args.size,
            "plans": args.plans, "moves_cycle": list(MOVES), "repeats": args.repeats,
            "warmup": args.warmup, "min_sample_ms": args.min_sample_ms,
            "fitted_constants": list(args.free), "bounds": BOUNDS,
            "launch_grid_s": list(LAUNCH_GRID),
            "reused_measurements": args.reuse, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "load_avg": list(os.getloadavg()),
            "regimes": args.regimes,
            "measured_models": sorted({r["model"] for r in raws}),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "statistic": "per sample min over the 2 processes; median over samples",
            "setups_note": "both setups run in one private network namespace per model: "
                           "gloo2 = its loopback without qdisc, gloo2-1gbit = tbf rate 1gbit "
                           "burst 1mb latency 100ms"}


if __name__ == "__main__":
    sys.exit(main())
