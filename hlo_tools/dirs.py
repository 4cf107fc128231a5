"""Where disco_jax keeps files of its own: the one home of its directories.

* :func:`cache_dir`: built C kernels, single-op timings, raw benchmark data. It is
  ``$DISCO_CACHE_DIR`` when set, else the user's cache directory (``platformdirs``:
  ``$XDG_CACHE_HOME/disco_jax``, default ``~/.cache/disco_jax``, on Linux).
* :func:`config_dir`: the user's own files, e.g. hardware files written by
  ``disco calibrate`` (``$DISCO_CONFIG_DIR``, else ``~/.config/disco_jax`` on Linux).

:func:`write_atomic` is how every file of ours is written: whole or not at all.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import platformdirs

__all__ = ["cache_dir", "config_dir", "write_atomic"]


def cache_dir(*parts: str) -> Path:
    """``$DISCO_CACHE_DIR`` (else the user cache directory), joined with ``parts``."""
    base = os.environ.get("DISCO_CACHE_DIR") or platformdirs.user_cache_dir("disco_jax")
    return Path(base).joinpath(*parts)


def config_dir(*parts: str) -> Path:
    """``$DISCO_CONFIG_DIR`` (else the user config directory), joined with ``parts``."""
    base = os.environ.get("DISCO_CONFIG_DIR") or platformdirs.user_config_dir("disco_jax")
    return Path(base).joinpath(*parts)


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *,
                 mkdir: bool = True) -> Path:
    """Writes ``data`` to ``path`` through a temporary file in the same directory, flushed
    to disk, then ``os.replace``: readers (and a crash) see the old file or the whole new
    one, never a part; on an error the temporary file is removed and ``path`` untouched.

    Args:
        path: the file.
        data: text (written as UTF-8) or bytes.
        mkdir: create the parent directories; False: they must exist.

    Returns:
        ``path`` as a ``Path``.
    """
    path = Path(path)
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
