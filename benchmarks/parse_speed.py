"""Parse and print throughput of ``hlo_tools`` on synthetic and real modules.

Prints a table (module, instructions, parse s, print s, instr/s) and writes
``benchmarks/results/parse_speed.json``. Run from the repository root:

    python benchmarks/parse_speed.py [--sizes 1000,10000,100000] [--zoo MODEL ...]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import hlo_tools  # noqa: E402

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


def measure(name: str, text: str, repeats: int = 3) -> dict:
    parse_s = min(_timed(lambda: hlo_tools.parse(text)) for _ in range(repeats))
    module = hlo_tools.parse(text)
    print_s = min(_timed(lambda: hlo_tools.to_text(module)) for _ in range(repeats))
    n = module.instruction_count
    return {"module": name, "instructions": n, "parse_s": parse_s, "print_s": print_s,
            "parse_instr_per_s": n / parse_s, "print_instr_per_s": n / print_s}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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
    args = parser.parse_args()
    texts = {f"synthetic-{n}": synthetic_module(int(n)) for n in args.sizes.split(",")}
    if args.zoo:
        texts.update(zoo_texts(args.zoo))
    rows = [measure(name, text) for name, text in texts.items()]
    print(f"{'module':34} {'instrs':>8} {'parse s':>9} {'print s':>9} {'parse/s':>10} "
          f"{'print/s':>10}")
    for r in rows:
        print(f"{r['module']:34} {r['instructions']:>8} {r['parse_s']:>9.4f} {r['print_s']:>9.4f} "
              f"{r['parse_instr_per_s']:>10.0f} {r['print_instr_per_s']:>10.0f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "parse_speed.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rows": rows}, indent=2))
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
