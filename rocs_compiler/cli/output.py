"""What the ``rocs`` command line writes to stderr: progress lines, notes, one-line errors, and
nothing from third parties unless ``--debug``.

- :class:`Console` is the progress listener (:mod:`rocs_compiler.progress`) the CLI installs:
  ``[rocs] capture ... 1.2 s`` per stage, nothing with ``-q``.
- :func:`error_lines` turns an exception into ``rocs: error: <message>`` and at most one hint
  line: the user's source line the error points at, or where to find the rest.
- :func:`third_party_silenced` swallows torch's log records, warnings and direct stderr prints
  (partial graphs of a failed export) while a command runs.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Iterator, Optional, TextIO

from ..capture.failure import CaptureError, source_line

_MAX_MESSAGE = 400


class Console:
    """Progress and notes on ``stream`` (the stderr of the command, not third parties')."""

    def __init__(self, stream: TextIO, progress: bool = True):
        self.stream, self.progress = stream, progress
        self._open: Optional[str] = None  # a stage whose line awaits its duration

    def start(self, name: str) -> None:
        if not self.progress:
            return
        self._close_line()
        self.stream.write(f"[rocs] {name} ...")
        self.stream.flush()
        self._open = name

    def end(self, name: str, seconds: float, ok: bool) -> None:
        if not self.progress:
            return
        took = f"{seconds:.1f} s" if ok else "failed"
        if self._open == name:
            self.stream.write(f" {took}\n")
        else:
            self._close_line()
            self.stream.write(f"[rocs] {name} {took}\n")
        self._open = None
        self.stream.flush()

    def note(self, text: str) -> None:
        """An informational line (``wrote report.html``); silent with ``-q``."""
        if self.progress:
            self.say(text)

    def say(self, text: str) -> None:
        """A line that is always shown (warnings, errors)."""
        self._close_line()
        self.stream.write(text + "\n")
        self.stream.flush()

    def _close_line(self) -> None:
        if self._open is not None:
            self.stream.write("\n")
            self._open = None


@contextlib.contextmanager
def third_party_silenced() -> Iterator[None]:
    """Drop log records, warnings and stderr prints of the libraries the command calls.

    The command's own output goes through a :class:`Console` holding the real stream.
    """
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _headline(err: BaseException, known: bool) -> tuple[str, bool]:
    """The message's first line, completed by the cause when it ends in a colon, and whether
    anything was left out."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__, True
    head = lines[0]
    rest = lines[1:]
    if head.endswith(":") and rest:
        text = str(err).lower()
        if "data-dependent" in text:
            cause = "the forward branches on tensor values (data-dependent control flow)"
        else:
            cause = rest[0]
        head = f"{head[:-1]}: {cause}"
    if not known:
        head = f"{type(err).__name__}: {head}"
    if len(head) > _MAX_MESSAGE:
        head = head[: _MAX_MESSAGE - 3] + "..."
    return head, len(rest) > 1 or not known


def error_lines(err: BaseException, known: bool) -> list[str]:
    """``rocs: error: <message>`` and at most one hint line.

    ``known`` errors (rocs's own) are shown by message; others also by type.
    """
    if isinstance(err, CaptureError):  # the source line goes on the hint line
        head, truncated, hint = f"could not capture the model: {err.cause}", True, err.where
    else:
        head, truncated = _headline(err, known)
        hint = source_line(err)
    lines = [f"rocs: error: {head}"]
    if hint:
        lines.append(f"  {hint}  (--debug shows the full error)")
    elif truncated:
        lines.append("  (run with --debug for the full error and the traceback)")
    return lines
