"""The ``--input`` examples a missing-input error suggests: dict arguments by key, ids as int64
below the embedding's row count, a linear layer's width; the name decides only when the source
does not."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from rocs_compiler.cli import main as cli
from rocs_compiler.cli.input_hints import suggested_specs
from rocs_compiler.cli.input_specs import parse_spec


class DictRanker(nn.Module):
    def __init__(self):
        super().__init__()
        self.item = nn.Embedding(1000, 8)
        self.user = nn.Linear(3, 8)
        self.bags = nn.EmbeddingBag(70, 8)

    def forward(self, features, item_id, history, score):
        u = self.user(features["user_dense"])
        tags = features.get("tags")
        return (u * self.item(item_id)).sum(-1) + self.bags(tags).sum(-1) + history.sum(-1) + score


class Aliased(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(50, 4)

    def forward(self, x):
        rows = x
        return self.table(rows).sum(-1)


@pytest.mark.parametrize("model, argument, specs", [
    (DictRanker(), "features", ["features.user_dense=float32[3]", "features.tags=int64[8]<70"]),
    (DictRanker(), "item_id", ["item_id=int64[]<1000"]),
    (DictRanker(), "history", ["history=float32[16]"]),  # the source shows nothing: by name
    (DictRanker(), "score", ["score=float32[16]"]),
    (Aliased(), "x", ["x=int64[]<50"]),
])  # fmt: skip
def test_suggestions_follow_the_forward(model, argument, specs):
    assert suggested_specs(model, argument) == specs
    for spec in specs:
        parse_spec(spec)  # every suggestion is valid --input notation


def test_ids_by_name_when_the_source_shows_nothing():
    class Opaque(nn.Module):
        def forward(self, user_ids, dense):
            return torch.ops.aten.add(user_ids.float(), dense)

    assert suggested_specs(Opaque(), "user_ids") == ["user_ids=int64[]"]
    assert suggested_specs(Opaque(), "dense") == ["dense=float32[16]"]


def test_the_missing_input_error_suggests_dict_keys_and_id_dtypes(tmp_path, monkeypatch, capsys):
    (tmp_path / "hint_models.py").write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Ranker(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.item = nn.Embedding(500, 4)\n\n"
        "    def forward(self, features, item_id):\n"
        "        return self.item(item_id).sum(-1) * features['age'].sum(-1)\n"
    )
    monkeypatch.chdir(tmp_path)
    code = cli.main(["inspect", "hint_models.py:Ranker", "--request", "features"])
    err = capsys.readouterr().err
    assert code == 1
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[rocs]")]
    assert len(lines) == 1 and lines[0].startswith("rocs: error: "), err
    suggested = re.findall(r"--input '([^']+)'", lines[0])
    assert suggested == ["features.age=float32[16]", "item_id=int64[]<500"], lines[0]
