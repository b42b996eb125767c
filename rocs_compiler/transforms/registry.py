"""The model families ``apply_glm`` and ``apply_dca`` know, registered by the code defining them.

A family is a model class plus what one transform needs to convert it: the model's request
inputs and a conversion function. The library registers none. Model code registers its classes
with :func:`register_glm_family` or :func:`register_dca_family`, either

- right after defining the class, in the same module, or
- in a separate module that the class names in its ``__rocs_families__`` attribute (a module
  name); the lookup imports it the first time it meets the class. This keeps a model package
  importable without ``rocs_compiler`` (the zoo does this).

Either way holding an instance implies its family is found, whatever the import order. A model's
family is that of the first registered class in ``type(model).__mro__``: a subclass converts like
its nearest registered base.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from torch import nn

if TYPE_CHECKING:
    from .glm import Lanes

__all__ = ["DCAFamily", "GLMFamily", "register_dca_family", "register_glm_family"]


@dataclass(frozen=True)
class GLMFamily:
    """How ``apply_glm`` converts one model class."""

    request_inputs: tuple[str, ...]
    # (request, candidate) width of the model's interaction input
    groups: Callable[[nn.Module], tuple[int, int]]
    # rewrites the model in place; apply_glm hands it a deep copy of the user's model
    convert: Callable[[nn.Module, tuple[int, int], Lanes], None]


@dataclass(frozen=True)
class DCAFamily:
    """How ``apply_dca`` converts one model class."""

    request_inputs: tuple[str, ...]
    # returns the DCA model; must leave its argument unmodified
    convert: Callable[[nn.Module], nn.Module]


F = TypeVar("F", GLMFamily, DCAFamily)


class _Table(Generic[F]):
    """The families of one transform, by model class."""

    def __init__(self, transform: str):
        self.transform = transform
        self.families: dict[type, F] = {}

    def add(self, cls: type, family: F) -> None:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(
                f"register_{self.transform}_family: expected an nn.Module subclass, got {cls!r}"
            )
        # Two families for one class would make the conversion depend on import order.
        if cls in self.families:
            raise ValueError(
                f"register_{self.transform}_family: {cls.__qualname__} is already registered"
            )
        self.families[cls] = family

    def get(self, model: nn.Module) -> F | None:
        """The family of the first registered class in ``type(model).__mro__``, or None."""
        for cls in type(model).__mro__:
            if cls not in self.families and "__rocs_families__" in vars(cls):
                importlib.import_module(vars(cls)["__rocs_families__"])
            family = self.families.get(cls)
            if family is not None:
                return family
        return None

    def find(self, model: nn.Module) -> F:
        """The family of the first registered class in ``type(model).__mro__``."""
        family = self.get(model)
        if family is not None:
            return family
        registered = ", ".join(sorted(cls.__name__ for cls in self.families)) or "none"
        raise ValueError(
            f"apply_{self.transform}: no {self.transform.upper()} rule for model type "
            f"{type(model).__name__}; registered types: {registered} "
            f"(register_{self.transform}_family adds one)"
        )


GLM_FAMILIES = _Table[GLMFamily]("glm")
DCA_FAMILIES = _Table[DCAFamily]("dca")


def _names(request_inputs: Sequence[str] | str) -> tuple[str, ...]:
    return (request_inputs,) if isinstance(request_inputs, str) else tuple(request_inputs)


def register_glm_family(
    cls: type[nn.Module],
    *,
    request_inputs: Sequence[str] | str,
    groups: Callable[[nn.Module], tuple[int, int]],
    convert: Callable[[nn.Module, tuple[int, int], Lanes], None],
) -> None:
    """Teach ``apply_glm`` to convert ``cls`` (and its subclasses).

    Args:
        cls: the model class.
        request_inputs: the model's request-side inputs, those its layout puts first in the
            interaction input; ``apply_glm`` requires exactly these.
        groups: ``groups(model)`` is the (request, candidate) width of the interaction input.
        convert: ``convert(model, groups, lanes)`` rebuilds the hidden layers of ``model`` (a
            deep copy of the user's model) in place as GLM layers whose widths
            :class:`~rocs_compiler.transforms.glm.Lanes` splits; the helpers of
            :mod:`rocs_compiler.transforms.glm` do the usual layers.

    Raises ``ValueError`` if ``cls`` already has a GLM family.
    """
    GLM_FAMILIES.add(cls, GLMFamily(_names(request_inputs), groups, convert))


def register_dca_family(
    cls: type[nn.Module],
    *,
    request_inputs: Sequence[str] | str,
    convert: Callable[[nn.Module], nn.Module],
) -> None:
    """Teach ``apply_dca`` to convert ``cls`` (and its subclasses).

    Args:
        cls: the model class.
        request_inputs: the model's request-side inputs; ``apply_dca`` checks those it is given.
        convert: ``convert(model)`` returns the DCA form of ``model`` (same inputs and output),
            leaving ``model`` unmodified; a DCA model class whose constructor takes the original
            model fits.

    Raises ``ValueError`` if ``cls`` already has a DCA family.
    """
    DCA_FAMILIES.add(cls, DCAFamily(_names(request_inputs), convert))
