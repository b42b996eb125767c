"""The model conversions ``apply_glm`` and ``apply_dca`` know, registered by the code defining them.

A conversion is a model class plus what one transform needs to convert it: the model's request
inputs and a conversion function. The library registers none. Model code registers its classes
with :func:`register_glm_model` or :func:`register_dca_model`, either

- right after defining the class, in the same module, or
- in a separate module that the class names in its ``__rocs_conversions__`` attribute (a module
  name); the lookup imports it the first time it meets the class. This keeps a model package
  importable without ``rocs_compiler`` (the zoo does this).

Either way holding an instance implies its conversion is found, whatever the import order. A model's
conversion is that of the first registered class in ``type(model).__mro__``: a subclass converts like
its nearest registered base.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from torch import nn

if TYPE_CHECKING:
    from .glm_lanes import Lanes

__all__ = ["DCAConversion", "GLMConversion", "register_dca_model", "register_glm_model"]


@dataclass(frozen=True)
class GLMConversion:
    """How ``apply_glm`` converts one model class."""

    request_inputs: tuple[str, ...]
    # (request, candidate) width of the model's interaction input
    groups: Callable[[nn.Module], tuple[int, int]]
    # rewrites the model in place; apply_glm hands it a deep copy of the user's model
    convert: Callable[[nn.Module, tuple[int, int], Lanes], None]


@dataclass(frozen=True)
class DCAConversion:
    """How ``apply_dca`` converts one model class."""

    request_inputs: tuple[str, ...]
    # returns the DCA model; must leave its argument unmodified
    convert: Callable[[nn.Module], nn.Module]


F = TypeVar("F", GLMConversion, DCAConversion)


class _Table(Generic[F]):
    """The conversions of one transform, by model class."""

    def __init__(self, transform: str):
        self.transform = transform
        self.conversions: dict[type, F] = {}

    def add(self, cls: type, conversion: F) -> None:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(
                f"register_{self.transform}_model: expected an nn.Module subclass, got {cls!r}"
            )
        # Two conversions for one class would make the conversion depend on import order.
        if cls in self.conversions:
            raise ValueError(
                f"register_{self.transform}_model: {cls.__qualname__} is already registered"
            )
        self.conversions[cls] = conversion

    def get(self, model: nn.Module) -> F | None:
        """The conversion of the first registered class in ``type(model).__mro__``, or None."""
        for cls in type(model).__mro__:
            if cls not in self.conversions and "__rocs_conversions__" in vars(cls):
                importlib.import_module(vars(cls)["__rocs_conversions__"])
            conversion = self.conversions.get(cls)
            if conversion is not None:
                return conversion
        return None

    def find(self, model: nn.Module) -> F:
        """The conversion of the first registered class in ``type(model).__mro__``."""
        conversion = self.get(model)
        if conversion is not None:
            return conversion
        registered = ", ".join(sorted(cls.__name__ for cls in self.conversions)) or "none"
        raise ValueError(
            f"apply_{self.transform}: no {self.transform.upper()} rule for model type "
            f"{type(model).__name__}; registered types: {registered} "
            f"(register_{self.transform}_model adds one)"
        )


GLM_CONVERSIONS = _Table[GLMConversion]("glm")
DCA_CONVERSIONS = _Table[DCAConversion]("dca")


def _names(request_inputs: Sequence[str] | str) -> tuple[str, ...]:
    return (request_inputs,) if isinstance(request_inputs, str) else tuple(request_inputs)


def register_glm_model(
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

    Raises ``ValueError`` if ``cls`` already has a GLM conversion.
    """
    GLM_CONVERSIONS.add(cls, GLMConversion(_names(request_inputs), groups, convert))


def register_dca_model(
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

    Raises ``ValueError`` if ``cls`` already has a DCA conversion.
    """
    DCA_CONVERSIONS.add(cls, DCAConversion(_names(request_inputs), convert))
