"""TorchRec helpers: request names from what a TorchRec user has, and the two batch layouts.

A TorchRec model's request side is a set of ``KeyedJaggedTensor`` keys (the user's id, their
behaviour history), and its tables say which features they pool. These helpers turn either into
``rocs.compile``'s ``request_inputs`` and build the KJTs of the two call layouts::

    from rocs_compiler.integrations import torchrec as rocs_torchrec

    user_keys = rocs_torchrec.keys_of_tables(model, ["t_user", "t_history"])
    request = rocs_torchrec.request_inputs("sparse_features", user_keys)
    compiled = rocs.compile(model, request, example_inputs=(dense, kjt))

    kjt = rocs_torchrec.shared_kjt(user_kjt, item_kjt, candidate_to_request)   # R + N rows
    compiled(dense, kjt, candidate_to_request=candidate_to_request)
    model(dense, kjt)   # TorchRec reads the same KJT through its inverse indices

``shared_kjt`` gives TorchRec's variable batch per feature (``stride_per_key_per_rank``) with
``inverse_indices``, which TorchRec's ``EmbeddingBagCollection`` expands to one row per candidate,
so the original model takes it too. torchrec is imported only by the functions that build KJTs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from ..formats.kjt_rows import replicated_kjt

__all__ = ["keys_of_tables", "replicated_kjt", "request_inputs", "shared_kjt"]


def request_inputs(argument: str, keys: Iterable[str]) -> list[str]:
    """``rocs.compile`` names for keys of the KJT argument ``argument``:
    ``request_inputs("sparse_features", ["user_id"]) == ["sparse_features[user_id]"]``."""
    return [f"{argument}[{key}]" for key in keys]


def keys_of_tables(model: nn.Module, tables: Sequence[str]) -> list[str]:
    """The KJT keys (feature names) that the named tables of ``model``'s
    ``EmbeddingBagCollection`` modules pool, in table order. Raises ``ValueError`` for a table
    the model does not have, listing its tables."""
    configs = {}
    for module in model.modules():
        if hasattr(module, "embedding_bag_configs") and callable(module.embedding_bag_configs):
            configs.update({c.name: c for c in module.embedding_bag_configs()})
    unknown = [t for t in tables if t not in configs]
    if unknown:
        raise ValueError(
            f"unknown table(s) {', '.join(map(repr, unknown))}; the model's tables are: "
            + ", ".join(configs)
        )
    keys: list[str] = []
    for table in tables:
        keys += [f for f in configs[table].feature_names if f not in keys]
    return keys


def shared_kjt(request, candidates, candidate_to_request: torch.Tensor | None = None):
    """One KJT holding the request keys at one row per request (``request``, R rows) and the
    candidate keys at one row per candidate (``candidates``, N rows).

    With ``candidate_to_request`` the KJT carries TorchRec's ``inverse_indices`` (request keys:
    the index; candidate keys: the identity), so TorchRec's own modules expand it to N rows and
    the original model can be called with it."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    for name, kjt in (("request", request), ("candidates", candidates)):
        if kjt.variable_stride_per_key():
            raise ValueError(f"shared_kjt: {name} must have one batch size for all its keys")
    if (request.weights_or_none() is None) != (candidates.weights_or_none() is None):
        raise ValueError("shared_kjt: both KJTs or neither must carry weights")
    num_requests, num_candidates = request.stride(), candidates.stride()
    keys = list(request.keys()) + list(candidates.keys())
    weights = None
    if request.weights_or_none() is not None:
        weights = torch.cat([request.weights(), candidates.weights()])
    inverse = None
    if candidate_to_request is not None:
        _check_index(candidate_to_request, num_requests, num_candidates)
        rows = [candidate_to_request] * len(request.keys())
        identity = torch.arange(num_candidates, device=candidate_to_request.device)
        rows += [identity] * len(candidates.keys())
        inverse = (keys, torch.stack(rows)) if rows else None
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([request.values(), candidates.values()]),
        lengths=torch.cat([request.lengths(), candidates.lengths()]),
        weights=weights,
        stride_per_key_per_rank=[[num_requests]] * len(request.keys())
        + [[num_candidates]] * len(candidates.keys()),
        inverse_indices=inverse,
    )


def _check_index(index: torch.Tensor, num_requests: int, num_candidates: int) -> None:
    if not isinstance(index, torch.Tensor) or index.dim() != 1:
        raise ValueError("shared_kjt: candidate_to_request must be a 1-D tensor of request rows")
    if index.shape[0] != num_candidates:
        raise ValueError(
            f"shared_kjt: candidate_to_request has {index.shape[0]} entries, but candidates has "
            f"{num_candidates} rows (one per candidate) and request {num_requests}; pass the "
            "request KJT first and the candidates KJT second"
        )
    if num_candidates and (int(index.min()) < 0 or int(index.max()) >= num_requests):
        raise ValueError(
            f"shared_kjt: candidate_to_request values must lie in [0, {num_requests}) (rows of "
            f"request); got values in [{int(index.min())}, {int(index.max())}]"
        )

