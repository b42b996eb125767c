"""DIN with histories whose length changes between calls: the model, an example with its history
dims marked dynamic, and batches at a given length (``tests/runtime/test_dynamic_lengths.py``,
``tests/test_dynamic_length_doors.py``)."""

from __future__ import annotations

import torch

from models_zoo import din

HISTORIES = ("hist_item_ids", "hist_cat_ids")


def marked_example() -> dict:
    """A replicated example batch with its history lengths (dim 1) marked dynamic."""
    example = din.make_batch([4, 3]).replicated()
    for name in HISTORIES:
        torch._dynamo.mark_dynamic(example[name], 1)
    return example


def din_model() -> torch.nn.Module:
    """DIN in eval mode, its last layer scaled up."""
    model = din.build(seed=0).eval()
    with torch.no_grad():  # a head whose scores vary across rows far more than the tolerance
        model.head[-1].weight.mul_(40.0)
    return model


def at_length(batch, length: int, seed: int) -> dict:
    """The batch's shared-layout inputs with histories of ``length`` (padding 0 kept at the end
    of short histories, longer ones drawn afresh)."""
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(batch.kwargs)
    for name, vocab in zip(HISTORIES, (din.NUM_ITEMS, din.NUM_CATS)):
        rows = kwargs[name].shape[0]
        drawn = torch.randint(1, vocab, (rows, length), generator=g)
        keep = torch.randint(0, length + 1, (rows, 1), generator=g)
        kwargs[name] = drawn.masked_fill(torch.arange(length) >= keep, 0)
    return kwargs


def replicated(kwargs: dict, index: torch.Tensor) -> dict:
    """The shared-layout ``kwargs`` with their request inputs gathered to the candidates."""
    return {n: v.index_select(0, index) if n in din.REQUEST_INPUTS else v for n, v in kwargs.items()}
