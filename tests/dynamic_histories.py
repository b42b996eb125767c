"""DIN with histories whose length changes between calls: the model, an example with its history
dims marked dynamic, and batches at a given length (``tests/runtime/test_dynamic_lengths.py``,
``tests/test_dynamic_length_doors.py``); the same for any model's histories (``marked``,
``histories_at_length``), and the zoo's models whose positional tables cap the length (``CAPPED``:
``tests/runtime/test_zoo_history_lengths.py``, ``tests/test_zoo_history_length_doors.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

import rocs_compiler as rocs
from models_zoo import din, hstu, target_attention

HISTORIES = ("hist_item_ids", "hist_cat_ids")


def marked_example() -> dict:
    """A replicated example batch with its history lengths (dim 1) marked dynamic."""
    return marked(din.make_batch([4, 3]).replicated(), HISTORIES)


def marked(example: dict, histories: Sequence[str]) -> dict:
    """``example`` with the length (dim 1) of each of its ``histories`` marked dynamic."""
    for name in histories:
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
    vocabs = dict(zip(HISTORIES, (din.NUM_ITEMS, din.NUM_CATS)))
    return histories_at_length(batch.kwargs, vocabs, length, seed)


def histories_at_length(
    kwargs: Mapping[str, torch.Tensor],
    vocabs: Mapping[str, int],
    length: int,
    seed: int,
    min_kept: int = 0,
) -> dict:
    """``kwargs`` (shared layout) with each history named in ``vocabs`` (name -> vocabulary size)
    drawn afresh at ``length``: ids in [1, vocab), each row keeping a drawn number of them, at
    least ``min_kept``, and padding 0 after (a model whose attention over an all-padding history
    is NaN, in eager too, asks for ``min_kept=1``)."""
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(kwargs)
    for name, vocab in vocabs.items():
        rows = kwargs[name].shape[0]
        drawn = torch.randint(1, vocab, (rows, length), generator=g)
        keep = torch.randint(min(min_kept, length), length + 1, (rows, 1), generator=g)
        kwargs[name] = drawn.masked_fill(torch.arange(length) >= keep, 0)
    return kwargs


def assert_eagers_gradients(model, twin, got, want, where: str = "") -> None:
    """``got`` (the compiled ``model``'s outputs) equals ``want`` (its eager ``twin``'s, same
    weights), and a weighted sum of each backpropagates into equal gradients."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1, 1, want.shape[0])
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{name} {where}")


def replicated(
    kwargs: dict, index: torch.Tensor, request_inputs: Sequence[str] = din.REQUEST_INPUTS
) -> dict:
    """The shared-layout ``kwargs`` with their ``request_inputs`` (DIN's by default) gathered to
    the candidates."""
    return {n: v.index_select(0, index) if n in request_inputs else v for n, v in kwargs.items()}


@dataclass(frozen=True)
class CappedHistories:
    """A zoo model that takes histories of any length up to ``cap``, the rows of its positional
    table (less the candidate's, where the candidate takes a position too)."""

    module: ModuleType
    vocabs: dict  # history input -> vocabulary size
    cap: int
    head: str  # the MLP that gives the score
    scale: float  # of its last layer: scores vary across rows far more than the tolerance
    counts: tuple = (3, 1, 5, 2)  # candidates per request, a ragged call (its first 1 to 4)

    def model(self) -> torch.nn.Module:
        model = self.module.build(seed=0).eval()
        with torch.no_grad():
            getattr(model, self.head)[-1].weight.mul_(self.scale)
        return model

    def example(self) -> dict:
        """A replicated example batch with its history lengths marked dynamic."""
        return marked(self.module.make_batch([4, 3]).replicated(), list(self.vocabs))

    def compile(self, model: torch.nn.Module, **options):
        """``model`` compiled once from the marked example."""
        return rocs.compile(
            model, list(self.module.REQUEST_INPUTS), example_kwargs=self.example(), **options
        )

    def call(self, length: int, seed: int) -> tuple[dict, torch.Tensor, dict]:
        """(shared-layout inputs with histories of ``length``, their index, the same inputs
        replicated); every history keeps at least one id (target attention over an all-padding
        history is NaN, in eager too)."""
        batch = self.module.make_batch(self.counts[: 1 + seed % 4], seed=seed, shuffle=True)
        kwargs = histories_at_length(batch.kwargs, self.vocabs, length, seed, min_kept=1)
        index = batch.candidate_to_request
        return kwargs, index, replicated(kwargs, index, self.module.REQUEST_INPUTS)

    def lengths(self) -> list[int]:
        """1 to the cap: the ends, a few short ones and a couple in between."""
        cap = self.cap
        return sorted({1, 2, 7, cap // 3, cap // 2 + 1, cap - 1, cap})


CAPPED = {
    "target_attention": CappedHistories(
        target_attention, {"hist_item_ids": target_attention.NUM_ITEMS}, 64, "top", 100.0
    ),
    "hstu": CappedHistories(  # 25 positions: the history's and the candidate's
        hstu, {"hist_item_ids": hstu.NUM_ITEMS, "hist_actions": hstu.NUM_ACTIONS}, 24, "head", 10.0
    ),
}
