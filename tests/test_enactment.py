"""The enactment value (disco_jax.enactment): exact JSON round trip, refusals, build."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import hlo_tools
from disco_jax import zoo
from disco_jax.enactment import SINGLE, STAGED, Enactment, build, single_module
from disco_jax.enactment.staged import even_buckets, staged_plan
from hlo_tools import baselines as bl


@pytest.fixture(scope="module")
def vgg():
    step, args = zoo.get("vgg")(4, "tiny")
    module = hlo_tools.parse(hlo_tools.extract(step, *args))
    return step, args, module, hlo_tools.device_graph(module)


def _single(module):
    _, plan = bl.bucketed_plan(module, 1 << 20)
    text = hlo_tools.to_text(hlo_tools.apply_plan(module, plan))
    return Enactment.single("bucketed_1MiB", text, exact=False,
                            compiler_options=bl.baseline_options(bl.BUCKETED, "cpu"))


def _staged(module, graph):
    return Enactment.of_stages("staged_2", staged_plan(module, even_buckets(graph, 2), graph))


def _same(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_json_round_trip_is_exact(vgg):
    _, _, module, graph = vgg
    for e in (_single(module), _staged(module, graph)):
        back = Enactment.from_json(json.loads(json.dumps(e.to_json())))
        assert back == e and back.fingerprint == e.fingerprint
        assert back.kind in (SINGLE, STAGED) and back.texts == e.texts
    assert _single(module).fingerprint != _staged(module, graph).fingerprint
    # the name is for people: it does not change what runs
    assert _single(module)._replace(name="x").fingerprint == _single(module).fingerprint


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format=99), "format"),
    (lambda d: d.update(kind="pickle"), "unknown enactment kind"),
    (lambda d: d.pop("exact"), "malformed"),
    (lambda d: d["staged"]["stages"][0].update(text="HloModule x"), "fingerprint"),
    (lambda d: d["staged"].pop("schedule"), "malformed"),
])
def test_malformed_json_is_refused(vgg, edit, message):
    _, _, module, graph = vgg
    data = json.loads(json.dumps(_staged(module, graph).to_json()))
    edit(data)
    with pytest.raises(ValueError, match=message):
        Enactment.from_json(data)


def test_build_single_and_staged_match_jit(vgg):
    step, args, module, graph = vgg
    want = jax.jit(step)(*args)
    _same(build(_single(module), step, args)(*args), want)
    run = build(_staged(module, graph), step, args, self_test=False)
    try:
        _same(run(*args), want)
    finally:
        run.close()


def test_single_module_of_a_staged_enactment_has_its_buckets(vgg):
    step, args, module, graph = vgg
    staged = _staged(module, graph)
    single = single_module(staged, step, args)
    assert single.kind == SINGLE and not single.exact
    # one flat all-reduce per multi-member bucket, as the staged plan reduces them
    buckets = [b for b in staged.staged.comms if len(b.members) > 1]
    assert hlo_tools.jax_bridge.count_all_reduces(single.text) <= \
        hlo_tools.jax_bridge.count_all_reduces(hlo_tools.to_text(module)) - sum(
            len(b.members) - 1 for b in buckets)
    _same(build(single, step, args)(*args), jax.jit(step)(*args))
