"""Plans and moves on small inline HLO: legality with reasons, structure of apply_plan.

What the moves decide is recorded in ``tests/goldens/plan_walks.txt``: random walks on a
few graphs (the inline MODULE, snippets, fixtures; see WALKS), one line per try of a move
with the nodes it drew, its decision and, for the try that made the move, the group it
made. ``test_walks_decide_as_recorded`` replays them with the C kernel and with the
pure-Python moves and shows the first line that differs. After a deliberate change of
what the moves decide, regenerate the file and read its diff::

    python tests/test_plan.py --regen
"""

from __future__ import annotations

import collections
import pathlib
import pickle
import random
from array import array

import pytest

from hlo_tools import parse, to_text
from hlo_tools import plan as P
from hlo_tools.graph import device_graph
from hlo_tools.plan import draws, kernel, legality, merge, neighbours, reach, value
from hlo_tools.plan import moves as moves_module
from hlo_tools.plan import space as space_module
from hlo_tools.rewrite import apply_plan
from hlo_tools.verify import find_problems

# p0 -> exp -> neg -> add <- mul <- p1 ; exp also feeds mul (a producer with two users)
# ar0/ar1 all-reduce add and mul (gradients), armax reduces with max, arloss is a scalar;
# ar2 reduces a parameter and ar3 reduces ar2 (a bucket of both would be a cycle).
MODULE = """HloModule m

sum {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

max {
  a.1 = f32[] parameter(0)
  b.1 = f32[] parameter(1)
  ROOT s.1 = f32[] maximum(a.1, b.1)
}

body {
  bp = (f32[4]{0}) parameter(0)
  bp0 = f32[4]{0} get-tuple-element(bp), index=0
  ROOT bt = (f32[4]{0}) tuple(bp0)
}

cond {
  cp = (f32[4]{0}) parameter(0)
  ROOT ct = pred[] constant(false)
}

ENTRY main {
  p0 = f32[4]{0} parameter(0)
  p1 = f32[4]{0} parameter(1)
  exp = f32[4]{0} exponential(p0)
  neg = f32[4]{0} negate(exp)
  mul = f32[4]{0} multiply(exp, p1)
  add = f32[4]{0} add(neg, mul)
  zero = f32[] constant(0)
  g0 = f32[] reduce(add, zero), dimensions={0}, to_apply=sum
  g1 = f32[] reduce(mul, zero), dimensions={0}, to_apply=sum
  ar0 = f32[4]{0} all-reduce(add), replica_groups={{0,1}}, to_apply=sum
  ar1 = f32[4]{0} all-reduce(mul), replica_groups={{0,1}}, to_apply=sum
  armax = f32[4]{0} all-reduce(mul), replica_groups={{0,1}}, to_apply=max
  arloss = f32[] all-reduce(g1), replica_groups={{0,1}}, to_apply=sum
  ar2 = f32[4]{0} all-reduce(p1), replica_groups={{0,1}}, to_apply=sum
  ar3 = f32[4]{0} all-reduce(ar2), replica_groups={{0,1}}, to_apply=sum
  t = (f32[4]{0}) tuple(p0)
  w = (f32[4]{0}) while(t), condition=cond, body=body
  w0 = f32[4]{0} get-tuple-element(w), index=0
  sc = f32[] constant(1)
  ROOT out = (f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[], f32[], f32[]) \
tuple(ar0, ar1, armax, ar3, w0, sc, g0, arloss)
}
"""


@pytest.fixture(scope="module")
def env():
    module = parse(MODULE)
    graph = device_graph(module)
    # Treat every all-reduce here as a gradient all-reduce for the combination rules.
    graph = graph._replace(gradient_allreduces=tuple(
        i for i, op in enumerate(graph.opcodes)
        if op == "all-reduce" and graph.names[i] != "arloss"))
    return module, graph, P.FusionSpace(graph)


def node(graph, name):
    return graph.index[name]


def check(space, plan, producer, consumer, fn=P.can_fuse):
    g = space.graph
    return fn(space, plan, node(g, producer), node(g, consumer))


def test_plain_fusion_is_legal_and_groups(env):
    module, graph, space = env
    plan = P.fuse(space, P.initial_plan(graph), node(graph, "neg"), node(graph, "add"))
    assert sorted(graph.names[m] for m in plan.groups()[node(graph, "neg")]) == ["add", "neg"]
    out = apply_plan(module, plan, graph)
    assert find_problems(out) == [], to_text(out)
    fusion = out.entry.instruction("add")
    assert fusion.opcode == "fusion" and fusion.attrs["kind"] == "kLoop"
    body = out.computation(fusion.called_computations[0])
    assert collections.Counter(i.opcode for i in body.instructions) == {
        "parameter": 2, "negate": 1, "add": 1}, to_text(out)


@pytest.mark.parametrize("producer,consumer,reason", [
    ("p0", "exp", "parameter"),
    ("exp", "ar0", "collective"),
    ("g0", "ar0", "collective"),
    ("t", "w", "tuple plumbing"),
    ("w0", "out", "tuple plumbing"),
    ("exp", "add", "does not feed"),
    ("neg", "neg", "same group"),
    ("exp", "neg", "users outside the consumer group"),
])
def test_illegal_fusions_carry_reasons(env, producer, consumer, reason):
    _, graph, space = env
    decision = check(space, P.initial_plan(graph), producer, consumer)
    assert not decision and reason in decision.reason, decision


def test_control_flow_is_never_fused(env):
    _, graph, space = env
    space_all = P.FusionSpace(graph, unfusible=frozenset())
    decision = check(space_all, P.initial_plan(graph), "t", "w")
    assert not decision
    assert "never fused" in P.can_fuse(space_all, P.initial_plan(graph), node(graph, "w0"),
                                       node(graph, "out")).reason


def test_constant_fuses_into_user(env):
    _, graph, space = env
    plan = P.initial_plan(graph)
    # zero has two users (g0, g1): plain fusion would need a multi-output fusion,
    # duplicating the constant into each reduce is legal.
    assert "users outside" in check(space, plan, "zero", "g0").reason
    assert check(space, plan, "zero", "g0", P.can_duplicate)
    assert check(space, plan, "sc", "out").reason.startswith("consumer is tuple plumbing")


def test_multi_output_fusion_detects_cycle(env):
    _, graph, _ = env
    space = P.FusionSpace(graph, multi_output=True)
    plan = P.initial_plan(graph)
    # exp feeds add both directly... no: exp -> neg -> add and exp -> mul -> add.
    # Fusing exp into add directly is not an edge; fusing mul into add then exp into it is.
    plan = P.fuse(space, plan, node(graph, "mul"), node(graph, "add"))
    decision = check(space, plan, "exp", "add")
    assert not decision and "cycle" in decision.reason, decision
    plan = P.fuse(space, plan, node(graph, "neg"), node(graph, "add"))
    assert check(space, plan, "exp", "add")


def test_duplicate_fusion(env):
    module, graph, space = env
    plan = P.initial_plan(graph)
    plan = P.duplicate(space, plan, node(graph, "exp"), node(graph, "neg"))
    assert plan.dups == {(node(graph, "exp"), node(graph, "neg"))}
    assert not check(space, plan, "exp", "neg", P.can_duplicate)  # already holds a copy
    out = apply_plan(module, plan, graph)
    assert find_problems(out) == [], to_text(out)
    neg = out.entry.instruction("neg")
    body = out.computation(neg.called_computations[0])
    assert [i.opcode for i in body.instructions] == ["parameter", "exponential", "negate"]
    # The original exp is still there for mul.
    assert out.entry.instruction("exp").opcode == "exponential"
    assert out.entry.instruction("mul").operands == ["exp", "p1"]


@pytest.mark.parametrize("producer,consumer,reason", [
    ("p0", "exp", "parameter"),
    ("neg", "add", "no other users"),
    ("exp", "add", "does not read"),
])
def test_illegal_duplicates_carry_reasons(env, producer, consumer, reason):
    _, graph, space = env
    decision = check(space, P.initial_plan(graph), producer, consumer, P.can_duplicate)
    assert not decision and reason in decision.reason, decision


def test_allreduce_combination(env):
    module, graph, space = env
    plan = P.combine(space, P.initial_plan(graph), node(graph, "ar0"), node(graph, "ar1"))
    out = apply_plan(module, plan, graph)
    assert find_problems(out) == [], to_text(out)
    ops = collections.Counter(i.opcode for i in out.entry.instructions)
    assert ops["all-reduce"] == 5 and ops["concatenate"] == 1, to_text(out)
    assert out.entry.instruction("ar0").opcode == "reshape"
    bucket = [i for i in out.entry.instructions if i.name.endswith(".bucket")]
    assert len(bucket) == 1 and bucket[0].shape.dims[0] in (8, 9)  # 9: ordered after another


def _reads(comp, name):
    """Every instruction ``name`` reads, directly or not."""
    seen, todo = set(), [name]
    while todo:
        for op in comp.instruction(todo.pop()).operands:
            if op not in seen:
                seen.add(op)
                todo.append(op)
    return seen


def test_allreduces_are_chained_in_plan_order(env):
    """Each written all-reduce reads the one before it in the schedule (a zero made of
    its result), so every process of a job runs them in the same order; a bucket carries
    the zero as one extra element, a single all-reduce adds it to its operand."""
    module, graph, space = env
    plan = P.combine(space, P.initial_plan(graph), node(graph, "ar0"), node(graph, "ar1"))
    out = apply_plan(module, plan, graph)
    assert find_problems(out) == [], to_text(out)
    comp = out.entry
    written = [i.name for i in comp.instructions if i.opcode == "all-reduce"]
    assert len(written) == 5
    for before, after in zip(written, written[1:]):
        assert before in _reads(comp, after), (before, after, to_text(out))
    bucket = next(i for i in comp.instructions if i.name.endswith(".bucket"))
    assert bucket.shape.dims == (8 + (written.index(bucket.name) > 0),)
    assert sum(i.name.endswith(".ordered") for i in comp.instructions) == 4 - (
        written.index(bucket.name) > 0)


@pytest.mark.parametrize("a,b,reason", [
    ("ar0", "armax", "differ"),
    ("ar2", "ar3", "depends on the other"),
    ("ar0", "ar0", "same bucket"),
    ("ar0", "g0", "only gradient all-reduces"),
    ("ar0", "arloss", "only gradient all-reduces"),
])
def test_illegal_combinations_carry_reasons(env, a, b, reason):
    _, graph, space = env
    decision = check(space, P.initial_plan(graph), a, b, P.can_combine)
    assert not decision and reason in decision.reason, decision


def test_illegal_move_raises_with_reason(env):
    _, graph, space = env
    with pytest.raises(ValueError, match="parameter"):
        P.fuse(space, P.initial_plan(graph), node(graph, "p0"), node(graph, "exp"))


def test_plans_are_immutable_values(env):
    _, graph, space = env
    base = P.initial_plan(graph)
    before = base.key()
    fused = P.fuse(space, base, node(graph, "neg"), node(graph, "add"))
    assert base.key() == before and fused.key() != before
    again = P.fuse(space, base, node(graph, "neg"), node(graph, "add"))
    assert again.key() == fused.key()


def test_random_moves_keep_a_valid_schedule(env):
    module, graph, space = env
    for seed in range(30):
        plan = P.random_moves(space, P.initial_plan(graph), random.Random(seed), 12)
        assert sorted(plan.order) == list(range(graph.num_nodes))
        assert all(plan.order[plan.pos[i]] == i for i in range(graph.num_nodes))
        out = apply_plan(module, plan, graph)
        assert find_problems(out) == [], to_text(out)


def test_random_plan_is_deterministic(env):
    module, _, _ = env
    assert P.random_plan(module, 3, 10).key() == P.random_plan(module, 3, 10).key()


# ------------------------------------------------------ golden walks: what the moves decide

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
GOLDEN_WALKS = pathlib.Path(__file__).parent / "goldens" / "plan_walks.txt"


def _setup(name: str, shared_reduce_operands: bool = True):
    """(module, graph, space) of a test configuration: the inline MODULE (all-reduces as
    in ``env``), a snippet (``compare`` is compare_copy), or a fixture (``shard_map`` is
    shard_map_mlp), with multi-output fusion if the name ends in ``-multi``.
    ``shared_reduce_operands``, the space's flag, is True unless asked otherwise: that
    leaves more to fuse than the default rules (which refuse a fused reduce operands that
    have other users too)."""
    base = name.removesuffix("-multi")
    snippet = FIXTURES / "snippets" / f"{base}.hlo"
    if base == "compare":  # compares next to copies: the rule of _compare_reads_copy
        module = parse((FIXTURES / "snippets" / "compare_copy.hlo").read_text())
        graph = device_graph(module)
    elif snippet.exists():
        module = parse(snippet.read_text())
        graph = device_graph(module)
    elif base == "inline":
        module = parse(MODULE)
        graph = device_graph(module)
        graph = graph._replace(gradient_allreduces=tuple(
            i for i, op in enumerate(graph.opcodes)
            if op == "all-reduce" and graph.names[i] != "arloss"))
    else:
        fixture = "shard_map_mlp" if base == "shard_map" else base
        module = parse((FIXTURES / f"{fixture}.pre.hlo").read_text())
        graph = device_graph(module)
    return module, graph, P.FusionSpace(graph, multi_output=name.endswith("-multi"),
                                        shared_reduce_operands=shared_reduce_operands)


def _plan_bytes(plan) -> bytes:
    return (plan.order.tobytes() + plan.pos.tobytes() + plan.group.tobytes()
            + repr(sorted(plan.dups)).encode())


#: The walks recorded in GOLDEN_WALKS: (configuration of _setup, seeds, moves per walk,
#: weights of the three kinds of move). Their spaces have the default rules.
WALKS = (
    ("inline", 2, 20, (0.5, 0.4, 0.1)),
    ("inline-multi", 2, 20, (0.6, 0.15, 0.25)),
    ("compare", 2, 20, (0.4, 0.6, 0.0)),
    ("grad_mlp", 1, 20, (0.5, 0.3, 0.2)),
    ("grads_two_allreduces", 1, 10, (0.5, 0.2, 0.3)),
    ("shard_map", 2, 40, (0.6, 0.15, 0.25)),
    ("shard_map", 1, 40, (0.3, 0.5, 0.2)),
    ("shard_map-multi", 1, 40, (0.6, 0.15, 0.25)),
)

#: Short names of the decisions in GOLDEN_WALKS (its header lists their reasons).
LABELS = {
    legality.LEGAL: "legal",
    legality._NO_PRODUCER: "no producer",
    legality._NEEDS_MULTI_OUTPUT: "multi-output",
    legality._CYCLE: "cycle",
    legality._LAYOUT_UNSAFE: "operand position",
    legality._COMPARES_COPY: "compare",
    legality._FUSED_PRODUCER: "fused producer",
    legality._NO_OTHER_USERS: "no other users",
    legality._EXPOSES_MEMBER: "exposes member",
    legality._NO_NEIGHBOUR: "no neighbour",
    legality._KEYS_DIFFER: "keys differ",
    legality._BUCKET_CYCLE: "bucket cycle",
    legality._NOTHING_TO_DRAW: "nothing to draw",
}


def _group_text(graph, plan, gid: int) -> str:
    """A group as ``{members in schedule order | copies: producers}``."""
    names = graph.names
    text = ", ".join(names[m] for m in P.members(plan, gid))
    copies = sorted(p for p, g in plan.dups if g == gid)
    if copies:
        text += " | copies: " + ", ".join(names[p] for p in copies)
    return "{" + text + "}"


def _try_text(graph, step: int, t, after) -> str:
    """One line of GOLDEN_WALKS: a try of move ``step`` and its decision (for the try that
    made the move, the group it made in ``after``)."""
    names = [graph.names[i] for i in t.drawn]
    drawn = " <- ".join(names) if t.move != "allreduce" else " + ".join(names)
    line = f"{step:3} {t.move:9} {drawn or '-'}: {LABELS.get(t.decision, t.decision.reason)}"
    if t.decision:
        line += " -> " + _group_text(graph, after, after.group[t.drawn[0]])
    return line


def golden_walks() -> list[str]:
    """The lines of GOLDEN_WALKS, made by the moves as they are."""
    width = max(len(label) for label in LABELS.values())
    lines = [
        "# Golden walks of the plan moves (tests/test_plan.py, test_walks_decide_as_recorded).",
        "# One line per try of a move: the move's index in its walk, its kind, the nodes",
        "# drawn (consumer <- producer, or all-reduce + neighbour) and the decision; a legal",
        "# try made the move: the group it made follows ({members | copies: producers}).",
        "# Regenerate after a deliberate change (and read the diff):",
        "#     python tests/test_plan.py --regen",
        "# Decisions:",
        *(f"#   {label:{width}}  {decision.reason}" for decision, label in LABELS.items()),
    ]
    for name, seeds, moves, weights in WALKS:
        _, graph, space = _setup(name, shared_reduce_operands=False)
        for seed in range(seeds):
            lines.append(f"== {name} seed {seed}: {moves} moves, weights {weights}")
            rng, plan = random.Random(seed), P.initial_plan(graph)
            for step in range(moves):
                tries: list = []
                plan = P.random_moves(space, plan, rng, 1, weights, trace=tries)
                lines += [_try_text(graph, step, t, plan) for t in tries]
    return lines


@pytest.fixture(params=["c", "python"])
def backend(request, monkeypatch):
    """Runs a test with the C kernel of the moves (skipped where it cannot be built) and
    with the pure-Python moves."""
    if request.param == "python":
        monkeypatch.setattr(kernel, "load", lambda: None)
    elif kernel.load() is None:
        pytest.skip("the C kernel of the moves cannot be built here")
    return request.param


def test_walks_decide_as_recorded(backend):
    """Every try of the golden walks decides as recorded, with each backend (a change shows
    the first line that differs; see the module doc to regenerate)."""
    want = GOLDEN_WALKS.read_text().splitlines()
    got = golden_walks()
    if got == want:
        return
    k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    section = next((line for line in reversed(want[:k]) if line.startswith("==")), "")
    context = "\n".join(f"    {line}" for line in want[max(0, k - 4):k])
    pytest.fail(f"{GOLDEN_WALKS.name} line {k + 1} ({section}):\n{context}\n"
                f"  - {want[k] if k < len(want) else '<end of file>'}\n"
                f"  + {got[k] if k < len(got) else '<end of walks>'}\n"
                f"({backend} backend; regenerate with python tests/test_plan.py --regen)")


def _check_try(space, before, after, t) -> None:
    """A try decided as legality does (and the move made what the public function makes)."""
    if t.decision is legality._NOTHING_TO_DRAW:
        assert not t.drawn and after is before
        return
    group = before.group
    if len(t.drawn) == 1:
        (x,) = t.drawn
        if t.move == "allreduce":
            assert t.decision is legality._NO_NEIGHBOUR
            assert all(group[b] == group[x] for b in P.allreduce_neighbours(space, before, x))
        else:
            assert t.decision is legality._NO_PRODUCER
            assert not any(space.fusible[o] for o in P.group_operands(space, before, group[x]))
        return
    x, y = t.drawn
    check, move, pair = {"op_fusion": (P.can_fuse, P.fuse, (y, x)),
                         "duplicate": (P.can_duplicate, P.duplicate, (y, x)),
                         "allreduce": (P.can_combine, P.combine, (x, y))}[t.move]
    assert check(space, before, *pair) == t.decision, (t, check(space, before, *pair))
    if t.decision:
        assert _plan_bytes(move(space, before, *pair)) == _plan_bytes(after)


@pytest.mark.parametrize("name", ["inline", "inline-multi", "compare", "grads_two_allreduces",
                                  *sorted(p.name.removesuffix(".pre.hlo")
                                          for p in FIXTURES.glob("*.pre.hlo"))])
def test_moves_decide_as_legality_does(name, backend):
    """Each try of a move decides what can_fuse / can_duplicate / can_combine decide on the
    nodes it drew (legality has one home), a move ends at its legal try, and the plan it
    makes is the one fuse / duplicate / combine make of that pair."""
    _, graph, space = _setup(name, shared_reduce_operands=False)
    for seed in range(8):
        rng, plan = random.Random(seed), P.initial_plan(graph)
        for _ in range(40):
            tries: list = []
            after = P.random_moves(space, plan, rng, 1, (0.5, 0.3, 0.2), trace=tries)
            assert tries and all(not t.decision for t in tries[:-1])
            assert bool(tries[-1].decision) == (after is not plan)
            for t in tries:
                _check_try(space, plan, after, t)
            plan = after


def test_trace_changes_nothing(backend):
    """A walk makes the same plans and draws with and without a trace."""
    _, graph, space = _setup("shard_map")
    for seed in range(5):
        a, b = random.Random(seed), random.Random(seed)
        plan = traced = P.initial_plan(graph)
        for _ in range(30):
            plan = P.random_moves(space, plan, a, 1)
            traced = P.random_moves(space, traced, b, 1, trace=[])
            assert _plan_bytes(plan) == _plan_bytes(traced)
        assert a.getstate() == b.getstate()


def _answers(space, plan) -> list:
    """What the public functions say about ``plan``, for all groups and pairs of nodes."""
    out = [plan.key(), plan.num_groups, sorted(plan.groups().items()),
           sorted(P.dead_groups(space, plan))]
    for g in sorted({plan.group[i] for i in range(space.n)}):
        out.append((P.members(plan, g), P.group_operands(space, plan, g),
                    sorted(P.group_users(space, plan, g))))
    out += [P.allreduce_neighbours(space, plan, a) for a in space.allreduces]
    moves = ((P.can_fuse, P.fuse), (P.can_duplicate, P.duplicate),
             (P.can_combine, P.combine))
    for x in range(space.n):
        for y in range(space.n):
            for check, move in moves:
                decision = check(space, plan, x, y)
                out.append(decision)
                if decision:
                    out.append(_plan_bytes(move(space, plan, x, y)))
    return out


def _walks(name: str, seeds: int, moves: int, answer_seeds: int, answer_every: int) -> list:
    """The plans of walks of ``moves`` moves from each of ``seeds`` seeds (mixed moves and
    each kind alone), the rng states at their ends and, every ``answer_every`` mixed moves
    of the first ``answer_seeds`` seeds, the answers of the public functions."""
    _, graph, space = _setup(name)
    out: list = []
    kinds = [lambda s, p, r: P.random_moves(s, p, r, 1), *P.MOVES]
    for seed in range(seeds):
        for k, move in enumerate(kinds):
            rng = random.Random(seed * 10 + k)
            plan = P.initial_plan(graph)
            for step in range(moves):
                plan = move(space, plan, rng)
                out.append(_plan_bytes(plan))
                if k == 0 and seed < answer_seeds and step % answer_every == answer_every - 1:
                    out.append(_answers(space, plan))
            out.append(rng.getstate())
    return out


@pytest.mark.parametrize("config", [("inline", 30, 30, 10, 5), ("shard_map", 30, 80, 3, 20),
                                    ("inline-multi", 20, 30, 5, 5)])
@pytest.mark.parametrize("path", ["numpy", "walk"])
def test_every_path_of_a_merge_decides_the_same(config, path, backend, monkeypatch):
    """The numpy paths of merges (forced on even for tiny windows) and the walk of the
    window that finds the groups a bucket reaches (instead of the graph's descendants)
    make the same plans, draws and answers as the default paths."""
    want = _walks(*config)
    if path == "numpy":
        for name in ("_NUMPY_WINDOW", "_NUMPY_GROUPS", "_PYTHON_PARTITION"):
            monkeypatch.setattr(merge, name, 0)
        monkeypatch.setattr(reach, "_NUMPY_DESCENDANTS", 0)
    else:
        for module in (legality, merge, kernel, moves_module):
            monkeypatch.setattr(module, "_single_output", lambda plan: False)
    assert _walks(*config) == want


@pytest.mark.parametrize("name", ["inline", "inline-multi", "shard_map", "shard_map-multi"])
def test_random_plans_apply_cleanly(name):
    """Every plan of random walks (and of each kind of move alone) is a valid schedule
    that apply_plan writes as a valid module."""
    module, graph, space = _setup(name)
    n = graph.num_nodes
    for seed in range(25):
        rng = random.Random(seed)
        plan = P.initial_plan(graph)
        for moves in (3, 10, 30, 100):
            plan = P.random_moves(space, plan, rng, moves)
            assert sorted(plan.order) == list(range(n))
            assert all(plan.order[plan.pos[i]] == i for i in range(n))
            out = apply_plan(module, plan, graph)
            assert find_problems(out) == [], (name, seed, moves)
    for move in P.MOVES:
        plan = P.initial_plan(graph)
        rng = random.Random(1)
        for _ in range(60):
            plan = move(space, plan, rng)
        assert find_problems(apply_plan(module, plan, graph)) == [], (name, move.__name__)


def test_plan_private_facts_are_not_part_of_its_value(env):
    """A plan rebuilt from its four fields (also with 64-bit arrays), pickled or replaced
    moves exactly like the original."""
    _, graph, space = env

    def values(plan):
        return [list(plan.order), list(plan.pos), list(plan.group), sorted(plan.dups)]

    plan = P.random_moves(space, P.initial_plan(graph), random.Random(4), 15)
    for other in (P.Plan(*(array("i", x) for x in plan[:3]), plan.dups),
                  P.Plan(*(array("q", x) for x in plan[:3]), plan.dups),
                  pickle.loads(pickle.dumps(plan)), plan._replace()):
        assert values(other) == values(plan) and other.key()[1] == plan.key()[1]
        for seed in range(5):
            a = P.random_moves(space, plan, random.Random(seed), 20)
            b = P.random_moves(space, other, random.Random(seed), 20)
            assert values(a) == values(b)


# ------------------------------------------- fast paths make the same draws and facts


class _OwnRandom(random.Random):
    """Draws through its own random(): rng.choice then does not use getrandbits."""

    def random(self):
        return super().random()


@pytest.mark.parametrize("cls", [random.Random, _OwnRandom])
def test_chooser_draws_like_choice(cls):
    seqs = [tuple(range(n)) for n in (1, 2, 3, 5, 8, 13, 136, 1000, 5412)]
    a, b = cls(7), cls(7)
    choice = draws._chooser(a)
    for k in range(2000):
        seq = seqs[k % len(seqs)]
        assert choice(seq) == b.choice(seq)
    assert a.getstate() == b.getstate()
    with pytest.raises(IndexError):
        choice(())


@pytest.mark.parametrize("weights", [(0.6, 0.15, 0.25), [1, 2, 3], (1, 0, 0), (0, 0, 1)])
def test_random_moves_draws_like_choices(env, weights):
    _, graph, space = env
    a, b = random.Random(3), random.Random(3)
    plan = P.random_moves(space, P.initial_plan(graph), a, 40, weights)
    expected = P.initial_plan(graph)
    for _ in range(40):
        expected = b.choices(P.MOVES, weights)[0](space, expected, b)
    assert _plan_bytes(plan) == _plan_bytes(expected)
    assert a.getstate() == b.getstate()
    with pytest.raises(ValueError):
        P.random_moves(space, plan, a, 1, (0, 0, 0))
    assert P.random_moves(space, plan, a, 0, (0, 0, 0)) is plan


def test_derived_facts_match_fresh_ones(backend):
    """Spans (found by galloping), the all-reduce state merges keep and the copy index
    the moves keep (or build on demand) equal what is computed from scratch."""
    _, graph, space = _setup("shard_map")
    tables = space_module._ar(space)
    for seed in range(6):
        rng = random.Random(seed)
        plan = P.initial_plan(graph)
        neighbours._ar_state(plan, tables)
        for _ in range(40):
            plan = P.random_moves(space, plan, rng, 3)
            order, group = plan.order, plan.group
            for g in set(group):
                s = e = plan.pos[g]
                while s and group[order[s - 1]] == g:
                    s -= 1
                while e < len(order) and group[order[e]] == g:
                    e += 1
                assert value._span(plan, g) == (s, e)
            fresh = P.Plan(*plan)
            kept, built = neighbours._ar_state(plan, tables), neighbours._ar_state(fresh, tables)
            assert kept.ranked == built.ranked and kept.where == built.where
            assert kept.buckets == built.buckets
            assert ({g: sorted(v) for g, v in kept.ranked_in.items()}
                    == {g: sorted(v) for g, v in built.ranked_in.items()})
            # (each tuple of the index in ascending order, as _index builds it)
            assert value._index(plan) == value._index(fresh)


# ------------------------------------------------ the C kernel decides as the Python moves


def test_the_backend_makes_the_moves(backend):
    """The ``backend`` fixture selects what makes the moves: the kernel or the Python code."""
    _, graph, space = _setup("shard_map")
    P.random_moves(space, P.initial_plan(graph), random.Random(0), 10)
    assert bool(space._ks) == (backend == "c")


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.pre.hlo")))
@pytest.mark.parametrize("multi_output", [False, True])
def test_kernel_moves_as_python_does(name, multi_output, monkeypatch):
    """On every fixture, walks of each kind of move (and of the mix) make the same plans
    and the same draws with the C kernel as without it."""
    if kernel.load() is None:
        pytest.skip("the C kernel of the moves cannot be built here")
    graph = device_graph(parse((FIXTURES / name).read_text()))

    def walks():
        space = P.FusionSpace(graph, multi_output=multi_output)
        out = []
        for seed in range(12):
            for move in (lambda s, p, r: P.random_moves(s, p, r, 1), *P.MOVES):
                rng, plan = random.Random(seed), P.initial_plan(graph)
                for _ in range(60):
                    plan = move(space, plan, rng)
                    out.append(_plan_bytes(plan))
                out.append(rng.getstate())
        return out, bool(space._ks)

    with_kernel, used = walks()
    monkeypatch.setattr(kernel, "load", lambda: None)
    assert used and walks() == (with_kernel, False)


def test_kernel_takes_only_int32_arrays(env):
    """A plan of 64-bit arrays is moved by the Python code (the kernel declines it before
    drawing anything), with the same result."""
    if kernel.load() is None:
        pytest.skip("the C kernel of the moves cannot be built here")
    _, graph, space = env
    plan = P.random_moves(space, P.initial_plan(graph), random.Random(2), 8)
    wide = P.Plan(*(array("q", x) for x in plan[:3]), plan.dups)
    ks = kernel._kernel(space)
    rng = random.Random(0)
    assert ks[0].op_fusion(ks[1], None, None, space, wide, value._index(wide), rng.getrandbits,
                           8, None) is NotImplemented
    assert rng.getstate() == random.Random(0).getstate()
    for move in P.MOVES:
        a, b = move(space, plan, random.Random(5)), move(space, wide, random.Random(5))
        assert [list(x) for x in a[:3]] == [list(x) for x in b[:3]] and a.dups == b.dups


def _reset_kernel(monkeypatch):
    monkeypatch.setattr(kernel.KERNEL, "module", None)
    monkeypatch.setattr(kernel.KERNEL, "tried", False)


def test_moves_fall_back_to_python_without_a_compiler(monkeypatch, env):
    def no_cc():
        raise OSError("no C compiler (cc) found")

    _reset_kernel(monkeypatch)
    monkeypatch.setattr(kernel.KERNEL, "build", no_cc)
    with pytest.warns(RuntimeWarning, match="C kernel unavailable"):
        assert kernel.load() is None
    assert kernel.load() is None  # (warns once)
    _, graph, _ = env
    space = P.FusionSpace(graph)
    P.random_moves(space, P.initial_plan(graph), random.Random(0), 20)
    assert space._ks is False


def test_backend_python_selects_the_python_moves(monkeypatch):
    _reset_kernel(monkeypatch)
    monkeypatch.setenv("DISCO_PLAN_BACKEND", "python")
    assert kernel.load() is None


def test_kernel_builds_into_cache_dir(monkeypatch, tmp_path):
    if kernel.load() is None:
        pytest.skip("the C kernel of the moves cannot be built here")
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path))
    path = kernel.build()
    assert path.parent == tmp_path and path.exists()
    assert kernel.build() == path


def test_allreduce_tries_go_on_in_python_when_the_kernel_declines(env, monkeypatch):
    """When the kernel declines a plan after a try (its scratch busy in another thread),
    the Python code makes the tries left: the same plans and draws."""
    ext = kernel.load()
    if ext is None:
        pytest.skip("the C kernel of the moves cannot be built here")

    class Declining:
        """The kernel, declining every all-reduce pick after the first of a move."""

        picks = declined = 0

        def __getattr__(self, name):
            return getattr(ext, name)

        def allreduce_pick(self, *args):
            self.picks += 1
            if self.picks > 1:
                self.declined += 1
                return NotImplemented
            return ext.allreduce_pick(*args)

    _, graph, _ = env
    space, declining = P.FusionSpace(graph), Declining()
    space._ks = declining, kernel._kernel(space)[1]
    python = P.FusionSpace(graph)
    python._ks = False
    for seed in range(40):
        a, b = random.Random(seed), random.Random(seed)
        plan = expected = P.initial_plan(graph)
        for _ in range(6):
            declining.picks = 0
            plan, expected = P.allreduce_move(space, plan, a), P.allreduce_move(python, expected, b)
            assert _plan_bytes(plan) == _plan_bytes(expected)
        assert a.getstate() == b.getstate()
    assert declining.declined


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--regen"]:
        sys.exit("usage: python tests/test_plan.py --regen  (rewrites goldens/plan_walks.txt)")
    GOLDEN_WALKS.parent.mkdir(exist_ok=True)
    GOLDEN_WALKS.write_text("\n".join(golden_walks()) + "\n")
    print(f"wrote {GOLDEN_WALKS}")
