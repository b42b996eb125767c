"""A call's length class: per dynamic size past the batch dim (a history length the example
marked dynamic, a KJT key's padded width), the bit length of the call's size. It joins every
bucket of the program choice (``runtime/choice/program_choice.py``), since what sharing saves,
and what each program costs, changes with the length: a bucket measured at long histories must
not decide for short ones.

The sizes are read where the input checks found them (``input_checks.py``, ``_Spec.symbols``):
one input dim per size symbol, the first that carries it (dims the graph ties together are one
size, checked equal in every call). A model without dynamic sizes has no :class:`LengthDims`
(None, found once at compile time): its buckets stay ``(layout, rows bits, requests bits)`` and
its calls read nothing.

Identity: two calls in one bucket have their lengths in the same powers-of-two range.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .input_checks import InputSpecs


class LengthDims:
    """The input dims a call's dynamic sizes are read from: ``(input, dim)`` per size symbol,
    ``dim`` counted with the batch dim."""

    def __init__(self, places: Sequence[tuple[str, int]], input_names: Sequence[str]):
        self.places = tuple(places)
        # The same dims by position in the program's inputs (``program_io.graph_inputs``).
        position = {name: i for i, name in enumerate(input_names)}
        self._positions = tuple((position[name], dim) for name, dim in self.places)

    @classmethod
    def of_specs(cls, specs: InputSpecs | None, input_names: Sequence[str]) -> LengthDims | None:
        """The dims of ``specs``' size symbols; None when there are none."""
        places = [] if specs is None else [p for p in specs.size_dims() if p[0] in input_names]
        return cls(places, input_names) if places else None

    def of(self, leaves: Mapping[str, object]) -> tuple[int, ...]:
        """The length class of the call named ``leaves``."""
        try:  # read as it comes: this runs in every call
            return tuple([leaves[name].shape[dim].bit_length() for name, dim in self.places])
        except (KeyError, AttributeError, IndexError):  # refused by the checks later
            return tuple(_size(leaves.get(name), dim).bit_length() for name, dim in self.places)

    def of_call(self, contract, args: tuple, kwargs: dict) -> tuple[int, ...]:
        """The length class of the call as made (``contract``'s, an ``InputContract``): read
        from its keyword tensors where they are the inputs, else from its named leaves."""
        try:
            return tuple([kwargs[name].shape[dim].bit_length() for name, dim in self.places])
        except (KeyError, AttributeError, IndexError):
            return self.of(contract.leaves(args, kwargs))

    def of_inputs(self, inputs: Sequence[object]) -> tuple[int, ...]:
        """The length class of a call given as the program's inputs, in order (checked)."""
        return tuple([inputs[i].shape[dim].bit_length() for i, dim in self._positions])

    def sizes(self, leaves: Mapping[str, object]) -> dict[str, int]:
        """``{input: size}`` per size symbol: the lengths the cost model counts the call at
        (``PipelineResult.costs_at``)."""
        return {name: _size(leaves.get(name), dim) for name, dim in self.places}


def _size(value: object, dim: int) -> int:
    """``value.shape[dim]``; 0 for anything else (a call the input checks refuse later)."""
    if isinstance(value, torch.Tensor) and value.dim() > dim:
        return value.shape[dim]
    return 0
