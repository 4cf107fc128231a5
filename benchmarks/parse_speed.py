"""Parse and print throughput of ``hlo_tools`` on synthetic and real modules.

Prints a table (module, instructions, parse s, print s, instr/s) and writes
``benchmarks/results/parse_speed.json``. Each figure is the best of ``--repeats`` runs,
timed both by the wall clock and by the CPU time of this process (``time.process_time``),
which other jobs on a shared machine disturb less. Each row names the parser backend
that ran (``c``: the fast mode's C kernel; ``python``: the pure-Python loop), which
``--backend`` (or ``$DISCO_PARSE_BACKEND``) selects. Run from the repository root:

    python benchmarks/parse_speed.py [--sizes 1000,10000,100000] [--zoo MODEL ...]
        [--repeats N] [--backend auto|c|python]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import hlo_tools  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402
from hlo_tools.parser import parse_backend  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


def synthetic_module(n: int) -> str:
    """A chain-and-skip module of ``n`` instructions with realistic attributes."""
    lines = ["HloModule synthetic, entry_computation_layout={(f32[64,64]{1,0})->f32[64,64]{1,0}}",
             "", "add_f32 {", "  a = f32[] parameter(0)", "  b = f32[] parameter(1)",
             "  ROOT s = f32[] add(a, b)", "}", "", "ENTRY main {",
             "  p0 = f32[64,64]{1,0} parameter(0)"]
    prev, k = ["p0"], 1
    ops = ["add", "multiply", "subtract", "maximum"]
    while k < n - 1:
        a, b = prev[-1], prev[-min(len(prev), 3)]
        if k % 10 == 0:
            lines.append(f"  v{k} = f32[64,64]{{1,0}} dot({a}, {b}), lhs_contracting_dims={{1}}, "
                         f'rhs_contracting_dims={{0}}, metadata={{op_name="jit(f)/dot_general" '
                         f'source_file="/x/model.py" source_line={k}}}')
        elif k % 7 == 0:
            lines.append(f"  v{k} = f32[64,64]{{1,0}} all-reduce({a}), channel_id={k}, "
                         "replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=add_f32")
        else:
            lines.append(f"  v{k} = f32[64,64]{{1,0}} {ops[k % 4]}({a}, {b})")
        prev.append(f"v{k}")
        k += 1
    lines += [f"  ROOT out = f32[64,64]{{1,0}} negate({prev[-1]})", "}", ""]
    return "\n".join(lines)


def measure(name: str, text: str, repeats: int = 5) -> dict:
    """Best-of-``repeats`` wall and CPU times of parsing and printing ``text``."""
    parse_s, parse_cpu_s = _best(lambda: hlo_tools.parse(text), repeats)
    module = hlo_tools.parse(text)
    print_s, print_cpu_s = _best(lambda: hlo_tools.to_text(module), repeats)
    n = module.instruction_count
    return {"module": name, "instructions": n, "parse_backend": parse_backend(),
            "parse_s": parse_s, "print_s": print_s,
            "parse_instr_per_s": n / parse_s, "print_instr_per_s": n / print_s,
            "parse_cpu_s": parse_cpu_s, "print_cpu_s": print_cpu_s,
            "parse_cpu_instr_per_s": n / parse_cpu_s, "print_cpu_instr_per_s": n / print_cpu_s}


def _best(fn, repeats: int) -> tuple[float, float]:
    """The smallest wall-clock and the smallest CPU time of ``repeats`` calls of ``fn``."""
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpus.append(time.process_time() - c0)
        walls.append(time.perf_counter() - w0)
    return min(walls), min(cpus)


def zoo_texts(names: list[str]) -> dict[str, str]:
    import jax

    from disco_jax import zoo

    texts = {}
    for name in names:
        step, args = zoo.get(name)(4, "small")
        lowered = jax.jit(step).lower(*args)
        texts[f"{name}-small pre-opt"] = lowered.as_text(dialect="hlo")
        texts[f"{name}-small post-opt"] = lowered.compile().as_text()
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--zoo", nargs="*", default=["transformer"],
                        help="zoo models to measure (default: transformer)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (best kept)")
    parser.add_argument("--backend", choices=["auto", "c", "python"],
                        help="parser backend (default: $DISCO_PARSE_BACKEND, else auto)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "parse_speed.json",
                        help="JSON output (default: %(default)s)")
    args = parser.parse_args()
    if args.backend:
        os.environ["DISCO_PARSE_BACKEND"] = args.backend
    texts = {f"synthetic-{n}": synthetic_module(int(n)) for n in args.sizes.split(",")}
    if args.zoo:
        texts.update(zoo_texts(args.zoo))
    rows = [measure(name, text, args.repeats) for name, text in texts.items()]
    print(f"{'module':28} {'backend':>7} {'instrs':>7} {'parse s':>8} {'print s':>8} "
          f"{'parse/s':>9} {'cpu parse/s':>11} {'print/s':>9} {'cpu print/s':>11}")
    for r in rows:
        print(f"{r['module']:28} {r['parse_backend']:>7} {r['instructions']:>7} "
              f"{r['parse_s']:>8.4f} {r['print_s']:>8.4f} "
              f"{r['parse_instr_per_s']:>9.0f} {r['parse_cpu_instr_per_s']:>11.0f} "
              f"{r['print_instr_per_s']:>9.0f} {r['print_cpu_instr_per_s']:>11.0f}")
    write_result(args.out, {"rows": rows}, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
