"""An executable compiled outside jax's client, run by jax as a real ``jax.stages.Compiled``.

On XLA:GPU the project's HLO text compiles through the PJRT C API directly (program format
``hlo``: hand-written fusions kept), which yields the plugin's serialized executable, not a
jax object. jax serializes a compiled step as a varint-length-prefixed
``SerializedXlaExecutableMetadata`` proto (donations, output shapes, shardings, layouts)
followed by the backend's own executable bytes; :func:`transplant` puts the prefix of
jax's own compile of the same step in front of the foreign bytes and loads them, so the
result has the step's calling convention and runs with jax's C++ dispatch::

    template = jax.jit(step).lower(*args).compile()   # the calling convention
    run = transplant(template, plugin_bytes)           # the program of the bytes
    new_params, loss = run(*args)                      # minus static arguments, as jax's
    print(run.as_text())                               # what the side compile made

:func:`backend_bytes` takes the backend's bytes out of any ``jax.stages.Compiled`` (e.g.
one of :func:`~hlo_tools.jax_bridge.compile.compile_module`), so the same works between
two compiles on one machine.
"""

from __future__ import annotations

import re

import jax

from hlo_tools.jax_bridge import internals
from hlo_tools.jax_bridge.errors import HloCompileError

__all__ = ["aliased_parameters", "backend_bytes", "transplant"]

#: One ``{output index}: (parameter, {index}, kind)`` entry of ``input_output_alias``.
_ALIAS_ENTRY = re.compile(r"\}\s*:\s*\((\d+)\s*,")


def backend_bytes(compiled: jax.stages.Compiled) -> bytes:
    """The backend's own serialized executable of a ``jax.stages.Compiled`` (jax's
    serialized executable without jax's metadata prefix).

    Raises:
        HloCompileError: jax cannot serialize ``compiled`` (not of ``jax.jit``).
    """
    try:
        return internals.split_serialized(compiled)[1]
    except ValueError as err:
        raise HloCompileError(f"cannot serialize the compiled program: {err}") from err


def _header(compiled: jax.stages.Compiled) -> str:
    """The ``HloModule`` line of the compiled program's (first) module."""
    return next((line for line in compiled.as_text().splitlines()
                 if line.startswith("HloModule ")), "")


def _header_attr(header: str, name: str) -> str | None:
    """``name=value`` of an ``HloModule`` line (a braced value whole), None when absent."""
    start = header.find(f" {name}=")
    if start < 0:
        return None
    value = start + len(name) + 2
    if not header.startswith("{", value):
        end = header.find(",", value)
        return header[start + 1:end if end >= 0 else len(header)]
    depth, end = 0, value
    for end in range(value, len(header)):
        depth += {"{": 1, "}": -1}.get(header[end], 0)
        if depth == 0:
            break
    return header[start + 1:end + 1]


#: What the template's and the executable's programs must agree on (jax's metadata
#: describes the template's).
_SIGNATURE = ("entry_computation_layout", "replica_count", "num_partitions")


def aliased_parameters(compiled: jax.stages.Compiled) -> frozenset[int]:
    """Entry parameters whose buffers the compiled program reuses for an output
    (``input_output_alias`` of its first module): a call deletes the arrays passed there."""
    aliases = _header_attr(_header(compiled), "input_output_alias") or ""
    return frozenset(int(p) for p in _ALIAS_ENTRY.findall(aliases))


def _donated_parameters(compiled: jax.stages.Compiled) -> frozenset[int] | None:
    """Entry parameters whose arguments jax donates to ``compiled`` (None: unknown).
    Parameter ``k`` is the ``k``-th kept flat argument (arguments are tupled only on TPU,
    past 2000 of them)."""
    flags = [bool(getattr(info, "donated", False))
             for info in jax.tree.leaves(compiled.args_info)]
    kept = internals.kept_arguments(compiled)
    if not kept or kept[-1] >= len(flags):
        return None
    return frozenset(param for param, arg in enumerate(kept) if flags[arg])


def transplant(template: jax.stages.Compiled, backend_bytes: bytes) -> jax.stages.Compiled:
    """jax's ``template`` calling convention around another executable of the same program.

    The result is a real ``jax.stages.Compiled``: called with the template's pytrees
    (static arguments left out, as for the template), checked, placed and dispatched by
    jax's C++ path as the template is, with the template's input and output shardings and
    layouts; it runs the program of ``backend_bytes`` (``as_text()`` shows it).

    Donation follows the bytes: the backend deletes the arrays passed to the parameters
    its program aliases to outputs. Bytes that alias a parameter the template does not
    donate are refused (a call would delete an array the caller keeps); a template that
    donates with bytes that alias nothing runs without donation.

    Args:
        template: ``jax.jit(step).lower(*args).compile()`` of the step the bytes were
            compiled for (same entry signature, devices, shardings and layouts), on the
            bytes' backend.
        backend_bytes: the backend's serialized executable without jax's prefix: a PJRT
            plugin's ``PJRT_Executable_Serialize``, or :func:`backend_bytes` of another
            compile.

    Returns:
        A ``jax.stages.Compiled`` running ``backend_bytes``.

    Raises:
        HloCompileError: jax cannot serialize the template, the backend does not load the
            bytes (truncated or corrupt, of another backend or XLA version, or jax's
            metadata does not parse in front of them; XLA's message included), their
            program's entry signature (shapes, layouts, replicas and partitions) differs
            from the template's,
            or they alias a parameter the template does not donate.
    """
    if not backend_bytes:
        raise HloCompileError("no executable bytes to transplant")
    try:
        donated = _donated_parameters(template)
    except ValueError as err:
        raise HloCompileError(f"the template is no serializable jax executable: {err}") \
            from err
    try:
        compiled = internals.load_with_prefix(template, bytes(backend_bytes))
    except Exception as err:  # noqa: BLE001 - XLA's error type differs between versions
        raise HloCompileError(f"the backend did not load the executable bytes "
                              f"({len(backend_bytes)} bytes): {err}") from err
    want, got = (" ".join(filter(None, (_header_attr(_header(c), name) for name in _SIGNATURE)))
                 for c in (template, compiled))
    if got != want:
        raise HloCompileError(f"the executable's entry signature ({got}) differs from the "
                              f"template's ({want})")
    undonated = aliased_parameters(compiled) - (donated or frozenset())
    if donated is not None and undonated:
        raise HloCompileError(f"the executable aliases entry parameters {sorted(undonated)} "
                              f"to outputs, which the template does not donate: compile "
                              "the template with those arguments donated")
    return compiled
