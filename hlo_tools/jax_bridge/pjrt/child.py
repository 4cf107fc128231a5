"""The child process of one PJRT compile, run on a request folder ``DIR``.

``python -m hlo_tools.jax_bridge.pjrt.child DIR`` runs it; the driver runs it through
:func:`~hlo_tools.jax_bridge.pjrt.driver.child_bootstrap` instead, which leaves jax
unimported.

XLA:GPU answers some illegal modules with a CHECK failure that aborts the whole process,
so every compile runs here, away from the caller (:mod:`~hlo_tools.jax_bridge.pjrt.driver`
starts it and reads the outcome). The request is a folder of files:

* ``request.json``: ``{"mode": "deviceless" | "client", "plugin": path, "options": {..},
  "libraries": [..]}`` (the topology's or the client's create options; the CUDA libraries
  a client needs loaded first, :func:`~hlo_tools.jax_bridge.pjrt.locate.cuda_libraries`);
* ``module.pb``: the serialized ``HloModuleProto``;
* ``options.pb``: the serialized ``CompileOptionsProto``.

The child writes ``result.bin`` (deviceless: the optimized ``HloModuleProto``; client: the
serialized executable) and ``result.json``: ``{"ok": true, "seconds": s}`` or
``{"ok": false, "error": message, "code": status code}``. It exits 0 whenever it wrote a
result; a crash leaves no result and its stderr says why. It needs no jax backend (and
no GPU in deviceless mode): only the plugin, through :mod:`ctypes`.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path

from hlo_tools.jax_bridge.pjrt import capi

__all__ = ["MODES", "main", "preload", "run_request"]

#: The compile modes the child runs.
MODES = ("deviceless", "client")


def preload(libraries: list[str], rounds: int = 4) -> None:
    """Loads shared libraries globally, as jax's plugin package does before a GPU client
    starts, so that the plugin finds them by name. A library whose dependencies are not
    loaded yet fails and is tried again in the next round; what still fails is left to
    the system's library path."""
    left = list(libraries)
    for _ in range(rounds):
        failed = []
        for path in left:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                failed.append(path)
        if not failed or len(failed) == len(left):
            return
        left = failed


def run_request(folder: Path) -> dict:
    """Runs the request in ``folder`` and writes ``result.bin``; returns ``result.json``'s
    content (a plugin error is a result, not an exception)."""
    request = json.loads((folder / "request.json").read_text())
    module = (folder / "module.pb").read_bytes()
    options = (folder / "options.pb").read_bytes()
    if request["mode"] not in MODES:
        return {"ok": False, "error": f"unknown mode {request['mode']!r}", "code": -1}
    try:
        preload(request.get("libraries", []))
        plugin = capi.Plugin(request["plugin"])
        start = time.perf_counter()
        if request["mode"] == "deviceless":
            program = capi.deviceless_optimized_program(plugin, module, options,
                                                        request["options"])
            result = capi.hlo_module_of(program)
        else:
            result = capi.client_serialized_executable(plugin, module, options,
                                                       request["options"])
        seconds = time.perf_counter() - start
    except capi.PjrtError as err:
        return {"ok": False, "error": str(err), "code": err.code}
    (folder / "result.bin").write_bytes(result)
    return {"ok": True, "seconds": seconds}


def main(argv: list[str]) -> int:
    """Entry point: ``argv[0]`` is the request folder."""
    folder = Path(argv[0])
    outcome = run_request(folder)
    partial = folder / "result.json.part"
    partial.write_text(json.dumps(outcome))
    partial.replace(folder / "result.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
