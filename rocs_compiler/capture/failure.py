"""What a failed capture tells the user: one line that says where and what to do, then detail.

:class:`CaptureError` is the :class:`~rocs_compiler.errors.CompileError` capture raises when no
route could export the model. Its message's first line is the user's source line the failure
points at, what went wrong there and what to do (``fallback="eager"`` included); torch's own
errors per route follow. :func:`source_line` finds that line (the CLI uses it for every error),
and :func:`torch_output_silenced` keeps torch's logs and partial graphs off stderr while a
route is tried (the error carries what they would say).
"""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import os
import re
import traceback
from pathlib import Path
from typing import Iterator, Optional, Sequence

from ..errors import CompileError

EAGER_ADVICE = 'pass fallback="eager" to run the model uncompiled'



def without_eager_advice(message: str) -> str:
    """``message`` without the advice to pass ``fallback="eager"`` (for a model that did)."""
    return message.replace(f", or {EAGER_ADVICE}", "").replace(f"; {EAGER_ADVICE}", "")


_SOURCE_IN_MESSAGE = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+)(?P<rest>.*)')
_DETAIL_LINES = 12


class CaptureError(CompileError):
    """No capture route could export the model.

    ``where`` is ``"at model.py:16: if user.sum() > 0:"`` (None when no line of the user's code
    is involved), ``cause`` says what went wrong, ``advice`` what to do, ``detail`` holds each
    route's error.
    """

    def __init__(self, where: Optional[str], cause: str, advice: str, detail: str):
        head = f"{where} -- {cause}; {advice}" if where else f"{cause}; {advice}"
        super().__init__(f"{head}\n{detail}")
        self.where, self.cause, self.advice, self.detail = where, cause, advice, detail


def capture_error(failures: Sequence[tuple[str, BaseException]]) -> CaptureError:
    """The error for routes that all failed: ``failures`` holds (route name, exception)."""
    errors = [err for _, err in failures]
    where = next((line for line in map(source_line, errors) if line), None)
    data_dependent = any(_is_data_dependent(err) for err in errors)
    if data_dependent:
        branch = where is not None and re.search(r":\s*(el)?if |:\s*while ", where)
        cause = (
            "the forward branches on tensor values (data-dependent control flow)"
            if branch or where is None
            else "the forward depends on tensor values (data-dependent shapes or control flow)"
        )
        advice = f"write it with tensor ops (torch.where), or {EAGER_ADVICE}"
    else:
        cause = f"could not capture the model ({_one_line(errors[0])})"
        advice = EAGER_ADVICE
    detail = "could not capture the model with a dynamic batch dimension:\n  " + "\n  ".join(
        f"{route}: {_first_lines(err)}" for route, err in failures
    )
    return CaptureError(where, cause, advice, detail)


def _is_data_dependent(err: BaseException) -> bool:
    return "DataDependent" in type(err).__name__ or "data-dependent" in str(err).lower()


def _one_line(err: BaseException, limit: int = 200) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_lines(err: BaseException) -> str:
    """The error's first lines, plus the first line left out that points into the user's own
    code (``File "model.py", line 16``): where the forward did what capture could not follow."""
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    keep = text[:_DETAIL_LINES]
    if len(text) > _DETAIL_LINES:
        keep.append(f"... ({len(text) - _DETAIL_LINES} more lines)")
        if not any(_user_location(line) for line in keep):
            keep += [line for line in text[_DETAIL_LINES:] if _user_location(line)][:1]
    return "\n    ".join(keep)


def _user_location(line: str) -> bool:
    match = _SOURCE_IN_MESSAGE.search(line)
    return match is not None and is_user_file(match["path"])


def is_user_file(path: str) -> bool:
    """A file of the user's, not of Python, torch or this package."""
    parts = Path(path).parts
    library = {"site-packages", "dist-packages", "rocs_compiler", "lib-python"}
    return not library & set(parts) and not path.startswith("<") and "python3." not in path


def source_line(err: BaseException) -> Optional[str]:
    """``at my_model.py:20: if u.sum() > 0:`` for the user code ``err`` points at, or None.

    Looks in the messages first (capture errors quote the line that branched on data), then in
    the tracebacks of the error and its causes (the innermost frame in the user's files).
    """
    seen: set[int] = set()
    chain = []
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    for error in chain:
        for match in _SOURCE_IN_MESSAGE.finditer(str(error)):
            if is_user_file(match["path"]):
                code = re.search(r"code: (.*)", match["rest"])
                return _at(match["path"], int(match["line"]), code[1] if code else None)
    for error in chain:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if is_user_file(f.filename)]
        if frames:
            return _at(frames[-1].filename, frames[-1].lineno, frames[-1].line)
    return None


def _at(path: str, line: int, code: Optional[str]) -> str:
    code = (code or linecache.getline(path, line)).strip()
    return f"at {_shown(path)}:{line}: {code}" if code else f"at {_shown(path)}:{line}"


def _shown(path: str) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    return path if relative.startswith("..") else relative


class _DropTorchRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".")[0] != "torch"


@contextlib.contextmanager
def torch_output_silenced() -> Iterator[None]:
    """No torch log records and no stderr prints (a failed export prints its partial graph).

    torch's log handlers (and the root's, where torch's records may propagate) hold the real
    stderr, so they get a filter for torch's records; prints go to a buffer.
    """
    loggers = [logging.root, logging.getLogger("torch")] + [
        logger
        for name, logger in list(logging.root.manager.loggerDict.items())
        if name.startswith("torch.") and isinstance(logger, logging.Logger)
    ]
    handlers = {handler for logger in loggers for handler in logger.handlers}
    drop = _DropTorchRecords()
    for handler in handlers:
        handler.addFilter(drop)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for handler in handlers:
            handler.removeFilter(drop)
