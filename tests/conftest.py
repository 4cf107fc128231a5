"""Shared pytest setup: 4 host CPU devices for data-parallel (shard_map) tests, jax on the
CPU alone, and no
fused-op labels kept by product runs (``DISCO_LOCAL_LABELS=0``: the suite's runs would
trace their candidates once more and write to the user's cache; the test of the labels
turns them on with a temporary cache).

XLA reads XLA_FLAGS once, when jax creates its CPU backend, so this runs before any test
module imports jax.
"""

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=4"

os.environ.setdefault("XLA_FLAGS", _DEVICES_FLAG)
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + _DEVICES_FLAG
os.environ.setdefault("DISCO_LOCAL_LABELS", "0")
# The suite runs on the CPU. With XLA:GPU's plugin installed for the deviceless compile
# tests (the ``gpu-compile`` extra) jax would try, and log its failure, to start a CUDA
# backend on a machine without a GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
