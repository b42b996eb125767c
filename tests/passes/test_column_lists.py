"""Constant column lists of a packed input, ``X[:, [0, 1, 2]]``, split like slices.

Tabular and CTR libraries read the categorical or history columns of one packed float input
with a constant list (``X[:, self.cat_idx]``). With request column ranges (``"X[:, 0:5]"``) the
list reads a concatenation of column pieces; normalization's ``index_of_cat`` turns it into the
pieces' slices and selections, so the request columns' embeddings run once per request. The
oracle is the original model on ragged batches, in both call layouts.
"""

from __future__ import annotations

import torch
from torch import nn

import rocs_compiler as rocs

# Candidates per request, ragged and not grouped; two sizes of one batch-size bucket.
INDICES = [torch.tensor([0, 0, 1, 2, 2, 2, 1]), torch.tensor([1, 0, 2, 2, 0, 1, 1, 2])]
CALLS = 13  # a program choice alternates two programs for the first ~12 calls of a bucket


class CategoricalList(nn.Module):
    """X = [user categorical ids (3) | user dense (2) | item id | item dense], read by lists."""

    def __init__(self):
        super().__init__()
        self.cat_idx = [0, 1, 2]
        self.user = nn.Embedding(20, 4)
        self.item = nn.Embedding(30, 4)
        self.mlp = nn.Sequential(nn.Linear(12 + 4 + 3, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, X):
        users = self.user(X[:, self.cat_idx].long()).flatten(1)
        item = self.item(X[:, [5]].long()).flatten(1)
        dense = X[:, [3, 4, 6]]  # user dense 3-4 and item dense 6: two runs
        return self.mlp(torch.cat([users, item, dense], -1)).squeeze(-1)


class HistoryList(nn.Module):
    """DIN-like: X = [user id | history item ids (5, 0 = padding) | item id | item dense]; the
    history is read with a constant list and attended to by the candidate item."""

    def __init__(self):
        super().__init__()
        self.user_behavior_indexes = [1, 2, 3, 4, 5]
        self.user = nn.Embedding(20, 4)
        self.items = nn.Embedding(30, 4, padding_idx=0)
        self.attention = nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 1))
        self.mlp = nn.Sequential(nn.Linear(4 + 4 + 4 + 1, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, X):
        ids = X[:, self.user_behavior_indexes].long()
        history = self.items(ids)  # [B, L, D]
        item = self.items(X[:, 6].long())  # [B, D]
        query = item.unsqueeze(1).expand_as(history)
        scores = self.attention(torch.cat([history, query, history * query], -1)).squeeze(-1)
        scores = scores.masked_fill(ids == 0, -1e9)
        interest = (torch.softmax(scores, -1).unsqueeze(-1) * history).sum(1)
        user = self.user(X[:, 0].long())
        return self.mlp(torch.cat([interest, item, user, X[:, [7]]], -1)).squeeze(-1)


def _categorical_rows(index: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    requests = int(index.max()) + 1
    user = torch.cat([torch.randint(0, 20, (requests, 3), generator=g).float(),
                      torch.randn(requests, 2, generator=g)], -1)  # fmt: skip
    n = index.numel()
    item = torch.cat([torch.randint(0, 30, (n, 1), generator=g).float(),
                      torch.randn(n, 1, generator=g)], -1)  # fmt: skip
    return torch.cat([user[index], item], -1)


def _history_rows(index: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    requests = int(index.max()) + 1
    history = torch.randint(1, 30, (requests, 5), generator=g)
    history[:, 3:] *= torch.randint(0, 2, (requests, 1), generator=g)  # some padded histories
    user = torch.cat([torch.randint(0, 20, (requests, 1), generator=g), history], -1).float()
    n = index.numel()
    item = torch.cat([torch.randint(1, 30, (n, 1), generator=g).float(),
                      torch.randn(n, 1, generator=g)], -1)  # fmt: skip
    return torch.cat([user[index], item], -1)


def _compile(model: nn.Module, rows, request: str):
    example = rows(torch.tensor([0, 0, 1]), seed=0)
    return rocs.compile(model, [request], example_kwargs={"X": example})


def _check_both_layouts(model: nn.Module, compiled, rows) -> None:
    with torch.no_grad():
        for call in range(CALLS):
            index = INDICES[call % len(INDICES)]
            x = rows(index, seed=call + 1)
            want = model(x)
            torch.testing.assert_close(compiled(X=x), want)
            torch.testing.assert_close(compiled(X=x, candidate_to_request=index), want)


def _roles(report, module: str) -> set[str]:
    return {n.role for n in report.nodes if n.op == "aten.embedding.default" and n.module == module}


def test_categorical_columns_read_by_a_list_embed_once_per_request():
    torch.manual_seed(0)
    model = CategoricalList().eval()
    compiled = _compile(model, _categorical_rows, "X[:, 0:5]")
    _check_both_layouts(model, compiled, _categorical_rows)
    report = compiled.report(candidates=64)
    assert report.pass_counts["index_of_cat"] == 3, report.pass_counts
    assert _roles(report, "model.user") == {"REQUEST"}
    assert _roles(report, "model.item") == {"CANDIDATE"}
    assert report.request_share > 0.2, report.summary()  # was 0: every list read per candidate


def test_a_history_read_by_a_list_is_attended_from_request_keys():
    torch.manual_seed(0)
    model = HistoryList().eval()
    compiled = _compile(model, _history_rows, "X[:, 0:6]")
    _check_both_layouts(model, compiled, _history_rows)
    report = compiled.report(candidates=64)
    assert report.pass_counts["index_of_cat"] == 2, report.pass_counts
    roles = {
        n.shape: n.role
        for n in report.nodes
        if n.op == "aten.embedding.default" and n.module == "model.items"
    }
    assert roles == {"[B, 5, 4]": "REQUEST", "[B, 4]": "CANDIDATE"}, roles  # history, candidate
    assert report.request_share > 0.1, report.summary()  # was 5 %: the user id alone


class Selected(nn.Module):
    """``index_select`` with a constant tensor attribute, and a list with a negative entry."""

    def __init__(self, columns):
        super().__init__()
        self.columns = columns
        self.user = nn.Embedding(20, 4)

    def forward(self, X):
        if torch.is_tensor(self.columns):
            ids = X.index_select(1, self.columns)
        else:
            ids = X[:, self.columns]
        return self.user(ids.long()).sum((1, 2)) * X[:, 5]


def test_literal_lists_split_and_state_or_negative_entries_stay_as_written():
    # A tensor attribute is state the compiled model follows (it may be written after compile):
    # left as written; a Python list is a literal.
    for columns, fired in [(torch.tensor([2, 0, 1]), 0), ([2, -6, 1], 0), ([2, 0, 1], 1)]:
        torch.manual_seed(0)
        model = Selected(columns).eval()
        compiled = _compile(model, _categorical_rows, "X[:, 0:5]")
        _check_both_layouts(model, compiled, _categorical_rows)
        report = compiled.report()
        assert report.pass_counts["index_of_cat"] == fired, (columns, report.pass_counts)
        assert _roles(report, "model.user") == {"REQUEST" if fired else "CANDIDATE"}, columns


class BufferColumns(Selected):
    """The column list as a registered buffer, which a user may write after compiling."""

    def __init__(self, columns):
        super().__init__(columns)
        del self.columns
        self.register_buffer("columns", columns)


def test_a_buffer_column_list_is_left_as_written_and_followed_when_rewritten():
    torch.manual_seed(0)
    model = BufferColumns(torch.tensor([2, 0, 1])).eval()
    compiled = _compile(model, _categorical_rows, "X[:, 0:5]")
    assert compiled.report().pass_counts["index_of_cat"] == 0
    _check_both_layouts(model, compiled, _categorical_rows)
    model.columns.copy_(torch.tensor([1, 1, 0]))  # written in place after compile
    _check_both_layouts(model, compiled, _categorical_rows)
