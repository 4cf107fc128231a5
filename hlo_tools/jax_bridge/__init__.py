"""Bridge between jax and HLO text: extract a program, compile our text exactly as written.

The package is the project's one contact with jax and XLA below jax's public API, in
modules by job:

* :mod:`~hlo_tools.jax_bridge.internals` -- the only importer of jax/jaxlib internals,
  with the verified jax versions and what differs between them;
* :mod:`~hlo_tools.jax_bridge.extract` -- a jax function's pre-optimization HLO text;
* :mod:`~hlo_tools.jax_bridge.text` -- HLO text as XLA reads it (parse, verify, MLIR);
* :mod:`~hlo_tools.jax_bridge.passes` -- which XLA passes ``exact`` compiles switch off
  (``xla_passes.toml``, per backend), and the options of one compile;
* :mod:`~hlo_tools.jax_bridge.compile` -- :func:`compile_module`: text compiled in place
  of a function's lowering, from the text alone, standalone or per device;
* :mod:`~hlo_tools.jax_bridge.route` -- whether a backend compiles hand-written fusions;
* :mod:`~hlo_tools.jax_bridge.pjrt` -- XLA:GPU's PJRT plugin compiling HLO as written
  (program format ``"hlo"``), on a GPU or for a described one without it;
* :mod:`~hlo_tools.jax_bridge.transplant` -- an executable compiled outside jax's client,
  run by jax as the step's ``Compiled``;
* :mod:`~hlo_tools.jax_bridge.devices` -- this process's devices for a module, its memory;
* :mod:`~hlo_tools.jax_bridge.sync` -- barriers and exchanges of a multi-process job;
* :mod:`~hlo_tools.jax_bridge.shared` -- one compile per job: process 0 compiles (a
  batch: spread over the processes), the other processes load the executable.

Typical use::

    text = extract(step, params, batch)            # pre-optimization whole-program HLO
    new_text = rewrite(text)                        # our plan, e.g. hand-written fusions
    run = compile_module(new_text, InPlaceOf(step, (params, batch)), CompileOptions(exact=True))
    new_params, loss = run(params, batch)
    print(run.as_text())                            # what XLA actually compiled

A module given only as text (an HLO file, no Python function) compiles the same way for
:class:`FromText`, which also makes inputs from its entry parameters::

    run, inputs = compile_module(text, FromText(), CompileOptions(exact=True, library=True))
    outputs = run(*inputs)
"""

from __future__ import annotations

from hlo_tools.jax_bridge.compile import (
    CompiledHlo,
    CompiledText,
    FromText,
    InPlaceOf,
    PerDevice,
    PerDeviceHlo,
    Standalone,
    StandaloneHlo,
    compile_module,
)
from hlo_tools.jax_bridge.devices import backend_info, device_memory_bytes, give_host_devices
from hlo_tools.jax_bridge.errors import DevicesUnavailableError, HloCompileError
from hlo_tools.jax_bridge.extract import extract, fresh_function, lowered_text
from hlo_tools.jax_bridge.internals import VERIFIED_VERSIONS, check_versions
from hlo_tools.jax_bridge.passes import (
    CompileOptions,
    exact_compiler_options,
    load_pass_config,
    plan_library_options,
    platform_family,
    xla_options,
)
from hlo_tools.jax_bridge.route import (
    BUCKETS,
    EXACT,
    ROUTES,
    Route,
    known_route,
    probe_route,
)
from hlo_tools.jax_bridge.shared import SharedCompiles, compiles_shared, spread
from hlo_tools.jax_bridge.sync import Coordinator
from hlo_tools.jax_bridge.text import (
    count_all_reduces,
    hlo_text_to_mlir,
    verify_hlo,
    xla_canonical_text,
    xla_parse_ok,
)

__all__ = [
    "BUCKETS",
    "EXACT",
    "ROUTES",
    "VERIFIED_VERSIONS",
    "CompileOptions",
    "CompiledHlo",
    "CompiledText",
    "Coordinator",
    "DevicesUnavailableError",
    "FromText",
    "HloCompileError",
    "InPlaceOf",
    "PerDevice",
    "PerDeviceHlo",
    "Route",
    "SharedCompiles",
    "Standalone",
    "StandaloneHlo",
    "backend_info",
    "check_versions",
    "compile_module",
    "compiles_shared",
    "count_all_reduces",
    "device_memory_bytes",
    "exact_compiler_options",
    "extract",
    "fresh_function",
    "give_host_devices",
    "hlo_text_to_mlir",
    "known_route",
    "load_pass_config",
    "lowered_text",
    "plan_library_options",
    "platform_family",
    "probe_route",
    "spread",
    "verify_hlo",
    "xla_canonical_text",
    "xla_options",
    "xla_parse_ok",
]

check_versions()
