"""Request names in dynamo's frames: which graph inputs a request name covers, which names the
backend cannot follow (``KeyedJaggedTensor`` keys), and whether an unknown name is a misspelling
or a helper frame's other argument names.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Optional, Sequence

import torch

from ..formats.leaves import covers


def without_kjt_keys(names: Sequence[str]) -> list[str]:
    """``names`` without ``KeyedJaggedTensor`` keys, which have no meaning in a dynamo graph:
    dynamo traces TorchRec's lookups as one jagged ``embedding_bag`` over every row of the
    batch, which no request name can split. They are dropped with a warning, and what they
    name runs unshared (exactly); column ranges stay (``request_covers`` maps them to their
    argument, and ``rocs.compile`` wraps the dynamo graph in column lanes as it wraps a model)."""
    lanes = [n for n in names if "[" in n]
    keys = [n for n in lanes if not n.split("[", 1)[1].lstrip().startswith(":")]
    if keys:
        warnings.warn(
            f"rocs: the torch.compile backend cannot follow KeyedJaggedTensor keys "
            f"({', '.join(map(repr, keys))}) into dynamo's graphs, where TorchRec's lookups are one "
            "jagged embedding_bag over the whole batch: they run unshared. rocs.compile(model, "
            "request_inputs, example_inputs=...) shares them",
            stacklevel=3,
        )
    return [n for n in names if n not in keys]


def request_covers(request: str, leaf: str) -> bool:
    if "[" in request:  # a column range names columns of its argument (``formats/columns.py``)
        request = request.split("[", 1)[0].strip()
    return covers(request, leaf)


def unknown_request_names(requested: list[str], present: list[str]) -> tuple[Optional[str], bool]:
    """(what is wrong, whether the frame is nested) when a request name is not an argument of
    the frame being compiled.

    Only the first frame of a function is checked: a frame resumed after a graph break sees only
    the locals still alive, and an input missing there is not a mistake. A *nested* frame is a
    function that user code called after a graph break (a helper taking the history as ``x``):
    its arguments carry other names, so the caller runs it unshared; for the frame the user
    compiled, an unknown name is a misspelling and the caller raises.
    """
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:
        return None, False
    code = getattr(tx, "f_code", None)
    if code is None or code.co_name.startswith("torch_dynamo_resume_in_"):
        return None, False
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    arguments = [a for a in code.co_varnames[:count] if a != "self"]
    unknown = [r for r in requested if r not in present and r.split(".")[0] not in arguments]
    if not unknown:
        return None, False
    message = (
        f"unknown request input(s) {', '.join(map(repr, unknown))}; the compiled function "
        f"{code.co_name}() takes: {', '.join(arguments)}"
    )
    return message, _nested(code)


def _nested(code) -> bool:
    """True when the frame dynamo is compiling (of ``code``) is not the one the user compiled:
    called from outside torch (by the user's own function after a graph break), or a module hook
    (called by the module's ``_call_impl``, which calls the compiled ``forward`` too). That
    caller is the frame below dynamo's frame-conversion callback on the Python stack."""
    frame, caller = inspect.currentframe(), None
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CONVERT_FRAME):
            caller = frame.f_back
        frame = frame.f_back
    if caller is None:
        return False
    if not caller.f_code.co_filename.startswith(_TORCH_DIR):
        return True
    if not caller.f_code.co_filename.endswith(_MODULE_CALL):
        return False
    forward = caller.f_locals.get("forward_call")  # ``_call_impl``'s, or its hooks' ``inner``'s
    return forward is not None and getattr(forward, "__code__", None) is not code


_TORCH_DIR = os.path.dirname(torch.__file__)
_CONVERT_FRAME = os.path.join("_dynamo", "convert_frame.py")
_MODULE_CALL = os.path.join("nn", "modules", "module.py")
