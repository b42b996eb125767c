"""Exceptions raised by rocs_compiler."""


class CompileError(RuntimeError):
    """The model could not be compiled; the message names the failing route and the cause."""


class InputError(ValueError):
    """A call to a compiled model received inputs that do not match its contract."""


class SizeChange(InputError):
    """A call whose inputs differ from the compiled sizes only past the batch dim of batched
    inputs; ``places`` holds each ``(input, dim)`` that differs (``dim`` counted with the batch
    dim), across every input of the call. A compiled model may compile itself again with those
    dims dynamic (``runtime/modes/new_sizes.py``)."""

    def __init__(self, message: str, places: tuple[tuple[str, int], ...]):
        super().__init__(message)
        self.places = places


class OptionsError(ValueError):
    """Compiler options with an unknown key or a value of the wrong type.

    ``where`` names the entry point, ``problems`` says what is wrong (one string per key) and
    ``valid`` lists the valid options with their types and defaults.
    """

    def __init__(self, where: str, problems: list[str], valid: str):
        super().__init__(where, problems, valid)
        self.where, self.problems, self.valid = where, problems, valid

    def __str__(self) -> str:
        return f"{self.where}: {'; '.join(self.problems)}\n{self.valid}"


class TargetError(ValueError):
    """A ``rocs`` command's TARGET or input specs could not be resolved into a model to compile."""


class DependencyError(ImportError):
    """An optional dependency lacks what the package uses (a release outside the tested range);
    the message names the release found and the range to install."""
