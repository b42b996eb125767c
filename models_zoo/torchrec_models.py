"""TorchRec models whose request features are keys of their ``KeyedJaggedTensor``, and batches.

Needs ``torchrec`` (installed with ``--no-deps`` beside ``fbgemm-gpu-cpu``; see the README). Every
model takes ``forward(dense_features, sparse_features)`` as TorchRec's own models do, with one
``EmbeddingBagCollection`` (embedding dim ``D``) over four KJT keys:

* ``user_id`` (request): one id per row, table ``t_user``, sum pooling;
* ``history`` (request): the user's behaviour history, 0 to ``MAX_HISTORY`` item ids, pooled
  by their mean over table ``t_item`` (shared with ``item_id``);
* ``item_id`` (candidate): one id, table ``t_item``;
* ``item_tags`` (candidate): 0 to 3 tag ids, table ``t_tag``, sum pooling;

and ``DENSE`` dense features per candidate. :func:`build` returns the model (eval mode), its
request names and the request FLOPs per request that the architecture implies, derived by hand;
:func:`draw` makes ragged batches in both layouts from per-request and per-candidate rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

D = 8
DENSE = 4
MAX_HISTORY = 5
VOCAB = {"user_id": 20, "item_id": 30, "item_tags": 12}
REQUEST_KEYS = ("user_id", "history")
CANDIDATE_KEYS = ("item_id", "item_tags")
REQUEST = [f"sparse_features[{key}]" for key in REQUEST_KEYS]
MODELS = ("dlrm", "dlrm_dcn", "dlrm_projection", "dlrm_transformer", "deepfm")

# The request keys' pooled embeddings: K features of D columns each.
K = len(REQUEST_KEYS)


def collection(weighted: bool = False):
    """The models' ``EmbeddingBagCollection`` (per-id weights on every key when ``weighted``;
    TorchRec pools weighted bags by their weighted sum)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    mean = PoolingType.SUM if weighted else PoolingType.MEAN
    tables = [
        EmbeddingBagConfig(name="t_user", embedding_dim=D, num_embeddings=VOCAB["user_id"],
                           feature_names=["user_id"]),
        EmbeddingBagConfig(name="t_item", embedding_dim=D, num_embeddings=VOCAB["item_id"],
                           feature_names=["history", "item_id"], pooling=mean),
        EmbeddingBagConfig(name="t_tag", embedding_dim=D, num_embeddings=VOCAB["item_tags"],
                           feature_names=["item_tags"]),
    ]  # fmt: skip
    return EmbeddingBagCollection(tables=tables, is_weighted=weighted)


def build(name: str, seed: int = 0, weighted: bool = False):
    """(model, request names, request FLOPs per request derived by hand).

    The lookups of the request keys run once per request; they cost no FLOPs (gathers and
    sums), so the FLOPs are those of the layers that, after the rewrite, read only them."""
    from torchrec.models.deepfm import SimpleDeepFMNN
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection
    from torchrec.models.experimental.transformerdlrm import DLRM_Transformer

    torch.manual_seed(seed)
    common = {
        "embedding_bag_collection": collection(weighted),
        "dense_in_features": DENSE,
        "dense_arch_layer_sizes": [16, D],
        "over_arch_layer_sizes": [16, 1],
    }
    if name == "dlrm":
        # The pairwise dots of [dense, user_id, history, item_id, item_tags]: the request
        # keys' K x K block, a [K, D] x [D, K] product; then the over arch's first layer (16)
        # over the K (K - 1) / 2 dots among the request keys the interaction keeps.
        return DLRM(**common).eval(), REQUEST, 2 * K * K * D + 2 * (K * (K - 1) // 2) * 16
    if name == "dlrm_dcn":
        # The first cross layer's low-rank projection W (rank 4) over the flattened features:
        # the request keys' K * D columns. Later layers read x0 * (...), mixed per candidate.
        model = DLRM_DCN(**common, dcn_num_layers=2, dcn_low_rank_dim=4)
        return model.eval(), REQUEST, 2 * (K * D) * 4
    if name == "dlrm_projection":
        # Two projection branches, each a first layer of 16 over the flattened features.
        model = DLRM_Projection(
            **common, interaction_branch1_layer_sizes=[16, 4 * D],
            interaction_branch2_layer_sizes=[16, 2 * D],
        )  # fmt: skip
        return model.eval(), REQUEST, 2 * 2 * (K * D) * 16
    if name == "dlrm_transformer":
        # The encoder runs [B, F + 1, D] with batch_first=False: attention mixes the rows of the
        # batch. Only its input projection (q, k, v: D -> 3D) of the request keys' K tokens is
        # row-wise and request-only.
        model = DLRM_Transformer(**common, nhead=2, ntransformer_layers=1)
        return model.eval(), REQUEST, K * 2 * D * 3 * D
    if name == "deepfm":
        # The deep part's first layer (to deep_fm_dimension 8) over the flattened features;
        # the FM term's sums over the request columns are not counted (element-wise).
        model = SimpleDeepFMNN(
            num_dense_features=DENSE, embedding_bag_collection=collection(weighted),
            hidden_layer_size=16, deep_fm_dimension=8,
        )  # fmt: skip
        return model.eval(), REQUEST, 2 * (K * D) * 8
    raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")


def unpooled_collection():
    """The sequence models' ``EmbeddingCollection`` over the four keys (the tables of
    :func:`collection`, unpooled: one row of ``D`` per id)."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    tables = [
        EmbeddingConfig(name="t_user", embedding_dim=D, num_embeddings=VOCAB["user_id"],
                        feature_names=["user_id"]),
        EmbeddingConfig(name="t_item", embedding_dim=D, num_embeddings=VOCAB["item_id"],
                        feature_names=["history", "item_id"]),
        EmbeddingConfig(name="t_tag", embedding_dim=D, num_embeddings=VOCAB["item_tags"],
                        feature_names=["item_tags"]),
    ]  # fmt: skip
    return EmbeddingCollection(tables=tables)


class HistorySequence(torch.nn.Module):
    """A sequence model on TorchRec's unpooled lookups: an ``EmbeddingCollection`` over the four
    keys, the history read back as ``[B, MAX_HISTORY, D]`` (``to_padded_dense``), a per-position
    layer (D -> 16) and a masked mean over the history, then an MLP over the user's and the
    item's features and the dense ones.

    Request FLOPs by hand (:data:`SEQUENCE_REQUEST_FLOPS`): the per-position layer at every
    history position, and the first MLP layer's share of the user's columns (16 + D)."""

    def __init__(self):
        super().__init__()
        self.embeddings = unpooled_collection()
        self.position = torch.nn.Linear(D, 16)
        self.over = torch.nn.Sequential(
            torch.nn.Linear(16 + 3 * D + DENSE, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def forward(self, dense_features, sparse_features):
        looked_up = self.embeddings(sparse_features)
        history = looked_up["history"]
        lengths = history.lengths()
        tokens = history.to_padded_dense(desired_length=MAX_HISTORY)  # [B, L, D]
        valid = torch.arange(MAX_HISTORY) < lengths.unsqueeze(1)
        per_position = torch.relu(self.position(tokens)) * valid.unsqueeze(2)
        user_history = per_position.sum(1) / lengths.clamp(min=1).unsqueeze(1)
        user = looked_up["user_id"].to_padded_dense(desired_length=1).squeeze(1)
        item = looked_up["item_id"].to_padded_dense(desired_length=1).squeeze(1)
        tags = looked_up["item_tags"].to_padded_dense(desired_length=3).sum(1)
        return self.over(torch.cat([user_history, user, item, tags, dense_features], 1))


SEQUENCE_REQUEST_FLOPS = MAX_HISTORY * 2 * D * 16 + 2 * (16 + D) * 16


class HistoryAttention(torch.nn.Module):
    """A target attention over TorchRec's unpooled lookups, the history as long as the batch's
    longest (``to_padded_dense()`` with no ``desired_length``, as DIN-style rankers on TorchRec
    read it): a per-position encoder (D -> D, ReLU), the candidate item's attention over the
    encoded history (masked softmax), then an MLP over the attended history, the user, the item
    and the dense features. Its request-side work grows with the history's length."""

    def __init__(self):
        super().__init__()
        self.embeddings = unpooled_collection()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.ReLU(),
                                           torch.nn.Linear(32, D))  # fmt: skip
        self.over = torch.nn.Sequential(
            torch.nn.Linear(3 * D + DENSE, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def forward(self, dense_features, sparse_features):
        looked_up = self.embeddings(sparse_features)
        history = looked_up["history"]
        keys = self.encoder(history.to_padded_dense())  # [B, L, D], L the batch's longest
        valid = torch.arange(keys.shape[1]) < history.lengths().unsqueeze(1)
        item = looked_up["item_id"].to_padded_dense(desired_length=1).squeeze(1)
        scores = (keys * item.unsqueeze(1)).sum(2).masked_fill(~valid, -1e9)
        attended = (torch.softmax(scores, 1).unsqueeze(2) * keys).sum(1)
        user = looked_up["user_id"].to_padded_dense(desired_length=1).squeeze(1)
        return self.over(torch.cat([attended, user, item, dense_features], 1))


@dataclass
class TorchRecBatch:
    """One batch in both layouts: ``kjt`` replicated (every key N rows, what TorchRec models
    take), ``shared`` with the request keys at R rows and TorchRec's ``inverse_indices``
    (``candidate_to_request`` for the request keys)."""

    dense: torch.Tensor  # [N, DENSE]
    kjt: object
    shared: object
    index: torch.Tensor  # candidate_to_request, [N]


def _kjt(keys, rows_by_key, weights_by_key=None, strides=None, inverse=None):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = [len(row) for key in keys for row in rows_by_key[key]]
    values = [v for key in keys for row in rows_by_key[key] for v in row]
    weights = None
    if weights_by_key is not None:
        weights = torch.tensor([w for key in keys for row in weights_by_key[key] for w in row])
    return KeyedJaggedTensor(
        keys=list(keys),
        values=torch.tensor(values, dtype=torch.long),
        lengths=torch.tensor(lengths, dtype=torch.long),
        weights=weights,
        stride_per_key_per_rank=[[s] for s in strides] if strides else None,
        inverse_indices=inverse,
    )


def draw(
    counts: Sequence[int],
    seed: int,
    weighted: bool = False,
    histories: Sequence[int] | None = None,
) -> TorchRecBatch:
    """A batch of ``len(counts)`` requests with ``counts[r]`` candidates each; ``histories``
    fixes the history lengths (default: random in ``[0, MAX_HISTORY]``)."""
    g = torch.Generator().manual_seed(seed)

    def ids(key, n):
        return torch.randint(0, VOCAB["item_id" if key == "history" else key], (n,),
                             generator=g).tolist()  # fmt: skip

    num_requests, num_candidates = len(counts), sum(counts)
    index = torch.repeat_interleave(torch.arange(num_requests), torch.tensor(list(counts)))
    if histories is None:
        histories = torch.randint(0, MAX_HISTORY + 1, (num_requests,), generator=g).tolist()
    tags = torch.randint(0, 4, (num_candidates,), generator=g).tolist()
    rows = {
        "user_id": [ids("user_id", 1) for _ in range(num_requests)],
        "history": [ids("history", n) for n in histories],
        "item_id": [ids("item_id", 1) for _ in range(num_candidates)],
        "item_tags": [ids("item_tags", n) for n in tags],
    }
    weights = None
    if weighted:
        weights = {
            key: [torch.rand(len(row), generator=g).tolist() for row in key_rows]
            for key, key_rows in rows.items()
        }
    replicated = {key: [rows[key][r] for r in index.tolist()] for key in REQUEST_KEYS}
    replicated.update({key: rows[key] for key in CANDIDATE_KEYS})
    replicated_weights = None
    if weights is not None:
        replicated_weights = {
            key: [weights[key][r] for r in index.tolist()] for key in REQUEST_KEYS
        }
        replicated_weights.update({key: weights[key] for key in CANDIDATE_KEYS})
    keys = REQUEST_KEYS + CANDIDATE_KEYS
    inverse = torch.stack([index] * K + [torch.arange(num_candidates)] * len(CANDIDATE_KEYS))
    return TorchRecBatch(
        dense=torch.randn(num_candidates, DENSE, generator=g),
        kjt=_kjt(keys, replicated, replicated_weights),
        shared=_kjt(
            keys,
            rows,
            weights,
            strides=[num_requests] * K + [num_candidates] * 2,
            inverse=(list(keys), inverse),
        ),
        index=index,
    )
