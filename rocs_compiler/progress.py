"""Progress of long stages, reported to whoever listens (the CLI); silent by default.

The pipeline and the CLI mark stages that can take seconds with :func:`stage`::

    with stage("capture"):
        captured = capture(...)

Nothing is reported unless a listener is installed for the current context with
:func:`listening`; the library API installs none, so ``rocs.compile`` stays silent. A listener
has ``start(name)`` and ``end(name, seconds, ok)`` (``ok`` is False when the stage raised).
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from typing import Iterator, Optional, Protocol


class Listener(Protocol):
    def start(self, name: str) -> None: ...

    def end(self, name: str, seconds: float, ok: bool) -> None: ...


_LISTENER: ContextVar[Optional[Listener]] = ContextVar("rocs_progress_listener", default=None)


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Report the start and the duration of the enclosed work to the listener, if any."""
    listener = _LISTENER.get()
    if listener is None:
        yield
        return
    listener.start(name)
    started, ok = time.perf_counter(), False
    try:
        yield
        ok = True
    finally:
        listener.end(name, time.perf_counter() - started, ok)


@contextlib.contextmanager
def listening(listener: Optional[Listener]) -> Iterator[None]:
    """Install ``listener`` for the stages run inside the block (None: report nothing)."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)
