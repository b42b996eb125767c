"""Exceptions raised by rocs_compiler."""


class CompileError(RuntimeError):
    """The model could not be compiled; the message names the failing route and the cause."""


class InputError(ValueError):
    """A call to a compiled model received inputs that do not match its contract."""
