"""The GPU a deviceless compile targets: a ``GpuTargetConfigProto`` text.

XLA:GPU compiles without a device from a description of one (a
``stream_executor.GpuTargetConfigProto``, in protobuf text). Newer plugins embed
descriptions of common GPUs, older ones do not, and their proto parsers know different
fields; :func:`h100_target_config` prints our own H100 SXM description from a table of
its facts, using only the fields every supported plugin reads (jax 0.10.2 and 0.12).
:func:`target_config` picks the text of one compile: given, the file named by
``DISCO_GPU_TARGET_CONFIG``, or the H100's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["H100_SXM", "TARGET_CONFIG_ENV", "h100_target_config", "target_config"]

#: Environment variable naming a ``GpuTargetConfigProto`` text file (``.txtpb``) that
#: replaces the H100 description as the default deviceless target.
TARGET_CONFIG_ENV = "DISCO_GPU_TARGET_CONFIG"

#: The NVIDIA H100 SXM (80 GB HBM3), as ``GpuDeviceInfoProto`` fields.
H100_SXM: Mapping[str, int | float] = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 49152,
    "shared_memory_per_core": 233472,
    "threads_per_core_limit": 2048,
    "core_count": 132,
    "fpus_per_core": 128,
    "block_dim_limit_x": 2147483647,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "memory_bandwidth": 3352320000000,
    "l2_cache_size": 52428800,
    "clock_rate_ghz": 1.98,
    "device_memory_size": 84942979072,
    "shared_memory_per_block_optin": 232448,
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
    "thread_dim_limit_x": 1024,
    "thread_dim_limit_y": 1024,
    "thread_dim_limit_z": 64,
}
_H100_COMPUTE_CAPABILITY = (9, 0)
_H100_NAME = "NVIDIA H100 80GB HBM3"


def _value(value: int | float | str) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def h100_target_config() -> str:
    """The ``GpuTargetConfigProto`` text of an H100 SXM (:data:`H100_SXM`, compute
    capability 9.0, platform ``CUDA``)."""
    major, minor = _H100_COMPUTE_CAPABILITY
    lines = ["gpu_device_info {"]
    lines += [f"  {name}: {_value(value)}" for name, value in H100_SXM.items()]
    lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}"]
    lines += ['platform_name: "CUDA"', f"device_description_str: {_value(_H100_NAME)}"]
    return "\n".join(lines) + "\n"


def target_config(given: str | None = None) -> str:
    """The target description of one compile: ``given``; else the text of the file named
    by ``$DISCO_GPU_TARGET_CONFIG``; else :func:`h100_target_config`.

    Raises:
        OSError: the environment names a file that cannot be read.
    """
    if given is not None:
        return given
    path = os.environ.get(TARGET_CONFIG_ENV)
    if path:
        return Path(path).read_text()
    return h100_target_config()
