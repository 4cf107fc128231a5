"""The devices a module names: replica groups, and how many devices it runs on.

Pure text over the parsed module (no jax): :func:`parse_groups` reads a
``replica_groups`` / ``source_target_pairs`` attribute, :func:`module_devices` counts the
devices a whole-program module runs on.
"""

from __future__ import annotations

import itertools
import math
import re

from hlo_tools.ir import HloModule

__all__ = ["GROUP_ATTRS", "module_devices", "parse_groups"]

#: The attributes whose value :func:`parse_groups` reads.
GROUP_ATTRS = ("replica_groups", "source_target_pairs")

#: ``[2,2]<=[4]`` / ``[2,2]<=[2,2]T(1,0)``: group dims, iota dims, transpose.
_IOTA_RE = re.compile(r"\s*\[([\d,\s]*)\]\s*<=\s*\[([\d,\s]*)\]\s*(?:T\(([\d,\s]*)\))?\s*$")
#: ``mesh['a'=2,'b'=4] {'b'}`` (mesh-axes form, as newer XLA prints): axes, grouped axes.
_MESH_RE = re.compile(r"\s*mesh\[([^\]]*)\]\s*\{([^{}]*)\}\s*$")
_AXIS_RE = re.compile(r"\s*'([^']*)'\s*=\s*(\d+)\s*$")
_NAME_RE = re.compile(r"\s*'([^']*)'\s*$")
#: One innermost ``{...}`` of the list form.
_GROUP_RE = re.compile(r"\{([^{}]*)\}")
#: ``devices=[4,1]...`` of a tiled sharding: the tile assignment's dimensions.
_TILE_DIMS_RE = re.compile(r"devices=\[([\d,\s]+)\]")
#: ``maximal device=3``.
_MAXIMAL_RE = re.compile(r"maximal\s+device=(\d+)")
#: ``#sdy.mesh<["data"=4, "model"=2]>`` (quotes possibly escaped): its axes.
_SDY_MESH_RE = re.compile(r"#sdy\.mesh<\[([^\]]*)\]")
_SIZE_RE = re.compile(r"=\s*(\d+)")


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", text)]


def _iota(dims: list[int], perm: list[int]) -> list[int]:
    """``0..prod(dims)-1`` laid out as ``dims``, transposed by ``perm``, flattened."""
    strides = [math.prod(dims[k + 1:]) for k in range(len(dims))]
    moved = [(dims[p], strides[p]) for p in perm]
    return [sum(i * s for i, (_, s) in zip(index, moved))
            for index in itertools.product(*(range(d) for d, _ in moved))]


def _mesh_axes(value: str) -> tuple[list[int], list[int]] | None:
    """Sizes of the mesh axes and the grouped axes' positions of a mesh-axes form; None
    for another form.

    Raises:
        ValueError: a mesh-axes form this reader does not know (sub-axes, unknown axes).
    """
    m = _MESH_RE.match(value)
    if not m:
        return None
    axes = [_AXIS_RE.match(a) for a in m.group(1).split(",")] if m.group(1).strip() else []
    names = [_NAME_RE.match(a) for a in m.group(2).split(",")] if m.group(2).strip() else []
    if not all(axes) or not all(names):
        raise ValueError(f"unsupported mesh replica groups {value!r}")
    order = [a.group(1) for a in axes]
    try:
        grouped = [order.index(n.group(1)) for n in names]
    except ValueError:
        raise ValueError(f"replica groups {value!r} name an axis not in the mesh") from None
    return [int(a.group(2)) for a in axes], grouped


def parse_groups(value: str) -> list[list[int]]:
    """The groups of a ``replica_groups`` or ``source_target_pairs`` attribute value.

    * list form ``{{0,1},{2,3}}``: its groups (``{}``: none);
    * iota form ``[G,S]<=[d0,d1,...]T(p0,p1,...)``: ``G`` groups of ``S``, the ids
      ``0..d0*d1*...-1`` laid out as ``[d0,d1,...]``, transposed by the permutation (none:
      as laid out), read in order;
    * mesh-axes form ``mesh['a'=2,'b'=4] {'b'}``: one group per position on the other
      axes (in mesh order), its ids those along the grouped axes (the first listed
      varying slowest); ids are positions in the mesh, row-major.

    Raises:
        ValueError: a value in none of these forms, or one whose sizes disagree.
    """
    mesh = _mesh_axes(value)
    if mesh is not None:
        dims, grouped = mesh
        perm = [k for k in range(len(dims)) if k not in grouped] + grouped
        ids = _iota(dims, perm)
        size = math.prod(dims[k] for k in grouped)
        return [ids[k:k + size] for k in range(0, len(ids), size)]
    iota = _IOTA_RE.match(value)
    if iota:
        shape, dims = _ints(iota.group(1)), _ints(iota.group(2))
        perm = _ints(iota.group(3)) if iota.group(3) is not None else list(range(len(dims)))
        if (not shape or sorted(perm) != list(range(len(dims)))
                or math.prod(shape) != math.prod(dims)):
            raise ValueError(f"bad iota replica groups {value!r}")
        ids = _iota(dims, perm)
        size = shape[-1]
        return [ids[k:k + size] for k in range(0, len(ids), size)] if size else []
    text = value.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"bad replica groups {value!r}")
    return [_ints(group) for group in _GROUP_RE.findall(text[1:-1])]


def module_devices(module: HloModule) -> int:
    """How many devices a pre-optimization whole-program module runs on.

    The largest of what the module says: the header's ``num_partitions`` times its
    ``replica_count``, the size of every shardy mesh in the header's frontend attributes
    (``#sdy.mesh<["data"=4]>``, as jax lowers ``shard_map``), the tile assignment of every
    ``sharding`` (``devices=[4,1]<=[4]``, ``maximal device=3``) and the device ids of every
    collective's groups (:data:`GROUP_ATTRS`, in a form :func:`parse_groups` reads); 1
    when it says nothing.
    """
    header = module.header_attrs
    found = [1, int(header.get("num_partitions", "1")) * int(header.get("replica_count", "1"))]
    for axes in _SDY_MESH_RE.findall(header.get("frontend_attributes", "")):
        found.append(math.prod(int(v) for v in _SIZE_RE.findall(axes)))
    for _, instr in module.instructions():
        attrs = instr.attrs
        sharding = attrs.get("sharding")
        if sharding:
            found.extend(math.prod(_ints(dims)) for dims in _TILE_DIMS_RE.findall(sharding))
            found.extend(int(d) + 1 for d in _MAXIMAL_RE.findall(sharding))
        for key in GROUP_ATTRS:
            if key in attrs:
                try:
                    groups = parse_groups(attrs[key])
                except ValueError:  # a form not read here says nothing
                    continue
                found.append(max((d for g in groups for d in g), default=-1) + 1)
    return max(found)
