"""``request_batches``: whole requests per batch, every row once per pass, and batches that a
training compile takes in the shared layout with eager's gradients."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from models_zoo import ZOO
from rocs_compiler.integrations.request_batches import request_batches


def test_batches_hold_whole_requests_and_every_row_once():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (500,), generator=gen)
    batches = list(request_batches(ids, max_impressions=32, window=200, generator=gen))
    rows = torch.cat([b.rows for b in batches])
    assert torch.equal(rows.sort().values, torch.arange(500))
    for b in batches:
        assert (
            b.rows.shape[0] <= 32 or int(b.candidate_to_request.max()) == 0
        )  # a big request alone
        requests = ids[b.rows]
        # every row of a request has its request's id, and the ids of one window's requests differ
        assert torch.equal(requests, ids[b.request_rows][b.candidate_to_request])
        assert ids[b.request_rows].unique().numel() == b.request_rows.numel()
        assert bool((b.candidate_to_request[1:] >= b.candidate_to_request[:-1]).all())


def _loss(out):
    return sum(t.float().pow(2).mean() for t in pytree.tree_leaves(out) if t.is_floating_point())


def test_a_training_step_on_request_batches_equals_eager():
    entry = ZOO["two_tower"]
    model = entry.build(seed=0).train()
    cm = rocs.compile(
        model, list(entry.request_inputs), example_kwargs=entry.make_batch([2, 3], seed=1).replicated(),
        training=True,
    )  # fmt: skip
    data = entry.make_batch([1, 3, 17, 2, 5], seed=2, shuffle=True).replicated()  # a "dataset"
    ids = entry.make_batch([1, 3, 17, 2, 5], seed=2, shuffle=True).candidate_to_request
    for batch in request_batches(
        ids, max_impressions=20, generator=torch.Generator().manual_seed(1)
    ):
        rows = {k: v[batch.rows] for k, v in data.items()}
        shared = {
            k: (v[batch.request_rows] if k in entry.request_inputs else rows[k])
            for k, v in data.items()
        }
        model.zero_grad()
        _loss(model(**rows)).backward()
        want = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        _loss(cm(**shared, candidate_to_request=batch.candidate_to_request)).backward()
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-5)
