"""Which XLA passes to switch off, per backend (``xla_passes.toml``, package data).

``exact`` compiles keep a module's fusions and all-reduces as written by disabling the
passes that create fusions or combine collectives; the kernel library's single-op
rewriters may stay on (``library``). The lists are per platform family (``cpu``,
``gpu``); :func:`platform_family` is the one map from jax platform names to them.
:class:`CompileOptions` says how one compile goes, :func:`xla_options` turns it into
XLA's options.
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

from hlo_tools.jax_bridge.errors import HloCompileError

__all__ = [
    "DEFAULT_PASS_CONFIG",
    "DISABLE",
    "CompileOptions",
    "exact_compiler_options",
    "load_pass_config",
    "plan_library_options",
    "platform_family",
    "xla_options",
]

#: The per-backend XLA pass lists (package data of the bridge).
DEFAULT_PASS_CONFIG = Path(__file__).with_name("xla_passes.toml")
#: The XLA option that takes a comma-separated list of pass names to skip.
DISABLE = "xla_disable_hlo_passes"

# jax platform name -> platform family (a section of xla_passes.toml, of a hardware file).
_PLATFORM_FAMILIES = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu"}


@functools.lru_cache(maxsize=8)
def load_pass_config(path: str | Path | None = None) -> dict[str, Any]:
    """Reads the per-backend XLA pass lists (``xla_passes.toml`` by default)."""
    with open(path or DEFAULT_PASS_CONFIG, "rb") as fh:
        return tomllib.load(fh)


def platform_family(platform: str) -> str | None:
    """``"cpu"`` or ``"gpu"`` for a jax platform name (cpu, cuda, rocm, gpu); None for
    another. The one map from platforms to config sections (pass lists, hardware files,
    backend constants)."""
    return _PLATFORM_FAMILIES.get(platform.lower())


def section(platform: str) -> str:
    """The config section of a jax platform name (cpu, cuda, rocm).

    Raises:
        HloCompileError: a platform with no pass list.
    """
    family = platform_family(platform)
    if family is None:
        raise HloCompileError(
            f"exact=True has no pass list for backend {platform!r} (known: cpu, gpu)"
        )
    return family


def exact_compiler_options(platform: str, config: str | Path | None = None,
                           library: bool = False) -> dict[str, Any]:
    """Compiler options that make XLA compile fusions and collectives as written.

    Args:
        platform: jax platform name: ``cpu``, ``cuda``, ``rocm`` or ``gpu``.
        config: Pass config TOML; ``xla_passes.toml`` when None.
        library: keep the section's ``library_passes`` running (they hand a single op
            to a kernel library, e.g. XLA:CPU's YNNPACK ``__ynn_fusion`` around a
            ``dot``): used to time an op the way XLA's default pipeline runs it.

    Returns:
        ``{"xla_disable_hlo_passes": "a,b,..."}`` plus the section's ``exact_options``.
    """
    sect = load_pass_config(config)[section(platform)]
    kept = set(sect.get("library_passes", ())) if library else set()
    disabled = [name for name in sect["exact_disable"] if name not in kept]
    options: dict[str, Any] = {DISABLE: ",".join(disabled)}
    options.update(sect.get("exact_options", {}))
    return options


def plan_library_options(platform: str, config: str | Path | None = None) -> dict[str, Any]:
    """Exact-mode options under which dots and convolutions run on XLA's kernel library.

    The section's ``library_passes`` keep running (as in
    ``exact_compiler_options(platform, library=True)``) and its ``library_options`` are
    added: on XLA:CPU these restrict YNNPACK's rewriter to single dots and convolutions,
    each wrapped alone in a ``kind=kCustom`` ``__ynn_fusion`` as XLA's default pipeline
    wraps them, so a plan's own fusions and all-reduces stay exactly as written.

    Args:
        platform: jax platform name: ``cpu``, ``cuda``, ``rocm`` or ``gpu``.
        config: Pass config TOML; ``xla_passes.toml`` when None.

    Returns:
        Options for ``Lowered.compile(compiler_options=...)``.
    """
    options = exact_compiler_options(platform, config, library=True)
    options.update(load_pass_config(config)[section(platform)].get("library_options", {}))
    return options


class CompileOptions(NamedTuple):
    """How XLA compiles a module (:func:`xla_options` gives XLA's options for it).

    Attributes:
        exact: disable the backend's XLA passes that create fusions or combine
            collectives (``xla_passes.toml``), so the module's fusions and all-reduces
            stay as written; False: XLA's default pipeline.
        library: with ``exact``, ops XLA's kernel library (YNNPACK on CPU) still runs:
            True: dots and convolutions, each alone in a ``kind=kCustom`` fusion, as
            every enacted plan runs them (:func:`plan_library_options`); ``"default"``:
            the ops XLA's default pipeline hands it (the config's ``library_passes`` on,
            their flags XLA's defaults: a single op timed as XLA runs it); False: none.
            Ignored without ``exact``.
        extra: more XLA options: their ``xla_disable_hlo_passes`` is appended to the
            exact-mode list, other keys override it.
    """

    exact: bool = True
    library: bool | Literal["default"] = False
    extra: Mapping[str, Any] | None = None


def xla_options(platform: str, options: CompileOptions) -> dict[str, Any]:
    """The XLA options of one compile on ``platform`` (a jax platform name): the
    exact-mode ones :class:`CompileOptions` asks for, merged with its ``extra``.

    Raises:
        HloCompileError: ``exact`` on a platform with no pass list.
    """
    if not options.exact:
        merged: dict[str, Any] = {}
    elif options.library == "default":
        merged = exact_compiler_options(platform, library=True)
    elif options.library:
        merged = plan_library_options(platform)
    else:
        merged = exact_compiler_options(platform)
    extra = dict(options.extra or {})
    disabled = [merged.get(DISABLE, ""), extra.pop(DISABLE, "")]
    merged.update(extra)
    if any(disabled):
        merged[DISABLE] = ",".join(name for name in disabled if name)
    return merged
