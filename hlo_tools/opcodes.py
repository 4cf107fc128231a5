"""The one table of HLO opcodes and what each kind of opcode means to this project.

Every module that asks "what is this opcode?" reads it here: the parser (which opcodes
exist, which attributes name computations), the graph view (node kinds), the verifier
(elementwise ops), the plans (what XLA:CPU can fuse), the single-op benchmark and the
profiler (which ops run no kernel, which are collectives) and the cost model.
"""

from __future__ import annotations

__all__ = [
    "HLO_OPCODES",
    "ASYNC_SUGAR_OPCODES",
    "PARSED_OPCODES",
    "CALLED_COMPUTATION_ATTRS",
    "ELEMENTWISE_OPCODES",
    "COLLECTIVE_OPCODES",
    "COLLECTIVE_PREFIXES",
    "CONTROL_FLOW_OPCODES",
    "ASYNC_WRAPPER_OPCODES",
    "SIDE_EFFECT_OPCODES",
    "PLUMBING_OPCODES",
    "FREE_OPCODES",
    "NOT_STANDALONE_OPCODES",
    "READS_RESULT_SIZE_OPCODES",
    "UNFUSIBLE_OPCODES",
    "FUSED_OPERAND_POSITIONS",
    "is_collective",
]

#: Every opcode XLA's HLO text may contain (from xla/hlo/ir/hlo_opcode.h).
HLO_OPCODES = frozenset("""
abs add add-dependency after-all all-gather all-gather-done all-gather-start all-reduce
all-reduce-done all-reduce-start all-to-all and async-done async-start async-update atan2
batch-norm-grad batch-norm-inference batch-norm-training bitcast bitcast-convert broadcast
call cbrt ceil cholesky clamp collective-broadcast collective-permute
collective-permute-done collective-permute-start compare complex concatenate conditional
constant convert convolution copy copy-done copy-start cosine count-leading-zeros
custom-call divide domain dot dynamic-reshape dynamic-slice dynamic-update-slice erf
exponential exponential-minus-one fft floor fusion gather get-dimension-size
get-tuple-element imag infeed iota is-finite log log-plus-one logistic map maximum minimum
multiply negate not opt-barrier or outfeed pad parameter partition-id popcnt power
ragged-all-to-all ragged-dot real recv recv-done reduce reduce-precision reduce-scatter
reduce-window remainder replica-id reshape reverse rng rng-bit-generator
rng-get-and-update-state round-nearest-afz round-nearest-even rsqrt scaled-dot scatter
select select-and-scatter send send-done set-dimension-size shift-left
shift-right-arithmetic shift-right-logical sign sine slice sort sqrt stochastic-convert
subtract tan tanh topk transpose triangular-solve tuple while xor
""".split())

#: The short forms XLA prints for an op it runs asynchronously: ``fusion-start``,
#: ``fusion-done``, ``custom-call-start``, ... stand for ``async-start``/``async-update``/
#: ``async-done`` wrapping that op (XLA:GPU's compiled modules hold them, e.g. a
#: ``lax.scan`` step's). Ops that have such forms of their own (``all-reduce-start``,
#: ``copy-start``, ...) are left out. Kept apart from :data:`HLO_OPCODES`, whose sorted
#: list is the fused-op estimator's opcode vocabulary.
ASYNC_SUGAR_OPCODES = frozenset(
    f"{op}-{part}" for op in HLO_OPCODES for part in ("start", "update", "done")
) - HLO_OPCODES

#: What the parser accepts as an opcode.
PARSED_OPCODES = HLO_OPCODES | ASYNC_SUGAR_OPCODES

#: Attributes whose value names called computations.
CALLED_COMPUTATION_ATTRS = (
    "calls", "to_apply", "condition", "body", "branch_computations",
    "true_computation", "false_computation", "async_computation",
    "select", "scatter",  # select-and-scatter
)

#: Ops that compute each output element from the same element of their operands.
ELEMENTWISE_OPCODES = frozenset("""
abs add and atan2 cbrt ceil clamp compare complex convert copy cosine count-leading-zeros
divide erf exponential exponential-minus-one floor imag is-finite log log-plus-one logistic
maximum minimum multiply negate not or popcnt power real remainder round-nearest-afz
round-nearest-even rsqrt select shift-left shift-right-arithmetic shift-right-logical sign
sine sqrt subtract tan tanh xor reduce-precision stochastic-convert
""".split())

#: Cross-device communication (they run on the communication channel).
COLLECTIVE_OPCODES = frozenset({
    "all-reduce", "all-reduce-start", "all-reduce-done", "all-gather", "all-gather-start",
    "all-gather-done", "reduce-scatter", "all-to-all", "collective-permute",
    "collective-permute-start", "collective-permute-done", "collective-broadcast",
    "ragged-all-to-all",
})
#: How the names of collectives start: instruction names in a compiled module and in a
#: profiler trace are the opcode plus a suffix (``all-reduce.3``, ``all-reduce-start``).
COLLECTIVE_PREFIXES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                       "collective-", "ragged-all-to-all")
#: Control flow: never fused across or into; costs its called computations.
CONTROL_FLOW_OPCODES = frozenset({"while", "conditional", "call", "async-start",
                                  "async-update", "async-done"}) | ASYNC_SUGAR_OPCODES
#: The async wrappers among the control-flow ops: they run no kernel of their own.
ASYNC_WRAPPER_OPCODES = frozenset({"async-start", "async-update", "async-done"}
                                  ) | ASYNC_SUGAR_OPCODES
#: Ops with side effects, state or tokens.
SIDE_EFFECT_OPCODES = frozenset({"infeed", "outfeed", "send", "send-done", "recv",
                                 "recv-done", "rng", "rng-get-and-update-state",
                                 "rng-bit-generator", "after-all", "add-dependency",
                                 "opt-barrier", "partition-id", "replica-id", "domain"})
#: Tuple plumbing: never fused.
PLUMBING_OPCODES = frozenset({"tuple", "get-tuple-element"})

#: Ops that run no kernel of their own on XLA:CPU (zero time).
FREE_OPCODES = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "reshape",
    "after-all", "add-dependency", "opt-barrier", "domain",
})
#: Ops the single-op benchmark cannot run as a module of their own.
NOT_STANDALONE_OPCODES = frozenset({"infeed", "outfeed", "send", "send-done", "recv",
                                    "recv-done", "rng", "rng-get-and-update-state",
                                    "rng-bit-generator", "partition-id", "replica-id",
                                    "copy-start", "copy-done", "custom-call",
                                    "get-dimension-size", "set-dimension-size"})
#: Ops that read only as many bytes of their operand as their result has.
READS_RESULT_SIZE_OPCODES = frozenset({"slice", "dynamic-slice", "gather"})

#: Opcodes we never fuse on XLA:CPU although they are ordinary kernels.
#: * reshape, transpose, concatenate, bitcast, copy: a hand-written fusion reaches XLA
#:   before layout assignment, which leaves fused computations without layouts, and the
#:   emitter then aborts the process (``Check failed: input_shape.has_layout()``);
#:   ``benchmarks/probe_cpu_fusion.py`` finds these by compiling each pair in a subprocess.
#: * dot, convolution: XLA:CPU runs them as library calls; inside a loop fusion they
#:   become slow elemental loops, and as kOutput fusions they abort the process.
#: * the rest are emitted by dedicated emitters or library calls (sort, fft, scatter...).
UNFUSIBLE_OPCODES = frozenset({
    "reshape", "transpose", "concatenate", "bitcast", "copy", "dot", "convolution",
    "sort", "fft", "cholesky", "triangular-solve", "custom-call", "rng", "rng-bit-generator",
    "scatter", "select-and-scatter", "reduce-window", "gather", "while", "conditional",
    "call", "map", "topk", "batch-norm-training", "batch-norm-inference",
    "batch-norm-grad", "dynamic-update-slice", "iota", "pad", "reverse", "dynamic-slice",
})

#: Consumers that may read a value computed inside their fusion only at these operand
#: positions on XLA:CPU:
#:
#: * ``select`` with an on-true/on-false value computed in the same fusion aborts the
#:   emitter (the fused value has no layout; see UNFUSIBLE_OPCODES), while a fused
#:   predicate is fine;
#: * ``broadcast`` at none: XLA's loop emitter inlines a fusion's producers into every
#:   output element, so a broadcast of a value computed in its fusion recomputes that
#:   value -- and everything it is computed from, a batch-norm reduction say -- once per
#:   element it writes. The cost model cannot see the repetition (a fused op is priced
#:   from its members' times): on resnet-tiny the searched plan with such fusions ran in
#:   110 ms, the plan searched under this rule in 12.4 ms, no fusion in 16.9 ms. A
#:   constant is computed by nothing and may still be broadcast inside a fusion.
FUSED_OPERAND_POSITIONS = {"select": frozenset({0}), "broadcast": frozenset()}


def is_collective(name: str) -> bool:
    """Whether an opcode, or an instruction or trace-event name, is a collective's."""
    return name in COLLECTIVE_OPCODES or name.startswith(COLLECTIVE_PREFIXES)
