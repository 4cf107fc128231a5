"""Plans: op fusion, duplicate fusion and AllReduce combination over an immutable graph.

A :class:`Plan` partitions the nodes of a :class:`~hlo_tools.graph.DeviceGraph` into
*groups*. A group of compute nodes becomes one ``fusion`` instruction; a group of
all-reduce nodes becomes a *bucket*: one all-reduce over a flat buffer of its gradients
(see :func:`hlo_tools.rewrite.apply_plan`); singletons stay as they are. A plan also
records *duplicated producers*: ``(p, g)`` means group ``g`` holds its own copy of
producer ``p`` while the original ``p`` still serves its other users (DisCo's duplicate
fusion, section 2.2 of the paper).

Every plan keeps a topological order of its group-contracted graph in which each group
is contiguous. That order makes the cycle check of a merge local: a path between two
groups can only pass through nodes placed between them, so only that *window* is
searched (never a walk of the whole graph), and it is also the schedule in which
:func:`hlo_tools.rewrite.apply_plan` prints the module.

Plans are immutable values (``array`` copies cost well under a microsecond per thousand
nodes), so the search can keep thousands of them and derive neighbours cheaply. All
plan functions take a :class:`FusionSpace`, the static facts about the graph that every
plan of it shares.

The modules, each importing only those above it (type hints aside):

* :mod:`~hlo_tools.plan.value`: the :class:`Plan` value, its private facts (copy index,
  single-output flag), group spans and members, :func:`group_outputs`;
* :mod:`~hlo_tools.plan.space`: :class:`FusionSpace` and :func:`fusible_nodes`, the one
  rule of which nodes may be fused;
* :mod:`~hlo_tools.plan.groups`: what a group reads and who reads it, dead groups;
* :mod:`~hlo_tools.plan.reach`: reachability in a window (cycle checks, the groups a merge
  moves);
* :mod:`~hlo_tools.plan.legality`: :class:`Decision`, :func:`can_fuse`,
  :func:`can_duplicate`, :func:`can_combine` and the checks the moves share with them;
  :class:`Try`, what a try of a move decided;
* :mod:`~hlo_tools.plan.neighbours`: which buckets neighbour which, and the per-plan
  all-reduce facts;
* :mod:`~hlo_tools.plan.merge`: the arrays, copies and all-reduce state of a merged plan;
  :func:`fuse`, :func:`duplicate`, :func:`combine`;
* :mod:`~hlo_tools.plan.draws`: the random draws, as ``random.Random`` makes them;
* :mod:`~hlo_tools.plan.kernel`: the C kernel of the moves (``_plan_kernel.c``);
* :mod:`~hlo_tools.plan.moves`: the three random moves (:data:`MOVES`),
  :func:`random_moves` (which records every try when given a ``trace`` list),
  :func:`random_plan`.

Speed (a search applies tens of thousands of moves): everything static is precomputed
in the :class:`FusionSpace` (distinct and fusible operand lists, forbidden operand
positions, all-reduce rank tables, descendants); each plan carries private facts its
moves keep up to date instead of recomputing (an index of its copies, the gradient
producers in schedule order); a group's members are read off the contiguous run of
``order`` around it; the usual reasons to refuse a move are checked first; a merge
rewrites only its window (slices of the three arrays, positions renumbered with numpy
when the window is long; adjacent groups keep the arrays); and the groups a bucket reaches
come from the graph's static descendants (cached per bucket, their positions sorted in C
and cut into runs by bisection). Long runs (buckets) are measured by galloping; a plan made
by duplication builds its copy index only when it is moved from; random draws skip
``random.Random``'s method layers while drawing the very same numbers.

The tries of the three moves and the arrays of their merges run in a C kernel when it can
be built: it makes the same draws through the rng's own ``getrandbits`` and the same
decisions as the Python code, which stays the reference and runs otherwise (or with
``DISCO_PLAN_BACKEND=python``). The tests run both. What the moves decide depends only on
the plan's value and the seed: candidate producers are listed in a defined order (a
group's members in schedule order, then its copies in ascending node order), never in the
iteration order of a set.
"""

from hlo_tools.opcodes import UNFUSIBLE_OPCODES
from hlo_tools.plan.buckets import (
    BUCKET_THRESHOLDS,
    bucket_members,
    bucket_plan,
    bucketed_name,
    production_order,
    ready_order,
)
from hlo_tools.plan.groups import dead_groups, group_operands, group_users
from hlo_tools.plan.kernel import c_kernel_available
from hlo_tools.plan.legality import LEGAL, Decision, Try, can_combine, can_duplicate, can_fuse
from hlo_tools.plan.merge import combine, duplicate, fuse
from hlo_tools.plan.moves import (
    MOVES,
    allreduce_move,
    duplicate_fusion_move,
    op_fusion_move,
    random_moves,
    random_plan,
)
from hlo_tools.plan.neighbours import allreduce_neighbours
from hlo_tools.plan.space import FusionSpace, fusible_nodes
from hlo_tools.plan.value import Plan, copy_readers, group_outputs, initial_plan, members

__all__ = [
    "BUCKET_THRESHOLDS",
    "Decision",
    "FusionSpace",
    "LEGAL",
    "MOVES",
    "Plan",
    "Try",
    "UNFUSIBLE_OPCODES",
    "allreduce_move",
    "allreduce_neighbours",
    "bucket_members",
    "bucket_plan",
    "bucketed_name",
    "c_kernel_available",
    "can_combine",
    "can_duplicate",
    "can_fuse",
    "combine",
    "copy_readers",
    "dead_groups",
    "duplicate",
    "duplicate_fusion_move",
    "fuse",
    "fusible_nodes",
    "group_operands",
    "group_outputs",
    "group_users",
    "initial_plan",
    "members",
    "op_fusion_move",
    "production_order",
    "ready_order",
    "random_moves",
    "random_plan",
]
