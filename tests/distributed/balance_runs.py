"""What the balancer tests run: DIN training batches of whole requests (histories of varied
lengths padded to the batch's longest, 1..8 candidates per request, a label per candidate), the
exchange played in one process, and what each rank runs under DDP.

Oracle: the eager DIN trained in one process on the union of the ranks' batches (histories padded
to the union's longest) with the mean loss over all candidates; it knows nothing of the balancer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dynamic_histories import din_model, marked_example
from torch.nn.parallel import DistributedDataParallel as DDP

import rocs_compiler as rocs
from models_zoo import din
from rocs_compiler.distributed.balance import gathered_requests, request_stats
from rocs_compiler.distributed.batch import RequestBatch, concat
from rocs_compiler.distributed.checks import check_batch
from rocs_compiler.distributed.exchange import Routes, Schema, pack, receive_sizes, unpack
from rocs_compiler.distributed.histories import fit_width
from rocs_compiler.distributed.partition import partition

STEPS = 10
LR = 0.05
HISTORIES = ("hist_item_ids", "hist_cat_ids")


def din_batch(rank: int, step: int, requests: int | None = None, layout: str = "shared"):
    """Rank ``rank``'s batch at ``step``: 2..7 requests (``requests`` to fix it; rank 1 has none
    at step 0), histories of 2..40 ids padded to their longest, 1..8 candidates each in a shuffled
    order. Request ids (``user_profile[:, 0]``) are unique across ranks and steps."""
    g = torch.Generator().manual_seed(7919 * rank + 104729 * step + 1)
    if requests is None:
        requests = 0 if (rank, step) == (1, 0) else int(torch.randint(2, 8, (1,), generator=g))
    lengths = torch.randint(2, 41, (requests,), generator=g)
    width = int(lengths.max()) if requests else 0
    counts = torch.randint(1, 9, (requests,), generator=g)
    index = torch.repeat_interleave(torch.arange(requests), counts)
    index = index[torch.randperm(index.shape[0], generator=g)]
    pad = torch.arange(width) >= lengths[:, None]
    profile = torch.stack(
        [torch.randint(1, din.PROFILE_VOCABS[i], (requests,), generator=g) for i in range(3)], 1
    )
    profile[:, 0] = 1000 * step + 100 * rank + torch.arange(requests)  # request ids
    request = {
        "user_profile": profile,
        "hist_item_ids": torch.randint(
            1, din.NUM_ITEMS, (requests, width), generator=g
        ).masked_fill(pad, 0),
        "hist_cat_ids": torch.randint(1, din.NUM_CATS, (requests, width), generator=g).masked_fill(
            pad, 0
        ),
    }
    n = index.shape[0]
    candidate = {
        "item_id": torch.randint(1, din.NUM_ITEMS, (n,), generator=g),
        "item_cat": torch.randint(1, din.NUM_CATS, (n,), generator=g),
        "label": torch.randint(0, 2, (n,), generator=g).float(),
    }
    batch = RequestBatch(request, candidate, index)
    if layout == "dropin":
        return RequestBatch.from_replicated(
            batch.replicated(), din.REQUEST_INPUTS, 7 * profile[:, 0][index] + 3
        )
    return batch


def union(batches: list[RequestBatch]) -> RequestBatch:
    """The batches as one, histories padded to the longest."""
    width = max(b.request[HISTORIES[0]].shape[1] for b in batches)
    fitted = [
        RequestBatch(
            {n: fit_width(v, width, 0) if n in HISTORIES else v for n, v in b.request.items()},
            b.candidate,
            b.candidate_to_request,
        )
        for b in batches
    ]
    return concat(fitted)


def exchange_in_process(batches, cost, policy: str, histories=HISTORIES, padding_id=0):
    """Every rank's balanced batch and the partition, as ``RequestBalancer.start``/``wait`` make
    them on ``len(batches)`` ranks, the collectives played by slicing buffers."""
    world = len(batches)
    schemas = [Schema.of(b, histories) for b in batches]
    stats = [request_stats(check_batch(b, histories, padding_id), cost) for b in batches]
    requests = gathered_requests(stats, padded=bool(histories))
    part = partition(requests, world, policy)
    routes = [Routes.of(r, world, part.ranks, requests, bool(histories)) for r in range(world)]
    sent = [pack(b, s, r, padding_id) for b, s, r in zip(batches, schemas, routes)]
    out = []
    for rank in range(world):
        pieces = []
        for source in range(world):
            buffer, sizes = sent[source]
            start = sum(sizes[:rank])
            pieces.append(buffer[start : start + sizes[rank]])
        received = torch.cat(pieces)
        assert received.numel() == sum(receive_sizes(schemas[rank], routes[rank], rank))
        out.append(unpack(received, batches[rank], schemas[rank], routes[rank], rank))
    return out, part


def compiled_din():
    model = din_model()
    example = marked_example()
    cm = rocs.compile(model, list(din.REQUEST_INPUTS), example_kwargs=example, training=True)
    return model, cm


def _losses(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(out, label, reduction="none")


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def balanced_ddp(rank: int, world: int, configs: list) -> dict:
    """Per config ``(policy, layout, weighted)``: the parameters after :data:`STEPS` SGD steps of
    ``DDP(compiled DIN)`` on balanced batches (the next batch's exchange started before each
    step), and each step's request counts; then the refusals every rank raised."""
    model, cm = compiled_din()
    initial = _params(model)
    ddp = DDP(cm)
    runs = []
    for policy, layout, weighted in configs:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(initial[name])
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        balancer = rocs.RequestBalancer(cm, policy=policy)
        handle = balancer.start(din_batch(rank, 0, layout=layout))
        counts = []
        for step in range(STEPS):
            local = handle.wait()
            if step + 1 < STEPS:  # the next exchange overlaps this step
                handle = balancer.start(din_batch(rank, step + 1, layout=layout))
            out = ddp(**local.inputs(leave_out=["label"]))
            losses = _losses(out, local.candidate["label"])
            loss = local.global_mean(losses) if weighted else losses.mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            counts.append((local.num_requests, local.num_candidates, local.layout))
        runs.append({"params": _params(model), "counts": counts})
    return {"runs": runs, "refusals": _refusals(rank, cm)}


def _refusals(rank: int, cm) -> list[str]:
    """The messages every rank gets when rank 1's batch has a request without candidates, and
    when rank 1's batch has another dtype."""
    balancer = rocs.RequestBalancer(cm)
    bad = din_batch(rank, 50, requests=3)
    if rank == 1:
        keep = bad.candidate_to_request != 2
        bad = RequestBatch(
            bad.request,
            {n: v[keep] for n, v in bad.candidate.items()},
            bad.candidate_to_request[keep],
        )
    other = din_batch(rank, 51, requests=3)
    if rank == 1:
        other.candidate["item_cat"] = other.candidate["item_cat"].to(torch.int32)
    messages = []
    for batch in (bad, other):
        try:
            balancer.balance(batch)
        except rocs.InputError as err:
            messages.append(str(err))
        else:
            messages.append("no error")
    return messages


def single_process(world: int) -> dict:
    """The eager DIN after :data:`STEPS` SGD steps on the union of the ranks' shared batches,
    the loss the mean over all candidates."""
    model = din_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        batch = union([din_batch(rank, step) for rank in range(world)])
        out = model(**batch.replicated(leave_out=["label"]))
        _losses(out, batch.candidate["label"]).mean().backward()
        opt.step()
        opt.zero_grad()
    return _params(model)
