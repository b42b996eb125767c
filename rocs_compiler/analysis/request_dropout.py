"""Per-request dropout, an option of one compile: the switch the dropout and attention rules
(``rules_layers.py``) and defer's distribution of dropouts (``passes/defer_distribute.py``) read.

Drawing one dropout mask per request changes the model (eager draws one per impression row), so
it holds only inside :func:`dropout_per_request`, which the pipeline opens when
``Options.request_dropout == "per_request"``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

# Set for one compile (``Options.request_dropout == "per_request"``, :func:`dropout_per_request`).
_DROPOUT_PER_REQUEST: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "rocs_dropout_per_request", default=False
)


@contextlib.contextmanager
def dropout_per_request(enabled: bool) -> Iterator[None]:
    """Within this block, dropout in training mode on request-side values is row-wise: run on
    the R request rows, it draws one mask per request, which every impression of the request
    then shares. That changes the model (eager draws one mask per impression row), so it is
    an option the user asks for, never a default."""
    token = _DROPOUT_PER_REQUEST.set(enabled)
    try:
        yield
    finally:
        _DROPOUT_PER_REQUEST.reset(token)


def dropout_is_per_request() -> bool:
    """True inside :func:`dropout_per_request` (enabled)."""
    return _DROPOUT_PER_REQUEST.get()
