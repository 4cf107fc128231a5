"""Reading the files ``disco`` commands are given: whole, bounded, as text, or a clear error.

Every command that reads an HLO module (``simulate``, ``optimize``, ``estimate``) reads it
with :func:`read_text`: a missing file, a directory, an unreadable file, a file larger
than :func:`max_input_bytes`, bytes that are not UTF-8 and an empty file each raise
:class:`~disco_jax.cli.UserError` naming the file (and the line, for bad bytes), never a
Python exception with a traceback. The size is checked before anything is read, and a
file that is not a regular one (a pipe, ``/dev/zero``) is read at most one byte past the
limit, so no input can make the command read without end.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from disco_jax.cli import UserError

__all__ = ["DEFAULT_MAX_INPUT_MB", "MAX_INPUT_ENV", "max_input_bytes", "read_text"]

#: The environment variable that sets the largest input file, in MiB.
MAX_INPUT_ENV = "DISCO_MAX_INPUT_MB"
#: The largest input file by default, MiB: HLO of about a million instructions, far more
#: than a search can handle in its time budget (transformer-small is 5,412 nodes).
DEFAULT_MAX_INPUT_MB = 64


def max_input_bytes() -> int:
    """The largest file :func:`read_text` reads: ``$DISCO_MAX_INPUT_MB`` MiB, else
    :data:`DEFAULT_MAX_INPUT_MB`.

    Raises:
        UserError: the variable is set but not a positive number.
    """
    raw = os.environ.get(MAX_INPUT_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_INPUT_MB << 20
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb > 0 or mb != mb or mb == float("inf"):
        raise UserError(f"{MAX_INPUT_ENV}={raw!r}: expected a positive number of MiB")
    return int(mb * (1 << 20))


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


def _limit(limit: int) -> str:
    return f"the {_size(limit)} limit for an input file (set {MAX_INPUT_ENV} to raise it)"


def read_text(path: str | os.PathLike[str], what: str = "an HLO text file") -> str:
    """The file ``path`` as text (UTF-8; a leading byte-order mark is dropped).

    Args:
        path: the file.
        what: what the file should be, for the messages (``"an HLO text file"``).

    Raises:
        UserError: no such file, a directory, unreadable, larger than
            :func:`max_input_bytes`, not UTF-8 (``file:line``), or empty (``file:1``).
    """
    path = Path(path)
    limit = max_input_bytes()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read: {err.strerror or err}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{path}: is a directory, expected {what}")
    if stat.S_ISREG(st.st_mode) and st.st_size > limit:
        raise UserError(f"{path}: {_size(st.st_size)}, larger than {_limit(limit)}")
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as err:
        raise UserError(f"{path}: cannot read: {err.strerror or err}") from None
    if len(data) > limit:  # a pipe or device (or a file that grew since stat)
        raise UserError(f"{path}: more than {_limit(limit)}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x}); "
                        f"expected {what}") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip():
        raise UserError(f"{path}:1: empty file, expected {what}")
    return text
