"""hlo_tools.jax_bridge against real XLA:CPU with 4 host devices (see conftest.py)."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hlo_tools import jax_bridge as jb
from hlo_tools.jax_bridge import CompileOptions, InPlaceOf

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 host devices")

RTOL, ATOL = 1e-5, 1e-6


# ------------------------------------------------------------------------------ programs


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]), ("d",))


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _local_step(params, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    grads = jax.lax.pmean(grads, "d")  # one all-reduce per gradient leaf (3)
    new_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    return new_params, jax.lax.pmean(loss, "d")  # + 1 for the loss


def _mlp_step():
    specs = dict(in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    return jax.shard_map(_local_step, mesh=_mesh(), check_vma=False, **specs)


def _mlp_args():
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(8, 16)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": rng.normal(size=(16, 4)).astype(np.float32),
    }
    return (
        params,
        rng.normal(size=(16, 8)).astype(np.float32),
        rng.normal(size=(16, 4)).astype(np.float32),
    )


@pytest.fixture(scope="module")
def mlp():
    step, args = _mlp_step(), _mlp_args()
    return step, args, jb.extract(step, *args), jax.jit(step)(*args)


def _assert_same(out, ref) -> None:
    assert jax.tree.structure(out) == jax.tree.structure(ref)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------- reading compiled HLO text

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.-]+) \(.*\{$")
_FUSION = re.compile(r"fusion\(.*calls=%?([\w.-]+)")
_OPCODE = re.compile(r" = (?:\(.*?\)|\S+) ([\w-]+)\(")


def _computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = comps.setdefault(header.group(1), [])
        elif current is not None and " = " in line:
            current.append(line)
    return comps


def _fused_ops(text: str) -> list[list[str]]:
    """For every fusion instruction: the opcodes of its non-parameter fused instructions."""
    comps = _computations(text)
    fusions = [m.group(1) for line in text.splitlines() if (m := _FUSION.search(line))]
    opcodes = [[_OPCODE.search(line).group(1) for line in comps[name]] for name in fusions]
    return [[op for op in ops if op != "parameter"] for ops in opcodes]


# ---------------------------------------------------------------------------- extraction


def test_extract_has_one_all_reduce_per_gradient_and_loss(mlp):
    _, _, text, _ = mlp
    assert jb.count_all_reduces(text) == 4
    assert "{...}" not in text
    jb.xla_parse_ok(text)


def test_extract_prints_large_constants_in_full():
    table = np.arange(1000, dtype=np.float32)
    fn = lambda x: x * table + 1.0
    x = np.ones(1000, np.float32)
    text = jb.extract(fn, x)
    assert "{...}" not in text and "999" in text
    run = jb.compile_module(text, InPlaceOf(fn, (x,)), CompileOptions(exact=True))
    np.testing.assert_allclose(run(x), x * table + 1.0)


# ---------------------------------------------------------------------------- compiling


@pytest.mark.parametrize("exact", [False, True])
def test_unchanged_text_matches_jit(mlp, exact):
    step, args, text, ref = mlp
    run = jb.compile_module(text, InPlaceOf(step, args), CompileOptions(exact=exact))
    _assert_same(run(*args), ref)
    n_all_reduce = jb.count_all_reduces(run.compiled.as_text())
    if exact:
        assert n_all_reduce == 4  # not combined
        assert all(len(ops) == 1 for ops in _fused_ops(run.as_text()))  # only wrapped_* ops
    else:
        assert n_all_reduce < 4  # XLA:CPU's combiner merges them (into 1)


def _conv_loss(p, x, y):
    dims = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(x, p["k"], (1, 1), "SAME", dimension_numbers=dims)
    h = jnp.transpose(jax.nn.relu(h + p["cb"]), (0, 3, 1, 2)).reshape(h.shape[0], -1)
    return jnp.mean(jnp.sum((jnp.tanh(h @ p["w"]) - y) ** 2, axis=-1))


def _conv_local_step(p, x, y):
    loss, grads = jax.value_and_grad(_conv_loss)(p, x, y)
    new_p = jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.lax.pmean(grads, "d"))
    return new_p, jax.lax.pmean(loss, "d")


def test_conv_dot_reduce_transpose_step_exact():
    specs = dict(in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))
    step = jax.shard_map(_conv_local_step, mesh=_mesh(), check_vma=False, **specs)
    rng = np.random.default_rng(1)
    params = {
        "k": rng.normal(size=(3, 3, 2, 4)).astype(np.float32),
        "cb": np.zeros(4, np.float32),
        "w": rng.normal(size=(4 * 6 * 6, 8)).astype(np.float32) * 0.05,
    }
    x = rng.normal(size=(8, 6, 6, 2)).astype(np.float32)
    args = (params, x, rng.normal(size=(8, 8)).astype(np.float32))
    text = jb.extract(step, *args)
    run = jb.compile_module(text, InPlaceOf(step, args), CompileOptions(exact=True))
    _assert_same(run(*args), jax.jit(step)(*args))
    assert jb.count_all_reduces(text) == jb.count_all_reduces(run.as_text()) == 4
    assert all(len(ops) == 1 for ops in _fused_ops(run.as_text()))


_HANDWRITTEN = """HloModule handwritten

fused_add_mul {
  p0 = f32[8]{0} parameter(0)
  p1 = f32[8]{0} parameter(1)
  add.0 = f32[8]{0} add(p0, p1)
  ROOT mul.0 = f32[8]{0} multiply(add.0, p1)
}

ENTRY main {
  x = f32[8]{0} parameter(0)
  y = f32[8]{0} parameter(1)
  my_fusion = f32[8]{0} fusion(x, y), kind=kLoop, calls=fused_add_mul
  t = f32[8]{0} tanh(my_fusion)
  two = f32[] constant(2)
  b = f32[8]{0} broadcast(two), dimensions={}
  out0 = f32[8]{0} multiply(t, b)
  out1 = f32[8]{0} exponential(x)
  ROOT r = (f32[8]{0}, f32[8]{0}) tuple(out0, out1)
}
"""


def _small(x, y):
    return jnp.tanh((x + y) * y) * 2.0, jnp.exp(x)


def test_handwritten_fusion_is_kept_and_nothing_else_fused():
    args = (np.linspace(0, 1, 8, dtype=np.float32), np.linspace(1, 2, 8, dtype=np.float32))
    run = jb.compile_module(_HANDWRITTEN, InPlaceOf(_small, args), CompileOptions(exact=True))
    _assert_same(run(*args), jax.jit(_small)(*args))
    fused = _fused_ops(run.as_text())
    assert sorted(map(sorted, fused)) == sorted(
        [["add", "multiply"], ["tanh"], ["broadcast"], ["multiply"], ["exponential"]]
    )
    assert 'op_name="my_fusion"' in run.as_text()  # the original name survives as metadata


def _psum_pair(a, b):
    return jax.lax.psum((a, b), "d")  # two all-reduces, results returned directly


def _psum_program():
    fn = jax.shard_map(
        _psum_pair, mesh=_mesh(), in_specs=(P("d"), P("d")), out_specs=(P(), P()), check_vma=False
    )
    return fn, (np.arange(8, dtype=np.float32), np.arange(16, dtype=np.float32))


_AR_LINE = re.compile(r"^(\s*)(\S+) = (\S+) all-reduce\((\S+)\), (.*)$")


def _combine_pair(text: str, flat: bool) -> str:
    """Merges the two all-reduces of ``_psum_program`` into one (flat buffer or tuple)."""
    lines = [line for line in text.splitlines() if " all-reduce(" in line]
    (ind, n0, s0, o0, attrs), (_, n1, s1, o1, _) = (_AR_LINE.match(x).groups() for x in lines)
    if flat:  # f32[2] and f32[4] packed into one f32[6] buffer, as in Horovod / DisCo
        combined = [
            f"cat = f32[6]{{0}} concatenate({o0}, {o1}), dimensions={{0}}",
            f"ar = f32[6]{{0}} all-reduce(cat), {attrs}",
            f"{n0} = {s0} slice(ar), slice={{[0:2]}}",
            f"{n1} = {s1} slice(ar), slice={{[2:6]}}",
        ]
    else:
        combined = [
            f"ar = ({s0}, {s1}) all-reduce({o0}, {o1}), {attrs}",
            f"{n0} = {s0} get-tuple-element(ar), index=0",
            f"{n1} = {s1} get-tuple-element(ar), index=1",
        ]
    block = "\n".join(ind + line for line in combined)
    return text.replace(lines[0] + "\n", "").replace(lines[1], block)


def test_handwritten_flat_combined_all_reduce_stays_one():
    fn, args = _psum_program()
    text = _combine_pair(jb.extract(fn, *args), flat=True)
    run = jb.compile_module(text, InPlaceOf(fn, args), CompileOptions(exact=True))
    _assert_same(run(*args), jax.jit(fn)(*args))
    assert jb.count_all_reduces(run.as_text()) == 1
    assert re.search(r"= f32\[6\]\{0\} all-reduce\(", run.as_text())


def test_tuple_all_reduce_in_shard_map_is_rejected_clearly():
    # XLA limitation (0.10.2): a multi-operand all-reduce inside a manual (shard_map)
    # computation fails before partitioning; XLA's own combiner runs after it.
    fn, args = _psum_program()
    text = _combine_pair(jb.extract(fn, *args), flat=False)
    jb.xla_parse_ok(text)  # the text itself is valid HLO
    with pytest.raises(jb.HloCompileError, match="tuple-shaped"):
        jb.compile_module(text, InPlaceOf(fn, args), CompileOptions(exact=True))


# ------------------------------------------------------------------------------- errors


def test_bad_text_raises_with_xla_message(mlp):
    step, args, text, _ = mlp
    bad = text.replace(" all-reduce(", " all-reduze(", 1)
    with pytest.raises(jb.HloCompileError, match="all-reduze"):
        jb.compile_module(bad, InPlaceOf(step, args), CompileOptions(exact=True))
    with pytest.raises(jb.HloCompileError, match="parse"):
        jb.xla_parse_ok("HloModule broken\n\nENTRY main {\n  ROOT x = f32[2] parameter(0\n}\n")


def test_signature_mismatch_raises():
    args = (np.zeros(4, np.float32), np.zeros(4, np.float32))  # the text takes f32[8]
    with pytest.raises(jb.HloCompileError, match="signature"):
        jb.compile_module(_HANDWRITTEN, InPlaceOf(lambda x, y: (x * y, y), args),
                          CompileOptions(exact=True))


_SHAPE_BUG = """HloModule shape_bug

ENTRY main {
  x = f32[8]{0} parameter(0)
  y = f32[4]{0} parameter(1)
  ROOT bad_add = f32[8]{0} add(x, y)
}
"""


def test_verify_hlo_catches_shape_errors_the_parser_misses():
    jb.xla_parse_ok(_SHAPE_BUG)  # XLA's text parser does not check operand shapes
    with pytest.raises(jb.HloCompileError, match="bad_add"):
        jb.verify_hlo(_SHAPE_BUG)
    jb.verify_hlo(_HANDWRITTEN)


def test_hlo_text_to_mlir_keeps_fusion():
    assert "fusion" in jb.hlo_text_to_mlir(_HANDWRITTEN)


# ------------------------------------------------------------------------ configuration


def _twice(x, y):
    return jnp.sin(x) * y, jnp.sin(x) * y  # two copies of each op, which XLA's CSE merges


def test_extra_disabled_passes_are_added_to_exact_ones():
    args = (np.linspace(0, 1, 8, dtype=np.float32), np.linspace(1, 2, 8, dtype=np.float32))
    text = jb.extract(_twice, *args)
    merged = jb.compile_module(text, InPlaceOf(_twice, args), CompileOptions(exact=True)).as_text()
    run = jb.compile_module(text, InPlaceOf(_twice, args),
                            CompileOptions(exact=True, extra={"xla_disable_hlo_passes": "cse"}))
    assert {"fusion", "cse"} <= set(run.compiler_options["xla_disable_hlo_passes"].split(","))
    assert merged.count(" sine(") == 1 and run.as_text().count(" sine(") == 2  # CSE is off
    _assert_same(run(*args), jax.jit(_twice)(*args))


def test_exact_options_per_backend():
    cpu = jb.exact_compiler_options("cpu")["xla_disable_hlo_passes"].split(",")
    assert {"fusion", "dot-library-rewriter", "cpu-all-reduce-combiner"} <= set(cpu)
    gpu = jb.exact_compiler_options("cuda")["xla_disable_hlo_passes"].split(",")
    assert {"priority-fusion", "multi_output_fusion", "all-reduce-combiner"} <= set(gpu)
    with pytest.raises(jb.HloCompileError, match="tpu"):
        jb.exact_compiler_options("tpu")


def test_one_rule_gives_the_options_of_every_compile():
    exact = jb.exact_compiler_options("cpu")
    assert jb.xla_options("cpu", CompileOptions(exact=False, library=True)) == {}
    assert jb.xla_options("cpu", CompileOptions()) == exact
    assert jb.xla_options("cpu", CompileOptions(library=True)) == jb.plan_library_options("cpu")
    assert (jb.xla_options("cpu", CompileOptions(library="default"))
            == jb.exact_compiler_options("cpu", library=True))
    extra = {"xla_disable_hlo_passes": "cse", "xla_some_option": 2}
    merged = jb.xla_options("cpu", CompileOptions(extra=extra))
    assert merged == {**exact, "xla_disable_hlo_passes": exact["xla_disable_hlo_passes"] + ",cse",
                      "xla_some_option": 2}
    assert jb.xla_options("cpu", CompileOptions(exact=False, extra=extra)) == extra
    with pytest.raises(TypeError, match="not a compile target"):
        jb.compile_module("HloModule m", ("not", "a", "target"))


def test_verified_versions(monkeypatch):
    """The installed jax is one of the verified versions; another warns once."""
    from hlo_tools.jax_bridge import internals

    assert jb.check_versions(warn=False)
    assert {"0.10.2", "0.12.0.1"} <= jb.VERIFIED_VERSIONS
    monkeypatch.setattr(internals, "JAX_VERSION", "0.0.1")
    monkeypatch.setattr(internals, "_WARNED_VERSIONS", False)
    with pytest.warns(RuntimeWarning, match="0.10.2, 0.11.2, 0.12.0.1"):
        assert not jb.check_versions()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not jb.check_versions()  # once per process


def test_declared_range_matches_the_verified_versions():
    """pyproject's jax range starts at the oldest verified version and ends at the first
    release known not to work, after the newest verified one (one home for the range:
    VERIFIED_VERSIONS and FIRST_UNSUPPORTED)."""
    import re
    import tomllib
    from pathlib import Path

    from hlo_tools.jax_bridge.internals import FIRST_UNSUPPORTED, version_tuple

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml")
                            .read_text())["project"]
    verified = sorted(jb.VERIFIED_VERSIONS, key=version_tuple)
    assert version_tuple(verified[-1]) < version_tuple(FIRST_UNSUPPORTED)
    want = f">={verified[0]},<{FIRST_UNSUPPORTED}"
    for name in ("jax", "jaxlib"):
        spec = next(d for d in project["dependencies"] if re.match(rf"{name}\b[<>=]", d))
        assert spec.replace(" ", "") == f"{name}{want}", spec
    assert project["requires-python"] == ">=3.11"


def test_compiling_in_place_does_not_change_what_jax_jit_runs():
    """jax caches lowerings; our text must go into a copy, never into jax's cache."""

    def f(x):
        return jnp.tanh(x) * 2

    x = jnp.float32(0.9)
    changed = jb.extract(f, x).replace("multiply(", "add(")
    run = jb.compile_module(changed, InPlaceOf(f, (x,)), CompileOptions(exact=True))
    assert float(run(x)) == pytest.approx(np.tanh(0.9) + 2, rel=1e-6)
    assert float(jax.jit(f)(x)) == pytest.approx(np.tanh(0.9) * 2, rel=1e-6)
    assert "multiply(" in jb.extract(f, x)


def test_compiling_extracted_text_logs_no_shardy_warning():
    """A shard_map step's text carries its Shardy shardings as frontend attributes; from
    jaxlib 0.11 on, XLA logged per compile that such a module looks like a stale export.
    The bridge tells XLA the form up front, so nothing is logged (C++ logs go to the
    process's stderr: checked in a child process)."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from hlo_tools import jax_bridge as jb
mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
def local(w, x):
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    return w - 0.1 * jax.lax.pmean(g, "d")
step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P(),
                             check_vma=False))
w, x = jnp.ones((8, 8)), jnp.ones((16, 8))
run = jb.compile_module(jb.extract(step, w, x), jb.InPlaceOf(step, (w, x)),
                        jb.CompileOptions(exact=True))
assert np.allclose(run(w, x), step(w, x), rtol=1e-5)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=str(Path(__file__).resolve().parents[1]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stale model export" not in proc.stderr and "sdy shardings" not in proc.stderr
