"""Requests for the serving tests: zoo, dict-input and KJT models, their requests as JSON-like
rows, and the original model on one request alone (the oracle)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # models_for_tests

import rocs_compiler as rocs
from models_zoo import ZOO

NO_AUTOTUNE = {"autotune": False}


def flat(kwargs: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in kwargs.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, name + "."))
        else:
            out[name] = value
    return out


def nested(leaves: dict[str, Any]) -> dict:
    out: dict = {}
    for name, value in leaves.items():
        *path, last = name.split(".")
        node = out
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def changed(body: dict, **changes) -> dict:
    """A copy of the JSON ``body`` with ``part__name=value`` set (``None`` removes the field)."""
    body = {part: dict(fields) for part, fields in body.items()}
    for key, value in changes.items():
        part, name = key.split("__")
        if value is None:
            del body[part][name]
        else:
            body[part][name] = value
    return body


def dense_requests(batch, request_names) -> list[dict]:
    """Each request of a shared-layout ``models_zoo.Batch`` as a JSON-like body."""
    leaves = flat(batch.kwargs)
    index = batch.candidate_to_request
    bodies = []
    for r in range(int(index.max()) + 1):
        rows = (index == r).nonzero().flatten()
        request = {n: v[r].tolist() for n, v in leaves.items() if n in request_names}
        candidates = {n: v[rows].tolist() for n, v in leaves.items() if n not in request_names}
        bodies.append({"request": request, "candidates": candidates})
    return bodies


def dense_alone(model, body: dict) -> Any:
    """The original model on one request, its request rows replicated to its candidates."""
    candidates = {n: torch.tensor(v) for n, v in body["candidates"].items()}
    num = next(iter(candidates.values())).shape[0]
    request = {
        n: torch.tensor(v).unsqueeze(0).expand(num, *torch.tensor(v).shape).contiguous()
        for n, v in body["request"].items()
    }
    with torch.no_grad():
        return model(**nested(_typed(model, {**request, **candidates})))


def _typed(model, leaves):
    return {n: v.float() if v.is_floating_point() else v for n, v in leaves.items()}


def zoo_compiled(name: str, **kw):
    entry = ZOO[name]
    model = entry.build()
    example = entry.make_batch([2, 3], seed=1).replicated()
    return model, rocs.compile(model, list(entry.request_inputs), example_kwargs=example, **kw)


def kjt_model():
    from models_zoo import torchrec_models as tz

    model, request, _ = tz.build("dlrm")
    example = tz.draw([2, 1, 3], seed=0)
    cm = rocs.compile(model, request, example_inputs=(example.dense, example.kjt))
    return model, cm


def kjt_requests(counts, seed=0) -> list[dict]:
    from models_zoo import torchrec_models as tz

    g = torch.Generator().manual_seed(seed)
    bodies = []
    for n in counts:

        def ids(key, k):
            vocab = tz.VOCAB["item_id" if key == "history" else key]
            return torch.randint(0, vocab, (k,), generator=g).tolist()

        history = int(torch.randint(0, tz.MAX_HISTORY + 1, (1,), generator=g))
        bodies.append(
            {
                "request": {
                    "sparse_features[user_id]": ids("user_id", 1),
                    "sparse_features[history]": ids("history", history),
                },
                "candidates": {
                    "dense_features": torch.randn(n, tz.DENSE, generator=g).tolist(),
                    "sparse_features[item_id]": [ids("item_id", 1) for _ in range(n)],
                    "sparse_features[item_tags]": [
                        ids("item_tags", int(t)) for t in torch.randint(0, 4, (n,), generator=g)
                    ],
                },
            }
        )
    return bodies


def kjt_alone(model, body: dict) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    cand = body["candidates"]
    num = len(cand["dense_features"])
    rows = {
        "user_id": [body["request"]["sparse_features[user_id]"]] * num,
        "history": [body["request"]["sparse_features[history]"]] * num,
        "item_id": cand["sparse_features[item_id]"],
        "item_tags": cand["sparse_features[item_tags]"],
    }
    keys = list(rows)
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor([v for k in keys for row in rows[k] for v in row], dtype=torch.long),
        lengths=torch.tensor([len(row) for k in keys for row in rows[k]], dtype=torch.long),
    )
    with torch.no_grad():
        return model(torch.tensor(cand["dense_features"]), kjt)


# -- factories a Ray replica calls (imported there by name: tests/serving is on its PYTHONPATH) --


def two_tower_factory():
    return zoo_compiled("two_tower")[1]


def kjt_factory():
    return kjt_model()[1]
