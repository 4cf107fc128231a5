"""Whether a backend compiles hand-written fusions: the route by which plans reach it.

* :data:`EXACT`: the backend compiles a module's ``fusion`` instructions as written:
  XLA:CPU, whose in-process client compiles the MLIR with ``mhlo.fusion`` directly, and
  XLA:GPU through its PJRT plugin's own compile of HLO (program format ``"hlo"``; jax's
  client would serialize the module to portable StableHLO, which has no fusion). Every
  rewrite of the search can be enacted.
* :data:`BUCKETS`: it does not (the plugin is missing, its compile fails, or XLA does not
  keep the fusion). Plans there hold only what plain ops express -- AllReduce buckets and
  their order -- and run over XLA's own fusion.

:func:`probe_route` decides by compiling and running a two-op fusion on the backend
(cached per platform); :func:`known_route` answers for a backend this process cannot
reach, from the pass configuration's record of the probe.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import numpy as np

from hlo_tools.jax_bridge import internals
from hlo_tools.jax_bridge.passes import CompileOptions, load_pass_config, section

__all__ = ["BUCKETS", "EXACT", "ROUTES", "Route", "known_route", "probe_route"]

EXACT, BUCKETS = "exact", "buckets"
ROUTES = (EXACT, BUCKETS)

_PROBE = """HloModule disco_route_probe

%probe_fused (p0: f32[8], p1: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  %sum = f32[8]{0} add(f32[8]{0} %p0, f32[8]{0} %p1)
  ROOT %product = f32[8]{0} multiply(f32[8]{0} %sum, f32[8]{0} %p1)
}

ENTRY %main (a: f32[8], b: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = f32[8]{0} parameter(1)
  ROOT %fused = f32[8]{0} fusion(f32[8]{0} %a, f32[8]{0} %b), kind=kLoop, calls=%probe_fused
}
"""


def _probe_function(a: jax.Array, b: jax.Array) -> jax.Array:
    """What the probe's fusion computes, as the jitted function whose place it takes."""
    return (a + b) * b


class Route(NamedTuple):
    """How plans reach a backend.

    Attributes:
        name: :data:`EXACT` or :data:`BUCKETS`.
        platform: the jax platform it is for (``cpu``, ``cuda``, ...).
        reason: why, in words (the probe's finding or XLA's error).
    """

    name: str
    platform: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return self._asdict()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


@functools.cache
def probe_route(platform: str | None = None) -> Route:
    """Compiles and runs a module holding one hand-written two-op fusion on ``platform``
    with XLA's fusion passes off, and checks that the fusion is kept and computes what
    its ops compute. The result is cached per platform (one probe per process).

    Returns:
        :data:`EXACT` when it is, else :data:`BUCKETS` with the reason.
    """
    from hlo_tools.jax_bridge.compile import InPlaceOf, Standalone, compile_module

    platform = platform or jax.default_backend()
    plugin = internals.is_c_api_client(platform)
    client = "the PJRT plugin's own compile" if plugin else "an in-process client"
    a = np.arange(8, dtype=np.float32)
    b = np.full(8, 0.5, np.float32)
    try:
        if plugin:  # as plans compile there: in place of a jitted function, legal for it
            from hlo_tools.gpu_legal import gpu_legal
            from hlo_tools.parser import parse
            from hlo_tools.printer import to_text

            device = jax.devices(platform)[0]
            placed = [jax.device_put(x, device) for x in (a, b)]
            run = compile_module(to_text(gpu_legal(parse(_PROBE))),
                                 InPlaceOf(_probe_function, placed), CompileOptions(exact=True))
            got = np.asarray(run(*placed))
        else:
            run = compile_module(_PROBE, Standalone(platform=platform),
                                 CompileOptions(exact=True))
            (got,) = run(a, b)
        compiled = run.as_text()
    except Exception as err:  # noqa: BLE001 - whatever the backend raises decides it
        return Route(BUCKETS, platform, f"{platform} ({client}) does not compile a "
                     f"hand-written fusion: {_first_line(err)}")
    if not np.allclose(got, (a + b) * b):
        return Route(BUCKETS, platform, f"{platform}: a hand-written fusion computes "
                     "another result")
    if " fusion(" not in compiled or "multiply(" not in compiled:
        return Route(BUCKETS, platform, f"{platform}: XLA did not keep a hand-written "
                     "fusion as written")
    return Route(EXACT, platform, f"{platform} ({client}) compiles hand-written fusions "
                 "as written")


def known_route(platform: str) -> Route:
    """The route of a backend this process may not reach: the probe's result where this
    process runs ``platform``, else what the pass configuration records for its family
    (``enact_fusions`` and ``route_reason`` of ``xla_passes.toml``)."""
    if platform in {d.platform for d in jax.devices()} or platform == jax.default_backend():
        return probe_route(platform)
    sect = load_pass_config()[section(platform)]
    name = EXACT if sect.get("enact_fusions", True) else BUCKETS
    return Route(name, platform, sect.get("route_reason", f"recorded for {platform}"))
