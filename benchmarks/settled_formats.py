"""The per-call floor of a bucket settled on the plain program, one model per input format.

One small model (a user and an item embedding, their dot product, a sigmoid) is written once per
input format the compiled model accepts, so that the rows differ only in how the inputs come:

- ``tensors``: ``forward(user_id, item_id)``, request input ``"user_id"``;
- ``dict``: ``forward(features)`` with ``features = {"user_id": ..., "item_id": ...}``,
  request input ``"features.user_id"``;
- ``batch object``: ``forward(batch)`` with a dataclass of the two, ``"batch.user_id"``;
- ``column ranges``: ``forward(x)`` with ``x = [user_id, item_id]`` packed (torchfm's layout),
  ``"x[:, 0:1]"``;
- ``KJT``: ``models_zoo/torchrec_models.py``'s DLRM, its user keys named (needs torchrec).

Each model is compiled, its buckets for the benchmark's call sizes settled on the plain program
(``ProgramChoice.settle``; for a KJT call the plain program is the original model), and the
drop-in call ``cm(<replicated inputs>)`` and the shared-layout call are timed against the original
model on the replicated inputs (``eager``). ``drop-in - eager`` is the floor the runtime adds to
calling the model itself; ``shared - eager`` adds the gather of the request rows, work the
eager call's caller did before the call (a column-range call passes its request rows as they
come, so it gathers nothing). A KJT model takes the shared-layout KJT itself (TorchRec's inverse
indices: its lookups expand the request keys' pooled rows), so that call is also timed against
the original model on it (``original_shared``), which is what its settled bucket runs, and so is
the same call inside ``rocs.trusted_index()`` (``trusted_shared``), where the model reads the
inverse indices unchecked: what a serving caller that builds them runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

import rocs_compiler as rocs
from rocs_compiler.runtime.choice.program_choice import PLAIN, bucket

USERS, ITEMS, DIM = 1000, 5000, 16


class _Dot(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(USERS, DIM)
        self.item = nn.Embedding(ITEMS, DIM)

    def score(self, user_id: torch.Tensor, item_id: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid((self.user(user_id) * self.item(item_id)).sum(-1))


class TensorsModel(_Dot):
    def forward(self, user_id, item_id):
        return self.score(user_id, item_id)


class DictModel(_Dot):
    def forward(self, features):
        return self.score(features["user_id"], features["item_id"])


@dataclasses.dataclass
class Features:
    user_id: torch.Tensor
    item_id: torch.Tensor


class BatchModel(_Dot):
    def forward(self, batch):
        return self.score(batch.user_id, batch.item_id)


class PackedModel(_Dot):
    """torchfm's layout: one int64 ``x`` of field ids, one column per field."""

    def __init__(self):
        super().__init__()
        self.offsets = np.array((0, USERS), dtype=np.int64)

    def forward(self, x):
        ids = x + x.new_tensor(self.offsets).unsqueeze(0)
        return self.score(ids[:, 0], ids[:, 1] - USERS)


@dataclasses.dataclass
class FormatCase:
    """A model and its calls: ``eager()``, ``dropin()``, ``shared()`` (None: no shared call),
    and the buckets those calls fall in."""

    name: str
    eager: Callable[[], object]
    dropin: Callable[[], object]
    shared: Callable[[], object] | None
    compiled: object
    buckets: tuple
    # The original model on the shared-layout call itself, where it takes that call (a KJT
    # with TorchRec's inverse indices): what a shared call settled on the original runs.
    original_shared: Callable[[], object] | None = None
    # That call inside ``rocs.trusted_index()``, where a format reads the call's own grouping
    # unchecked (a KJT's inverse indices).
    trusted_shared: Callable[[], object] | None = None


def _ids(requests: int, per_request: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    user = torch.randint(0, USERS, (requests,), generator=g)
    item = torch.randint(0, ITEMS, (requests * per_request,), generator=g)
    index = torch.arange(requests).repeat_interleave(per_request)
    return user, item, index


def _plain_case(name, model, request, wrap, requests, per_request) -> FormatCase:
    """A case of a format that takes the user ids as one leaf: ``wrap(user, item)`` is the
    call's keyword arguments."""
    user, item, index = _ids(requests, per_request)
    example_user, example_item, example_index = _ids(2, 4, seed=1)
    example = wrap(example_user[example_index], example_item)
    cm = rocs.compile(model, [request], example_kwargs=example)
    replicated, shared = wrap(user[index], item), wrap(user, item)
    n = index.shape[0]
    return FormatCase(
        name,
        lambda: model(**replicated),
        lambda: cm(**replicated),
        lambda: cm(**shared, candidate_to_request=index),
        cm,
        (bucket("dropin", n, requests), bucket("shared", n, requests)),
    )


def _columns_case(requests, per_request) -> FormatCase:
    model = PackedModel().eval()
    user, item, index = _ids(requests, per_request)
    example_user, example_item, example_index = _ids(2, 4, seed=1)
    example = torch.stack([example_user[example_index], example_item], 1)
    cm = rocs.compile(model, ["x[:, 0:1]"], example_kwargs={"x": example})
    x = torch.stack([user[index], item], 1)
    n = index.shape[0]
    return FormatCase(
        "column ranges",
        lambda: model(x=x),
        lambda: cm(x=x),
        lambda: cm(x=x, candidate_to_request=index),
        cm,
        (bucket("dropin", n, requests), bucket("shared", n, requests)),
    )


def _kjt_case(requests, per_request) -> FormatCase | None:
    if importlib.util.find_spec("torchrec") is None:
        return None
    from models_zoo import torchrec_models

    model, request, _ = torchrec_models.build("dlrm")
    example = torchrec_models.draw([4, 3], seed=1)
    batch = torchrec_models.draw([per_request] * requests, seed=0)
    cm = rocs.compile(model, request, example_inputs=(example.dense, example.kjt))
    n = batch.index.shape[0]
    return FormatCase(
        "KJT",
        lambda: model(batch.dense, batch.kjt),
        lambda: cm(batch.dense, batch.kjt),
        lambda: cm(batch.dense, batch.shared),
        cm,
        (bucket("dropin-original", n, 0), bucket("shared-original", n, requests)),
        lambda: model(batch.dense, batch.shared),
        lambda: _trusted(cm, batch.dense, batch.shared),
    )


def _trusted(cm, *args):
    with rocs.trusted_index():
        return cm(*args)


def format_cases(requests: int, per_request: int) -> list[FormatCase]:
    """One case per input format, each compiled with its buckets settled on the plain program."""
    torch.manual_seed(0)
    cases = [
        _plain_case("tensors", TensorsModel().eval(), "user_id",
                    lambda u, i: {"user_id": u, "item_id": i}, requests, per_request),
        _plain_case("dict", DictModel().eval(), "features.user_id",
                    lambda u, i: {"features": {"user_id": u, "item_id": i}}, requests, per_request),
        _plain_case("batch object", BatchModel().eval(), "batch.user_id",
                    lambda u, i: {"batch": Features(u, i)}, requests, per_request),
        _columns_case(requests, per_request),
        _kjt_case(requests, per_request),
    ]  # fmt: skip
    cases = [c for c in cases if c is not None]
    for case in cases:
        for key in case.buckets:
            case.compiled._choice.settle(key, PLAIN)
    return cases
