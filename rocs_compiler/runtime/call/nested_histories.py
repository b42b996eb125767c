"""Histories given as jagged nested tensors (``torch.nested.nested_tensor_from_jagged(values,
offsets)``, ``[rows, j, ...]``) in place of padded ones: checked, then padded to the call's longest
history with the padding id, which is what the model was written for (``jagged.py`` then cuts each
group to its own longest).

Identity: row ``r`` of the padded tensor holds ``values[offsets[r]:offsets[r + 1]]`` followed by
the padding id, which is the padded history the nested one stands for."""

from __future__ import annotations

import torch

from ...errors import InputError


def is_nested(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_nested


def nested_lengths(name: str, value: torch.Tensor) -> torch.Tensor:
    """Each row's length (int64 ``[rows]``) of the jagged nested tensor ``value``; an
    ``InputError`` naming ``name`` for another layout, holes, or offsets that are not monotone
    or do not span the values."""
    if value.layout != torch.jagged:
        raise InputError(
            f"input {name!r} is a nested tensor of layout {value.layout}: a history is taken "
            "as torch.jagged (torch.nested.nested_tensor_from_jagged(values, offsets))"
        )
    if value._lengths is not None:
        raise InputError(f"input {name!r} is a nested tensor with holes (lengths beside offsets)")
    offsets = value.offsets()
    steps = offsets.diff()
    if steps.numel() and int(steps.min()) < 0:
        row = int((steps < 0).nonzero()[0])
        raise InputError(
            f"input {name!r} has offsets that are not monotone: offset {row + 1} is "
            f"{int(offsets[row + 1])}, after {int(offsets[row])}"
        )
    total = value.values().shape[0]
    if int(offsets[0]) != 0 or int(offsets[-1]) != total:
        raise InputError(
            f"input {name!r} has offsets from {int(offsets[0])} to {int(offsets[-1])}; they must "
            f"run from 0 to the number of values, {total}"
        )
    return steps.to(torch.int64)


def padded_histories(bound: dict, names: list[str], pads: dict, lengths_input: str | None) -> dict:
    """``bound`` with the nested histories ``names`` padded to their longest (``pads[name]``
    fills); their lengths must agree with each other, and with ``lengths_input`` when the model
    takes its lengths as an input."""
    lengths = {name: nested_lengths(name, bound[name]) for name in names}
    first = names[0]
    for name in names[1:]:
        _agree(first, lengths[first], name, lengths[name])
    if lengths_input is not None and isinstance(bound.get(lengths_input), torch.Tensor):
        given = bound[lengths_input].to(torch.int64)
        _agree(first, lengths[first], lengths_input, given)
    width = int(lengths[first].max()) if lengths[first].numel() else 0
    padded = dict(bound)
    for name in names:
        value = bound[name]
        rows = lengths[name].shape[0]
        size = (rows, max(width, 1), *value.values().shape[1:])
        padded[name] = torch.nested.to_padded_tensor(value, pads.get(name, 0), output_size=size)
    return padded


def _agree(first: str, a: torch.Tensor, name: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise InputError(f"inputs {first!r} and {name!r} have {a.shape[0]} and {b.shape[0]} rows")
    differ = (a != b).nonzero()
    if differ.numel():
        row = int(differ[0])
        raise InputError(
            f"input {name!r} disagrees with the lengths of {first!r} at row {row}: "
            f"{int(b[row])} against {int(a[row])}"
        )


def padded_example(example_kwargs):
    """An example whose histories are jagged nested tensors, each padded with 0 to its longest
    row and its dim 1 marked dynamic: the model then takes every length (``rocs.compile``)."""
    if not example_kwargs or not any(is_nested(v) for v in example_kwargs.values()):
        return example_kwargs
    padded = dict(example_kwargs)
    for name, value in example_kwargs.items():
        if is_nested(value):
            lengths = nested_lengths(name, value)
            width = max(int(lengths.max()) if lengths.numel() else 0, 2)  # 1 would specialize
            size = (lengths.shape[0], width, *value.values().shape[1:])
            padded[name] = torch.nested.to_padded_tensor(value, 0, output_size=size)
            torch._dynamo.mark_dynamic(padded[name], 1)
    return padded
