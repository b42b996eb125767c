"""DeepCTR-Torch models with user and item features, and packed batches for them.

Needs the ``deepctr-torch`` package (the ``ecosystem`` extra). :func:`build` returns the model
(eval mode), the names of its request-side features and the request FLOPs per request that the
architecture implies (the user columns' share of every first layer that reads the input);
:func:`draw` packs ragged batches the way DeepCTR models take them: one float tensor ``X`` whose
column ranges are the features (``model.feature_index``), user columns replicated per candidate.

DeepCTR draws embeddings and DNN weights from a normal of std 1e-4, which leaves every output
almost the same (a spread of 1e-7 to 1e-5 across candidates, below the tolerance of any
exactness test). :func:`build` re-draws them at fan-in scale from its seed, so that scores vary
across candidates and requests as a trained model's do.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._layers import fan_in_weights

EMBED = 8
VOCAB = {"user_id": 50, "gender": 3, "item_id": 60, "cate_id": 10}
USER = ["user_id", "gender", "age"]
USER_WIDTH = 2 * EMBED + 1  # two user embeddings and the dense age, as a DNN input sees them
MODELS = ("deepfm", "wdl", "dcn", "din", "mmoe")
# Without a DNN: WDL is a logistic regression over the features, DeepFM a factorization machine.
TINY = ("lr", "fm")


def _columns(history: bool = False):
    from deepctr_torch.inputs import DenseFeat, SparseFeat, VarLenSparseFeat

    user = [SparseFeat("user_id", 50, EMBED), SparseFeat("gender", 3, EMBED), DenseFeat("age", 1)]
    item = [SparseFeat("item_id", 60, EMBED), SparseFeat("cate_id", 10, EMBED)]
    if not history:
        return user + item + [DenseFeat("price", 1)]
    hist = [
        VarLenSparseFeat(
            SparseFeat(f"hist_{name}", VOCAB[name], EMBED, embedding_name=name),
            maxlen=4, length_name="seq_length",
        )  # fmt: skip
        for name in ("item_id", "cate_id")
    ]
    return user[:2] + item + hist


def build(name: str, seed: int = 0):
    """(model, request feature names, request FLOPs per request derived by hand; None for the
    ``TINY`` models). Weights at fan-in scale (see the module's docstring), fixed by ``seed``."""
    from deepctr_torch.models.basemodel import Linear as LinearPart

    model, user, flops = _build(name, seed)
    # The linear part keeps its dense features' weight as a bare [in, 1] parameter.
    dense = [
        m.weight for m in model.modules() if isinstance(m, LinearPart) and hasattr(m, "weight")
    ]
    return fan_in_weights(model, seed, extra=dense), user, flops


def _build(name: str, seed: int):
    from deepctr_torch.models import DCN, DIN, MMOE, WDL, DeepFM

    torch.manual_seed(seed)
    if name == "din":
        model = DIN(_columns(history=True), ["item_id", "cate_id"], device="cpu")
        user = ["user_id", "gender", "hist_item_id", "hist_cate_id", "seq_length"]
        # The DNN reads [user embeddings, query, pooled history]: the user's 16 columns. The
        # attention unit's first layer (to 64) reads [query, key, query - key, query * key] per
        # history position (4): the keys' 16 columns of each position are the user's too.
        return model.eval(), user, 2 * (2 * EMBED) * 256 + 4 * 2 * (2 * EMBED) * 64
    if name == "mmoe":
        model = MMOE(_columns(), task_types=("binary", "binary"), task_names=("ctr", "cvr"),
                     device="cpu")  # fmt: skip
        # 3 experts (256, 128) and 2 gates (64,), each a first layer over the input.
        return model.eval(), USER, 2 * USER_WIDTH * (3 * 256 + 2 * 64)
    if name in TINY:
        columns = _columns()
        cls = WDL if name == "lr" else DeepFM
        return cls(columns, columns, dnn_hidden_units=(), device="cpu").eval(), USER, None
    cls = {"deepfm": DeepFM, "wdl": WDL, "dcn": DCN}[name]
    columns = _columns()
    model = cls(columns, columns, device="cpu")
    # The DNN's first layer: (256, 128) in DeepFM and WDL, (128, 128) in DCN, whose cross
    # layers (x0 * (x . w)) mix the candidate into every column and share nothing.
    hidden = 128 if name == "dcn" else 256
    return model.eval(), USER, 2 * USER_WIDTH * hidden


def request_ranges(model, user: Sequence[str]) -> list[str]:
    """The request features as column ranges of ``X``: ``"X[:, a:b]"``."""
    return [f"X[:, {a}:{b}]" for n, (a, b) in model.feature_index.items() if n in user]


def draw(model, user: Sequence[str], counts: Sequence[int], seed: int):
    """(X, candidate_to_request) for requests with ``counts`` candidates each."""
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(list(counts)))
    width = max(stop for _, stop in model.feature_index.values())
    x = torch.zeros(index.numel(), width)
    for name, (start, stop) in model.feature_index.items():
        rows = len(counts) if name in user else index.numel()
        if name in ("age", "price"):
            value = torch.rand(rows, stop - start, generator=g)
        elif name == "seq_length":
            value = torch.randint(1, 5, (rows, 1), generator=g).float()
        else:
            vocab = VOCAB[name.removeprefix("hist_")]
            value = torch.randint(1, vocab, (rows, stop - start), generator=g).float()
        x[:, start:stop] = value[index] if name in user else value
    return x, index
