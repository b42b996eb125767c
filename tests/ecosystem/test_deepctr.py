"""DeepCTR-Torch models, whose request features are column ranges of one packed input ``X``.

Each model is built from DeepCTR's own feature columns; its request side (the user's features,
and for DIN the behaviour history) is named by column range from ``model.feature_index``
(``"X[:, 0:1]"``). Every model is compared with eager on ragged batches in both call layouts,
and the report's request FLOPs per request are checked against a count derived by hand from
the architecture: the request columns' share of each first layer that reads the input.
"""

from __future__ import annotations

import pytest
import torch

import rocs_compiler as rocs

deepctr = pytest.importorskip("deepctr_torch")
from deepctr_torch.inputs import DenseFeat, SparseFeat, VarLenSparseFeat  # noqa: E402
from deepctr_torch.models import DCN, DIN, MMOE, WDL, DeepFM  # noqa: E402

EMBED = 8
VOCAB = {"user_id": 50, "gender": 3, "item_id": 60, "cate_id": 10}
USER = ["user_id", "gender", "age"]
USER_WIDTH = 2 * EMBED + 1  # two user embeddings and the dense age, as the DNN input sees them


def _columns(history: bool = False):
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


def _build(name: str):
    torch.manual_seed(0)
    if name == "din":
        model = DIN(_columns(history=True), ["item_id", "cate_id"], device="cpu")
        user = ["user_id", "gender", "hist_item_id", "hist_cate_id", "seq_length"]
        # The DNN reads [user embeddings, query, pooled history]: the user's 16 columns.
        return model.eval(), user, 2 * (2 * EMBED) * 256
    if name == "mmoe":
        model = MMOE(_columns(), task_types=("binary", "binary"), task_names=("ctr", "cvr"),
                     device="cpu")  # fmt: skip
        # 3 experts (256, 128) and 2 gates (64,), each a first layer over the input.
        return model.eval(), USER, 2 * USER_WIDTH * (3 * 256 + 2 * 64)
    cls = {"deepfm": DeepFM, "wdl": WDL, "dcn": DCN}[name]
    columns = _columns()
    model = cls(columns, columns, device="cpu")
    # The DNN's first layer: (256, 128) in DeepFM and WDL, (128, 128) in DCN, whose cross
    # layers (x0 * (x . w)) mix the candidate into every column and share nothing.
    hidden = 128 if name == "dcn" else 256
    return model.eval(), USER, 2 * USER_WIDTH * hidden


def _draw(model, user, counts, seed):
    """Packed rows ``X`` for requests with ``counts`` candidates each, user columns replicated."""
    g = torch.Generator().manual_seed(seed)
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
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


@pytest.mark.parametrize("name", ["deepfm", "wdl", "dcn", "din", "mmoe"])
def test_deepctr_model_with_request_columns(name):
    model, user, request_flops = _build(name)
    ranges = [f"X[:, {a}:{b}]" for n, (a, b) in model.feature_index.items() if n in user]
    example, _ = _draw(model, user, [2, 1, 3], seed=0)
    compiled = rocs.compile(model, ranges, example_kwargs={"X": example})
    x, index = _draw(model, user, [3, 1, 5, 2], seed=1)
    with torch.no_grad():
        want = model(x)
        for got in (compiled(X=x), compiled(X=x, candidate_to_request=index)):
            torch.testing.assert_close(got, want)
    report = compiled.report(num_candidates=64, num_requests=1)
    assert not report.fallbacks, report.fallbacks
    assert report.request_flops == request_flops


def test_request_columns_that_vary_within_a_request_are_refused():
    model, user, _ = _build("deepfm")
    (start, stop) = model.feature_index["user_id"]
    example, _ = _draw(model, user, [2, 1], seed=0)
    compiled = rocs.compile(model, [f"X[:, {start}:{stop}]"], example_kwargs={"X": example})
    x, index = _draw(model, user, [2, 2], seed=1)
    x[1, start] = x[0, start] + 1  # candidate 1 claims another user than candidate 0
    with pytest.raises(rocs.InputError, match="varies within a request|differ"):
        compiled(X=x, candidate_to_request=index)
