"""Debug and save output stay off stdout and free of third-party noise."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import rocs_compiler as rocs


class UserItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Linear(4, 3)

    def forward(self, u, c):
        return (self.user(u) * c).sum(-1)


def _compile():
    u, c = torch.randn(3, 4), torch.randn(3, 3)
    return rocs.compile(UserItem().eval(), ["u"], example_kwargs={"u": u[[0, 0, 1]], "c": c})


def test_print_graphs_writes_to_stderr(monkeypatch, capsys):
    monkeypatch.setenv("ROCS_PRINT_GRAPHS", "1")
    _compile()
    out, err = capsys.readouterr()
    assert out == ""
    assert "==== rocs: after share ====" in err


def test_save_emits_no_warning(tmp_path):
    program = rocs.export(_compile())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rocs.save(program, tmp_path / "model.pt2")
    assert not [str(w.message) for w in caught]
    assert rocs.load(tmp_path / "model.pt2") is not None
