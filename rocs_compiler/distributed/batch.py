"""A training batch of whole requests, the unit the balancer moves between ranks.

:class:`RequestBatch` holds it in the shared layout: request tensors with one row per request
(R rows), candidate tensors with one row per candidate (N rows, labels included) and
``candidate_to_request`` (int64 ``[N]``). A drop-in batch (request rows replicated to the
candidates, with a request id per row) is read into it with :meth:`RequestBatch.from_replicated`
and called the way it came (:meth:`RequestBatch.inputs`). Validation lives in ``checks.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..errors import InputError

LAYOUTS = ("shared", "dropin")


@dataclass
class RequestBatch:
    """R requests and their N candidates in the shared layout.

    ``lengths`` (int64 ``[R]``, optional) are history lengths the loader knows; without them
    the balancer reads them from the padded histories. ``layout`` is how :meth:`inputs` gives
    the model call. A batch the balancer returns carries ``loss_scale``, ``world`` and
    ``total_candidates`` (over all ranks) for :meth:`global_mean`.
    """

    request: dict[str, torch.Tensor]
    candidate: dict[str, torch.Tensor]
    candidate_to_request: torch.Tensor
    lengths: torch.Tensor | None = None
    layout: str = "shared"
    loss_scale: float = 1.0
    world: int = 1
    total_candidates: int | None = field(default=None)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise InputError(f"layout {self.layout!r} is neither of {LAYOUTS}")

    @classmethod
    def from_replicated(
        cls,
        inputs: Mapping[str, torch.Tensor],
        request_inputs: Sequence[str],
        request_of_row: torch.Tensor,
        lengths: torch.Tensor | None = None,
    ) -> RequestBatch:
        """A drop-in batch (every input with N rows) as a :class:`RequestBatch` whose
        :meth:`inputs` are replicated again.

        ``request_of_row`` (int ``[N]``) is any id per row (a session id, or an index): rows
        with one id are one request, requests numbered by first appearance. ``lengths``, if
        given, has a row per candidate too. Raises :class:`InputError` naming the request and
        input when rows of one request disagree on a request input, and for a missing input or
        rows that do not match.
        """
        ids = torch.as_tensor(request_of_row)
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            raise InputError(f"request_of_row must be a 1-D integer tensor, got {_shape(ids)}")
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        rows = torch.arange(ids.shape[0], device=ids.device)
        first = torch.full((unique.shape[0],), ids.shape[0], dtype=torch.int64, device=ids.device)
        first = first.scatter_reduce(0, inverse, rows, "amin")
        order = torch.argsort(first, stable=True)  # requests by first appearance
        rank_of = torch.empty_like(order)
        rank_of[order] = torch.arange(order.shape[0], device=order.device)
        index = rank_of[inverse]
        first = first[order]
        missing = [n for n in request_inputs if n not in inputs]
        if missing:
            raise InputError(f"request inputs {missing} are not among the inputs {list(inputs)}")

        def one_per_request(name: str, value: torch.Tensor) -> torch.Tensor:
            if value.dim() == 0 or value.shape[0] != ids.shape[0]:
                raise InputError(
                    f"{name} has {_shape(value)}, not a row per candidate "
                    f"({ids.shape[0]} rows, as request_of_row)"
                )
            kept = value.index_select(0, first)
            differs = _differs(value, kept.index_select(0, index))
            if bool(differs.any()):
                row = int(differs.nonzero()[0])
                raise InputError(
                    f"rows {int(first[index[row]])} and {row} of request {int(ids[row])} differ "
                    f"in {name}: a request's rows must repeat one value"
                )
            return kept

        request = {n: one_per_request(f"request input {n!r}", inputs[n]) for n in request_inputs}
        if lengths is not None:
            lengths = one_per_request("lengths", torch.as_tensor(lengths))
        return cls(
            request=request,
            candidate={n: v for n, v in inputs.items() if n not in request},
            candidate_to_request=index,
            lengths=lengths,
            layout="dropin",
        )

    @property
    def num_requests(self) -> int:
        first = next(iter(self.request.values()), None)
        return 0 if first is None else first.shape[0]

    @property
    def num_candidates(self) -> int:
        return self.candidate_to_request.shape[0]

    def inputs(self, leave_out: Iterable[str] = ()) -> dict:
        """The model call's keyword arguments in this batch's layout, without the candidate
        tensors named in ``leave_out`` (labels): shared, request tensors with R rows and
        ``candidate_to_request``; drop-in, every tensor with N rows."""
        if self.layout == "dropin":
            return self.replicated(leave_out)
        leave_out = set(leave_out)
        kept = {n: v for n, v in self.candidate.items() if n not in leave_out}
        return {**self.request, **kept, "candidate_to_request": self.candidate_to_request}

    def replicated(self, leave_out: Iterable[str] = ()) -> dict:
        """Every request tensor gathered to a row per candidate, with the candidate tensors
        not named in ``leave_out``: the drop-in call."""
        leave_out = set(leave_out)
        index = self.candidate_to_request
        request = {n: v.index_select(0, index) for n, v in self.request.items()}
        return {**request, **{n: v for n, v in self.candidate.items() if n not in leave_out}}

    def global_mean(self, losses: torch.Tensor) -> torch.Tensor:
        """This rank's part of the mean of ``losses`` (one per candidate) over every rank's
        candidates, times the world size: DDP's average of it over the ranks is that mean, so
        a step equals a single-process step on the union of the batches. 0 for a rank without
        candidates (still differentiable, so DDP's all-reduce pairs up)."""
        total = self.total_candidates if self.total_candidates is not None else losses.shape[0]
        return losses.sum() * (self.world / max(total, 1))

    def take(self, requests: torch.Tensor) -> RequestBatch:
        """The requests at ``requests`` (ascending local indices) and all their candidates, in
        their order; ``candidate_to_request`` renumbered to the new rows."""
        rows = self.num_requests
        new_of_old = torch.full((rows,), -1, dtype=torch.int64, device=requests.device)
        new_of_old[requests] = torch.arange(requests.shape[0], device=requests.device)
        new_index = new_of_old[self.candidate_to_request]
        kept = (new_index >= 0).nonzero().squeeze(1)
        return replace(
            self,
            request={n: v.index_select(0, requests) for n, v in self.request.items()},
            candidate={n: v.index_select(0, kept) for n, v in self.candidate.items()},
            candidate_to_request=new_index.index_select(0, kept),
            lengths=None if self.lengths is None else self.lengths.index_select(0, requests),
        )


def concat(batches: Sequence[RequestBatch]) -> RequestBatch:
    """The batches' requests one after the other (their widths must already agree:
    ``histories.fit_width``); the first batch's layout."""
    first = batches[0]
    offsets, total = [], 0
    for b in batches:
        offsets.append(total)
        total += b.num_requests
    index = torch.cat([b.candidate_to_request + o for b, o in zip(batches, offsets)])
    lengths = None
    if first.lengths is not None:
        lengths = torch.cat([b.lengths for b in batches])
    return replace(
        first,
        request={n: torch.cat([b.request[n] for b in batches]) for n in first.request},
        candidate={n: torch.cat([b.candidate[n] for b in batches]) for n in first.candidate},
        candidate_to_request=index,
        lengths=lengths,
    )


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, whether ``a`` and ``b`` differ anywhere (NaN equals NaN)."""
    same = a == b
    if a.is_floating_point() or a.is_complex():
        same = same | (torch.isnan(a) & torch.isnan(b))
    return ~same if same.dim() == 1 else ~same.flatten(1).all(1)


def _shape(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} ({value.dtype})"
    return type(value).__name__
