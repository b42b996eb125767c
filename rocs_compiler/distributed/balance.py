"""``rocs.RequestBalancer``: whole requests exchanged between data-parallel ranks before a step so
that every rank's predicted step cost is equal (docs/distributed.md, "Balanced data parallelism").

On every rank, after the data loader::

    balancer = rocs.RequestBalancer(cm, policy="cost")      # costs from the compiled model
    handle = balancer.start(batch)                          # gathers costs, starts the exchange
    ...                                                     # the previous step runs meanwhile
    local = handle.wait()                                   # this rank's balanced batch
    out = ddp(**local.inputs(leave_out=["label"]))
    local.global_mean(loss_fn(out, local.candidate["label"])).backward()

``start`` is collective (every rank calls it, in the same order): it checks the batch
(``checks.py``), all-gathers each request's candidate count, length and cost (two small
all-gathers), computes the same partition on every rank (``partition.py``) and starts one
all-to-all of the packed requests (``exchange.py``) with ``async_op=True``; ``wait`` waits for
it and unpacks. A refusal on one rank is raised on every rank, naming the rank and the request.

Exactness: the balanced batches are a partition of the union of the loaded batches (whole
requests, histories cut or padded to a width at or past their lengths); with
:meth:`RequestBatch.global_mean` as the loss, DDP's average over ranks is the mean over all
candidates, so a step equals a single-process step on the union (for models without batch
statistics: a BatchNorm in training mode sees its rank's batch, as in any DDP).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InputError
from ..runtime.call.jagged_groups import power_of_two_widths
from .batch import RequestBatch
from .checks import Checked, check_batch
from .costs import calibrated_cost, flops_cost, history_inputs, runs_grouped
from .exchange import Routes, Schema, pack, receive_sizes, unpack
from .partition import POLICIES, Partition, Requests, partition

Cost = Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor]


class RequestBalancer:
    """Exchanges whole requests between the ranks of ``group`` so that their predicted step
    costs are equal.

    - ``cost``: a compiled model (its FLOPs per request and per candidate, linear in its first
      dynamic history length: ``costs.flops_cost``; with ``calibration``, a ``rocs.Calibration``
      of this machine, its predicted milliseconds: ``costs.calibrated_cost``) or
      ``cost(lengths, candidates) -> [R]``, affine in the length.
    - ``policy``: ``"cost"`` (equal cost; counts differ, so train on
      :meth:`RequestBatch.global_mean`), ``"count"`` (equal request counts, sorted by cost and
      dealt) or ``"keep"`` (no exchange; the loss scale only).
    - ``histories``: request inputs padded along dim 1 with ``padding_id`` (default, for a
      compiled model: its request inputs with a dynamic length). Lengths are read from them
      (one past the last id that is not padding), or taken from ``batch.lengths`` and checked.
    - ``padded``: whether a rank runs its histories padded to its longest request, which the
      predicted costs then count (default: when there are histories and the calls do not group
      requests by length).
    - ``grouped``: whether a rank's call runs its requests grouped by history length, each
      request at about its own length rounded up to a power of two (``runtime/call/jagged.py``;
      default: read from a compiled model, False for a cost function); a request is then
      costed at that width, at most its rank's longest length.
    """

    def __init__(
        self,
        cost,
        *,
        policy: str = "cost",
        histories: Sequence[str] | None = None,
        padding_id=0,
        padded: bool | None = None,
        grouped: bool | None = None,
        calibration=None,
        group=None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is none of {POLICIES}")
        if callable(cost) and not isinstance(cost, torch.nn.Module):
            if calibration is not None:
                raise TypeError("calibration= prices a compiled model's graph, not a cost function")
            self.cost: Cost = cost
            found, runs_by_length = (), False
        else:
            by_calibration = calibration is not None
            self.cost = calibrated_cost(cost, calibration) if by_calibration else flops_cost(cost)
            found, runs_by_length = history_inputs(cost), runs_grouped(cost)
        self.policy = policy
        self.histories = tuple(found if histories is None else histories)
        self.padding_id = padding_id
        self.grouped = bool(self.histories) and (
            runs_by_length if grouped is None else bool(grouped)
        )
        default_padded = bool(self.histories) and not self.grouped
        self.padded = default_padded if padded is None else bool(padded)
        if self.padded and self.grouped:
            raise ValueError("padded=True and grouped=True disagree: a grouped call pads no rank")
        self.group = group

    def balance(self, batch: RequestBatch) -> RequestBatch:
        """``start(batch).wait()``."""
        return self.start(batch).wait()

    def start(self, batch: RequestBatch) -> BalanceHandle:
        """Checks ``batch``, agrees on a partition with the other ranks and starts the exchange
        (collective: every rank of the group calls it, in the same order)."""
        rank, world = self._rank_world()
        stats, schema, error = None, None, None
        try:
            checked = check_batch(batch, self.histories, self.padding_id)
            schema = Schema.of(batch, self.histories)
            stats = request_stats(checked, self.cost)
        except InputError as err:
            error = str(err)
        index = batch.candidate_to_request
        device = index.device if isinstance(index, torch.Tensor) else torch.device("cpu")
        rows = stats.shape[0] if stats is not None else 0
        digest = schema.digest() if schema is not None else 0
        headers = self._all_gather(torch.tensor([rows, error is not None, digest], device=device))
        self._raise_refusals(headers.cpu(), error, schema, rank, world)
        requests = self._requests(stats, headers[:, 0].tolist(), world)
        part = partition(requests, world, self.policy)
        handle = BalanceHandle(batch, part, requests, rank, world)
        if world > 1:
            routes = Routes.of(rank, world, part.ranks, requests, bool(self.histories))
            sent, send_sizes = pack(batch, schema, routes, self.padding_id)
            got_sizes = receive_sizes(schema, routes, rank)
            received = torch.empty(sum(got_sizes), dtype=torch.uint8, device=sent.device)
            handle.work = dist.all_to_all_single(
                received, sent, got_sizes, send_sizes, group=self.group, async_op=True
            )
            handle.exchange = (received, sent, schema, routes)
        return handle

    def _rank_world(self) -> tuple[int, int]:
        if not dist.is_available() or not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[world, *local.shape]``: every rank's ``local`` (same shape on every rank)."""
        world = self._rank_world()[1]
        if world == 1:
            return local.unsqueeze(0)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.stack(parts)

    def _raise_refusals(self, headers, error, schema, rank: int, world: int) -> None:
        """Every rank raises the same refusals: a rank's batch refused by the check, or ranks
        whose batches disagree on names, dtypes or shapes past the rows."""
        failed = [r for r in range(world) if int(headers[r, 1])]
        if failed:
            messages = self._gather_objects(error, world)
            lines = [f"rank {r}: {messages[r]}" for r in failed]
            raise InputError("the balancer refused a batch: " + "; ".join(lines))
        digests = headers[:, 2].tolist()
        if len(set(digests)) > 1:
            described = self._gather_objects(schema.describe(), world)
            odd = next(r for r in range(world) if digests[r] != digests[0])
            only = sorted(set(described[odd]) ^ set(described[0]))
            raise InputError(
                f"rank {odd}'s batch differs from rank 0's in names, dtypes or shapes past the "
                f"rows (histories may differ in width only): {only}"
            )

    def _gather_objects(self, value, world: int) -> list:
        if world == 1:
            return [value]
        out = [None] * world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _requests(self, stats: torch.Tensor, rows: list[int], world: int) -> Requests:
        """Every rank's requests from its ``request_stats``, gathered padded to the most
        requests a rank holds."""
        padded = torch.zeros(max(max(rows), 1), 4, dtype=torch.float64, device=stats.device)
        padded[: stats.shape[0]] = stats  # (gloo gathers no empty tensors)
        every = self._all_gather(padded).cpu()
        parts = [every[r, : rows[r]] for r in range(world)]
        return gathered_requests(parts, self.padded, self.grouped)


def request_stats(checked: Checked, cost: Cost) -> torch.Tensor:
    """float64 ``[R, 4]``: each request's candidates, length (0 without), cost at length 0 and
    cost per unit of length (``cost`` at length 1 less at 0: the cost is affine in it)."""
    counts, lengths = checked.counts, checked.lengths
    fixed = _costs(cost, None if lengths is None else torch.zeros_like(lengths), counts)
    per_length = torch.zeros_like(fixed)
    if lengths is not None:
        per_length = _costs(cost, torch.ones_like(lengths), counts) - fixed
    length = torch.zeros_like(counts) if lengths is None else lengths
    return torch.stack([counts.to(fixed.dtype), length.to(fixed.dtype), fixed, per_length], 1)


def gathered_requests(
    stats: Sequence[torch.Tensor], padded: bool, grouped: bool = False
) -> Requests:
    """The global :class:`Requests` from every rank's :func:`request_stats`, rank by rank;
    ``grouped``: each rank's call groups its requests by length (their power-of-two widths)."""
    table = torch.cat(list(stats)).numpy()
    lengths = torch.from_numpy(table[:, 1].astype(np.int64))
    return Requests(
        fixed=table[:, 2],
        per_length=table[:, 3],
        lengths=table[:, 1].astype(np.int64),
        candidates=table[:, 0].astype(np.int64),
        home=np.repeat(np.arange(len(stats)), [s.shape[0] for s in stats]),
        padded=padded,
        widths=power_of_two_widths(lengths).numpy() if grouped else None,
    )


def _costs(cost: Cost, lengths, counts) -> torch.Tensor:
    costs = cost(lengths, counts)
    if not isinstance(costs, torch.Tensor) or costs.shape != counts.shape:
        got = tuple(costs.shape) if isinstance(costs, torch.Tensor) else type(costs).__name__
        raise InputError(f"cost(lengths, candidates) returned {got}, not a cost per request")
    return costs.to(torch.float64)


@dataclass
class BalanceHandle:
    """An exchange in flight; :meth:`wait` returns this rank's balanced batch. ``partition``
    and ``requests`` are the agreed partition and the gathered requests (predicted loads)."""

    batch: RequestBatch
    partition: Partition
    requests: Requests
    rank: int
    world: int
    work: object = None  # the all-to-all (None on one rank)
    exchange: tuple | None = None  # (received bytes, sent bytes, Schema, Routes)
    _result: RequestBatch | None = None

    def wait(self) -> RequestBatch:
        """This rank's requests under the partition, with ``loss_scale`` (``world`` times its
        share of all candidates), ``world`` and ``total_candidates`` set."""
        if self._result is not None:
            return self._result
        local = self.batch
        if self.work is not None:
            self.work.wait()
            received, _, schema, routes = self.exchange
            local = unpack(received, self.batch, schema, routes, self.rank)
            self.exchange = None  # the sent bytes may go
        total = int(self.requests.candidates.sum())
        share = local.num_candidates / total if total else 0.0
        self._result = replace(
            local, loss_scale=self.world * share, world=self.world, total_candidates=total
        )
        return self._result
