"""hlo_tools.baselines: option sets, XLA's combiner rule, summaries, and the four baselines
compiled by real XLA:CPU on a zoo model with 4 host devices (see conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

from disco_jax import zoo
from hlo_tools import baselines as bl
from hlo_tools import jax_bridge as jb
from hlo_tools.parser import parse

FIXTURES = Path(__file__).parent / "fixtures"
RTOL, ATOL = 1e-5, 1e-6
# vgg: shard_map step with explicit all-reduces; auto_sharded: jax.jit program whose
# all-reduces appear only in XLA's partitioner.
MODELS = ("vgg", "auto_sharded")
DISABLE = "xla_disable_hlo_passes"
# baseline -> (XLA op fusion, AllReduce combining)
EXPECTED = {
    "no_fusion": (False, False),
    "op_fusion": (True, False),
    "allreduce_fusion": (False, True),
    "xla_default": (True, True),
}


def _disabled(options: dict) -> set[str]:
    return set(filter(None, options.get(DISABLE, "").split(",")))


def _rest(options: dict) -> dict:
    return {k: v for k, v in options.items() if k != DISABLE}


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_no_fusion_is_the_empty_plan_as_enacted(platform):
    """Exact mode with the kernel library taking single dots and convolutions (on GPU
    exact mode: cuBLAS keeps its dots there)."""
    exact = jb.plan_library_options(platform)
    got = bl.baseline_options("no_fusion", platform)
    assert _disabled(got) == _disabled(exact)
    assert _rest(got) == _rest(exact)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_each_baseline_disables_only_its_passes(platform):
    cfg = jb.load_pass_config()[{"cpu": "cpu", "gpu": "gpu"}[platform]]["baselines"]
    fusion, combine = set(cfg["fusion_disable"]), set(cfg["combine_disable"])
    assert not fusion & combine
    assert _disabled(bl.baseline_options("op_fusion", platform)) == combine
    assert _disabled(bl.baseline_options("allreduce_fusion", platform)) == fusion
    assert bl.baseline_options("xla_default", platform) == {}


@pytest.mark.parametrize("library", [True, False])
def test_combined_plan_options_are_a_plans_with_the_combiner_on(library):
    cfg = jb.load_pass_config()["cpu"]["baselines"]
    plan = jb.plan_library_options("cpu") if library else jb.exact_compiler_options("cpu")
    got = bl.combined_plan_options("cpu", library=library)
    assert _disabled(got) == _disabled(plan) - set(cfg["combine_disable"])
    assert _disabled(got) and not _disabled(got) & set(cfg["combine_disable"])
    assert _rest(got) == _rest(plan)


def test_swept_combine_thresholds():
    """2x steps from 1 MiB to the gradients' bytes, the largest six, on a backend with a
    threshold option; none where every threshold would combine what the default does, or
    on XLA:CPU."""
    mib = 1 << 20
    assert bl.combine_thresholds("gpu", 300 * mib) == tuple(m * mib for m in
                                                             (16, 32, 64, 128, 256, 512))
    assert bl.combine_thresholds("cuda", 5 * mib) == (1 * mib, 2 * mib, 4 * mib)
    assert bl.combine_thresholds("gpu", 100 * 1024) == ()
    assert bl.combine_thresholds("cpu", 300 * mib) == ()
    (name, options), = bl.combine_threshold_candidates("gpu", 2 * mib)[:1]
    assert name == "xla_combine_1MiB"
    assert options == {"xla_gpu_all_reduce_combine_threshold_bytes": mib}


def test_threshold_options():
    # Threshold 0: the combiner is switched off even in the combining baselines.
    assert _disabled(bl.baseline_options("xla_default", "cpu", 0)) == _disabled(
        bl.baseline_options("op_fusion", "cpu"))
    # XLA:CPU's own threshold is unlimited; asking for it needs no option.
    assert bl.baseline_options("xla_default", "cpu", bl.CPU_COMBINE_THRESHOLD_BYTES) == {}
    with pytest.raises(ValueError, match="no AllReduce combine-threshold option"):
        bl.baseline_options("allreduce_fusion", "cpu", 1024)
    # Baselines that do not combine ignore the threshold.
    assert bl.baseline_options("no_fusion", "cpu", 1024) == bl.baseline_options("no_fusion")
    gpu = bl.baseline_options("xla_default", "cuda", 1024)
    assert gpu == {"xla_gpu_all_reduce_combine_threshold_bytes": 1024}


def test_bad_arguments():
    with pytest.raises(ValueError, match=">= 0"):
        bl.baseline_options("xla_default", "cpu", -1)
    with pytest.raises(ValueError, match="unknown baseline"):
        bl.baseline_options("jax_magic")
    with pytest.raises(ValueError, match="platform"):
        bl.baseline_options("xla_default", "tpu")


# ------------------------------------------------------------- combiner rule, summary


def test_combiner_rule_matches_xla_on_fixture():
    """shard_map_mlp: XLA:CPU combined 7 all-reduces into 4 (two depend on others); the
    emulated rule with XLA's unlimited threshold finds the same buckets (by bytes)."""
    pre = parse((FIXTURES / "shard_map_mlp.pre.hlo").read_text())
    post = bl.module_from_compiled((FIXTURES / "shard_map_mlp.post.hlo").read_text())
    sizes = {i.name: i.shape.byte_size() for _, i in pre.instructions()}
    buckets = bl.combiner_buckets(pre, bl.CPU_COMBINE_THRESHOLD_BYTES)
    combined = sorted(sum(sizes[n] for n in b) for b in buckets)
    xla = bl.summary(post)
    assert combined == sorted(b for b, n in zip(xla["all_reduce_bytes"],
                                                 xla["all_reduce_operands"]) if n > 1)


def test_combiner_rule_threshold_and_count():
    pre = parse((FIXTURES / "shard_map_mlp.pre.hlo").read_text())
    sizes = {i.name: i.shape.byte_size() for _, i in pre.instructions()}
    assert bl.combiner_buckets(pre, 0) == []
    for threshold in (100, 600):
        for bucket in bl.combiner_buckets(pre, threshold):
            assert len(bucket) > 1 and sum(sizes[n] for n in bucket) <= threshold
    assert bl.combiner_buckets(pre, 100) == [["psum_invariant.38", "psum_invariant.41"]]
    assert all(len(b) <= 1 for b in bl.combiner_buckets(pre, 2**40, count=1))


def test_summary_of_compiled_fixture():
    post = bl.module_from_compiled((FIXTURES / "shard_map_mlp.post.hlo").read_text())
    s = bl.summary(post)
    assert s["all_reduces"] == 4 and s["all_reduce_operands"] == [1, 2, 2, 2]
    assert s["combined_all_reduces"] == 3 and s["all_reduced_tensors"] == 7
    assert s["fusions"] == s["multi_op_fusions"] + s["single_op_fusions"] == 12
    assert s["multi_op_fusions"] == 8 and s["library_fusions"] == 3  # ynn dots
    pre = bl.summary(parse((FIXTURES / "shard_map_mlp.pre.hlo").read_text()))
    assert pre["fusions"] == 0 and pre["all_reduces"] == 7


# --------------------------------------------------------------------- real XLA:CPU

needs_devices = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 host devices")


class Case(NamedTuple):
    step: Callable[..., Any]
    args: tuple[Any, ...]
    reference: Any  # jax.jit(step)(*args)
    runs: dict[str, jb.CompiledHlo]
    all_reduces: int  # all-reduces of the uncombined program


@pytest.fixture(scope="module")
def cases() -> Callable[[str], Case]:
    """Builds (once per module) a zoo model's reference outputs and four baselines."""
    cache: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in cache:
            step, args = zoo.get(name)(4, "tiny")
            reference = jax.jit(step)(*args)
            runs = {b: bl.compile_baseline(step, args, b) for b in bl.BASELINES}
            n = bl.summary(bl.module_from_compiled(runs["no_fusion"]))["all_reduces"]
            cache[name] = Case(step, args, reference, runs, n)
        return cache[name]

    return get


def _assert_same(out, ref):
    leaves, ref_leaves = jax.tree.leaves(out), jax.tree.leaves(ref)
    assert len(leaves) == len(ref_leaves)
    for a, b in zip(leaves, ref_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


@needs_devices
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", bl.BASELINES)
def test_baseline_runs_like_jit(cases, model, name):
    case = cases(model)
    _assert_same(case.runs[name](*case.args), case.reference)


@needs_devices
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", bl.BASELINES)
def test_baseline_does_what_its_name_says(cases, model, name):
    case = cases(model)
    n = case.all_reduces
    s = bl.summary(bl.module_from_compiled(case.runs[name]))
    fuses, combines = EXPECTED[name]
    assert (s["multi_op_fusions"] > 0) == fuses, s
    assert s["all_reduced_tensors"] == n
    if combines:
        assert s["all_reduces"] < n and s["combined_all_reduces"] >= 1, s
    else:
        assert s["all_reduces"] == n and s["combined_all_reduces"] == 0, s
    if not fuses:
        # single ops: wrapped ones, and dots and convolutions alone on the library
        assert s["fusions"] == s["wrapped_fusions"] + s["library_fusions"], s


@needs_devices
def test_vgg_counts(cases):
    """vgg tiny: 13 explicit all-reduces (12 gradients + loss); XLA:CPU's unlimited
    threshold puts all 13 into one."""
    case = cases("vgg")
    assert case.all_reduces == bl.summary(parse(jb.extract(case.step, *case.args)))[
        "all_reduces"] == 13
    s = bl.summary(bl.module_from_compiled(case.runs["xla_default"]))
    assert s["all_reduce_operands"] == [13]


@needs_devices
def test_threshold_zero_disables_combining(cases):
    case = cases("vgg")
    run = bl.compile_baseline(case.step, case.args, "xla_default", threshold_bytes=0)
    s = bl.summary(bl.module_from_compiled(run))
    assert s["all_reduces"] == case.all_reduces and s["multi_op_fusions"] > 0
    _assert_same(run(*case.args), case.reference)


@needs_devices
def test_emulated_threshold(cases):
    """A finite threshold on CPU: buckets by XLA's rule, flat buffers, combiner off."""
    case = cases("vgg")
    text = jb.extract(case.step, *case.args)
    buckets = bl.combiner_buckets(parse(text), 1024)
    assert buckets
    run = bl.compile_baseline(case.step, case.args, "xla_default", threshold_bytes=1024)
    s = bl.summary(bl.module_from_compiled(run))
    assert s["all_reduces"] == case.all_reduces - sum(len(b) - 1 for b in buckets)
    # a bucket written after another all-reduce has one more piece: its order element
    got = sorted(t for t in s["all_reduce_tensors"] if t > 1)
    want = sorted(map(len, buckets))
    assert len(got) == len(want) and all(w <= g <= w + 1 for g, w in zip(got, want)), got
    _assert_same(run(*case.args), case.reference)
    # The bucketed text was compiled for a wrapper: the step itself still lowers as before.
    assert jb.extract(case.step, *case.args) == text
    _assert_same(jax.jit(case.step)(*case.args), case.reference)


@needs_devices
def test_emulation_needs_explicit_all_reduces(cases):
    """auto_sharded's all-reduces appear only in XLA's partitioner: nothing to bucket."""
    case = cases("auto_sharded")
    with pytest.raises(ValueError, match="no all-reduce"):
        bl.compile_baseline(case.step, case.args, "allreduce_fusion", threshold_bytes=1024)
