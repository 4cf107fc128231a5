"""Where disco_jax keeps files of its own: the one home of its directories.

* :func:`cache_dir`: built C kernels, single-op timings, raw benchmark data. It is
  ``$DISCO_CACHE_DIR`` when set, else the user's cache directory (``platformdirs``:
  ``$XDG_CACHE_HOME/disco_jax``, default ``~/.cache/disco_jax``, on Linux).
* :func:`config_dir`: the user's own files, e.g. hardware files written by
  ``disco calibrate`` (``$DISCO_CONFIG_DIR``, else ``~/.config/disco_jax`` on Linux).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

__all__ = ["cache_dir", "config_dir"]


def cache_dir(*parts: str) -> Path:
    """``$DISCO_CACHE_DIR`` (else the user cache directory), joined with ``parts``."""
    base = os.environ.get("DISCO_CACHE_DIR") or platformdirs.user_cache_dir("disco_jax")
    return Path(base).joinpath(*parts)


def config_dir(*parts: str) -> Path:
    """``$DISCO_CONFIG_DIR`` (else the user config directory), joined with ``parts``."""
    base = os.environ.get("DISCO_CONFIG_DIR") or platformdirs.user_config_dir("disco_jax")
    return Path(base).joinpath(*parts)
