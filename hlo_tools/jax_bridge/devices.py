"""The devices a program runs on: how many a module needs, what this process has."""

from __future__ import annotations

import os
from typing import Any

import jax

from hlo_tools.devices import module_devices
from hlo_tools.ir import HloModule
from hlo_tools.jax_bridge import internals
from hlo_tools.jax_bridge.errors import DevicesUnavailableError

__all__ = ["HOST_DEVICES_FLAG", "backend_info", "device_memory_bytes", "give_host_devices",
           "local_devices_for", "local_shards"]


def backend_info(platform: str | None = None) -> dict[str, Any]:
    """What per-op times depend on: versions, platform, device kind and host CPUs.

    Returns:
        ``{"jax", "jaxlib", "platform", "device_kind", "num_devices", "cpu_count"}``.
    """
    platform = platform or jax.default_backend()
    devices = jax.devices(platform)
    return {
        "jax": internals.JAX_VERSION,
        "jaxlib": internals.JAXLIB_VERSION,
        "platform": platform,
        "device_kind": devices[0].device_kind if devices else "",
        "num_devices": len(devices),
        "cpu_count": os.cpu_count() or 0,
    }


def local_shards(x: jax.Array) -> dict[Any, jax.Array]:
    """This process's buffers of an array: one single-device array per addressable device.

    What ``{s.device: s.data for s in x.addressable_shards}`` gives, also for the array
    jax (0.10 to 0.12 at least) makes when ``jax.device_put`` places a jax array (not a
    numpy one) replicated over a mesh of several processes with one device each: its one
    local buffer carries the whole mesh's sharding, so ``addressable_shards`` (and
    ``jax.make_array_from_single_device_arrays`` given it) raise "the input arrays must
    have one shard each. An argument array had 2 shard(s)". A replicated array holds the
    whole value on every device: the buffer of its one local device is then viewed
    through ``addressable_data`` (no copy), with several a copy of the array is split.

    Raises:
        ValueError: what ``addressable_shards`` raises for an array that is not
            replicated.
    """
    try:
        return {s.device: s.data for s in x.addressable_shards}
    except ValueError:
        if not x.is_fully_replicated:
            raise
    devices = list(x.sharding.addressable_devices)
    if len(devices) == 1:
        return {devices[0]: x.addressable_data(0)}
    copy = jax.device_put(x, x.sharding, may_alias=False)
    return {s.device: s.data for s in copy.addressable_shards}


def device_memory_bytes(platform: str | None = None) -> int:
    """Memory one device of this process may use, bytes.

    A device that reports its memory (``memory_stats()["bytes_limit"]``: GPU) gives that;
    host devices (CPU), which report nothing, share the machine's physical memory, so each
    gets ``physical memory / local device count``.
    """
    platform = platform or jax.default_backend()
    devices = jax.local_devices(backend=platform)
    try:
        stats = devices[0].memory_stats() if devices else None
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(physical // max(1, len(devices)))


def local_devices_for(module: HloModule, platform: str) -> tuple[Any, ...]:
    """The first :func:`~hlo_tools.devices.module_devices` local devices of ``platform``
    for a parsed module.

    Raises:
        DevicesUnavailableError: the process has fewer.
    """
    needed = module_devices(module)
    local = jax.local_devices(backend=platform)
    if needed <= len(local):
        return tuple(local[:needed])
    hint = ""
    if jax.process_count() > 1:
        hint = (f" (process {jax.process_index()} of {jax.process_count()}: a module "
                "runs here on this process's devices alone)")
    elif platform == "cpu":
        hint = (f" (XLA_FLAGS=--xla_force_host_platform_device_count={needed} gives a "
                f"process {needed} host devices)")
    raise DevicesUnavailableError(
        f"the module runs on {needed} devices, this process has {len(local)} local "
        f"{platform} device{'s' if len(local) != 1 else ''}{hint}")


#: The XLA flag that gives the CPU backend several host devices.
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def give_host_devices(count: int) -> bool:
    """Starts the CPU backend with ``count`` host devices, as a module of ``count``
    devices needs to run in one process: adds ``--xla_force_host_platform_device_count``
    to ``XLA_FLAGS``, before jax starts its backends.

    Nothing changes (False) when ``count`` is 1, when jax has already started its
    backends, or when ``XLA_FLAGS`` already sets a host device count (the user's choice
    stands); other backends (GPU) are not affected by the flag.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if count <= 1 or HOST_DEVICES_FLAG in flags or internals.backends_initialized():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICES_FLAG}={count}".strip()
    return True
