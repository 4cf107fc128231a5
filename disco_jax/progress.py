"""What a first call under ``ENABLE_SEARCH=1`` tells the user while it works.

A search's first call takes seconds to minutes; a user who sees nothing for that long
assumes a hang. :class:`FirstCallProgress` stays silent while the call is short and, once
it has run :data:`QUIET_S` seconds (a line saying what the time budget left out:
at once), writes to stderr the phase it is in, the time spent,
what is left of the budget and the best figure so far: one ``rich`` status line that
updates in place on a terminal, a plain line per phase otherwise (a log file, a job's
captured output). In a multi-process job only process 0 writes.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import IO

__all__ = ["ALWAYS", "QUIET_S", "FirstCallProgress"]

#: A first call shorter than this prints nothing, seconds...
QUIET_S = 2.0
#: ...but the lines that start so: what the time budget left out (the user set it).
ALWAYS = ("time budget:",)


class FirstCallProgress:
    """Progress of one first call, fed by the pipeline's phase lines.

    Use as a context manager; call it with each phase line (``progress(text)``), the
    ``progress`` argument of :func:`~disco_jax.pipeline.optimize.optimize_step`.

    Args:
        budget_s: the first call's budget, seconds (None: no remaining time shown).
        enabled: False: silent (other processes of a job, tests that want quiet).
        stream: where to write (default ``sys.stderr``).
        quiet_s: silent until the call has run this long, seconds.
    """

    def __init__(self, budget_s: float | None, *, enabled: bool = True,
                 stream: IO[str] | None = None, quiet_s: float = QUIET_S):
        self.budget_s = budget_s
        self.enabled = enabled
        self._stream = stream
        self._quiet_s = quiet_s
        self._t0 = time.monotonic()
        self._phase = "lowering the step"
        self._best = ""
        self._lock = threading.Lock()
        self._shown = False
        self._status = None
        self._plain = None
        self._timer: threading.Timer | None = None

    def __enter__(self) -> FirstCallProgress:
        self._t0 = time.monotonic()
        if self.enabled:
            self._timer = threading.Timer(self._quiet_s, self._show)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    def __call__(self, text: str) -> None:
        """A new phase line (``"choice: ..."`` and ``"search: ..."`` lines also become
        the best so far)."""
        with self._lock:
            if text.startswith(("choice:", "search:")):
                self._best = text
            self._phase = text
            if self._shown:
                self._render()
            elif self.enabled and text.startswith(ALWAYS):
                self._console().print(self.line(), markup=False, soft_wrap=True)

    def line(self) -> str:
        """The current status: phase, elapsed, remaining budget, best so far."""
        elapsed = self.elapsed_s
        parts = [f"DisCo first call {elapsed:.0f} s"]
        if self.budget_s is not None:
            left = self.budget_s - elapsed
            parts.append(f"{left:.0f} s of the budget left" if left >= 0
                         else f"{-left:.0f} s over the budget")
        parts.append(self._phase)
        if self._best and self._best != self._phase:
            parts.append(f"best so far: {self._best}")
        return " | ".join(parts)

    def _console(self):
        from rich.console import Console

        return Console(file=self._stream or sys.stderr, highlight=False)

    def _show(self) -> None:
        with self._lock:
            if self._shown or not self.enabled:
                return
            self._shown = True
            console = self._console()
            if console.is_terminal:
                self._status = console.status(self.line())
                self._status.start()
                self._tick()
            else:
                self._plain = console
            self._render()

    def _tick(self) -> None:
        """Refreshes the terminal line every second (elapsed and remaining move)."""
        def refresh() -> None:
            with self._lock:
                if self._status is None:
                    return
                self._status.update(self.line())
            self._tick()

        self._timer = threading.Timer(1.0, refresh)
        self._timer.daemon = True
        self._timer.start()

    def _render(self) -> None:
        if self._status is not None:
            self._status.update(self.line())
        else:
            self._plain.print(self.line(), markup=False, soft_wrap=True)

    def close(self) -> None:
        """Stops the status line; says how long the call took when it showed any."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            status, self._status = self._status, None
            shown, self._shown = self._shown, False
            self.enabled = False
        if status is not None:
            status.stop()
        if shown:
            self._console().print(f"DisCo first call done in {self.elapsed_s:.1f} s"
                                  + (f": {self._best}" if self._best else ""),
                                  markup=False, soft_wrap=True)
