"""Request features named as column ranges of one packed input, ``"X[:, a:b]"``.

A hand-written model in the style of DeepCTR (every feature a column range of ``X``, sliced in
``forward``); the request columns' work runs once per request in both call layouts. The
notation's errors name what is wrong.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rocs_compiler as rocs

INDEX = torch.tensor([0, 0, 1, 2, 2, 2, 1])


class Packed(nn.Module):
    """X = [user_id | user dense (3) | item_id | item dense (2)]."""

    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(20, 4)
        self.item = nn.Embedding(30, 4)
        self.mlp = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, X):
        user = torch.cat([self.user(X[:, 0].long()), X[:, 1:4]], -1)
        item = torch.cat([self.item(X[:, 4].long()), X[:, 5:7]], -1)
        return self.mlp(torch.cat([user, item], -1)).squeeze(-1)


def _rows(requests: int, index: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    user = torch.cat([torch.randint(0, 20, (requests, 1), generator=g).float(),
                      torch.randn(requests, 3, generator=g)], -1)  # fmt: skip
    n = index.numel()
    item = torch.cat([torch.randint(0, 30, (n, 1), generator=g).float(),
                      torch.randn(n, 2, generator=g)], -1)  # fmt: skip
    return torch.cat([user[index], item], -1)


def _compiled(request=("X[:, 0:1]", "X[:, 1:4]")):
    torch.manual_seed(0)
    model = Packed().eval()
    example = _rows(2, torch.tensor([0, 0, 1]), seed=0)
    return model, rocs.compile(model, list(request), example_kwargs={"X": example})


def test_request_columns_run_once_per_request_in_both_layouts():
    model, compiled = _compiled()
    x = _rows(3, INDEX, seed=1)
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(compiled(X=x), want)
        torch.testing.assert_close(compiled(x), want)
        torch.testing.assert_close(compiled(X=x, candidate_to_request=INDEX), want)
    report = compiled.report(candidates=64)
    assert not report.fallbacks
    assert report.request_flops == 2 * (4 + 3) * 16  # the user's 7 columns of the first layer
    assert "rocs.broadcast_linear.default" in report.fused_ops


def test_adjacent_ranges_merge_and_names_are_checked():
    _, compiled = _compiled(("X[:, 0:1]", "X[:,1:4]"))
    assert [s.request for s in compiled.input_format.splits] == [((0, 4),)]
    for bad, message in [
        ("X[0:4]", "column range is written"),
        ("Y[:, 0:2]", "unknown input name 'Y'"),
        ("X[:, 3:3]", "empty"),
        ("X[:, 5:9]", "past its 7 columns"),
    ]:
        with pytest.raises(rocs.InputError, match=message):
            _compiled((bad,))
    with pytest.raises(rocs.InputError, match="overlap"):
        _compiled(("X[:, 0:3]", "X[:, 2:4]"))


def test_a_call_with_another_width_is_refused():
    _, compiled = _compiled()
    with pytest.raises(rocs.InputError, match="7 columns"):
        compiled(X=torch.zeros(4, 6))


def test_export_takes_the_column_pieces():
    model, compiled = _compiled()
    program = rocs.export(compiled)
    names = [spec.arg.name for spec in program.graph_signature.input_specs
             if spec.kind.name == "USER_INPUT"]  # fmt: skip
    assert len(names) == 3 and names[-1] == "candidate_to_request", names
    x = _rows(3, INDEX, seed=1)
    pieces = {"0:4": x[[0, 2, 3], :4], "4:7": x[:, 4:]}  # rows 0, 2, 3 start requests 0, 1, 2
    with torch.no_grad():
        got = program.module()(X=pieces, candidate_to_request=INDEX)
        torch.testing.assert_close(got, model(x))


@pytest.mark.parametrize("request_columns", [("X[:, 0:1]",), ("X[:, 0:4]",)])
def test_column_major_x_above_the_numpy_rows(request_columns):
    """``X`` from ``torch.from_numpy`` of a Fortran-ordered array: its ``[N, 1]`` request column
    counts as contiguous but has a last stride of N; the torch scan of batches above 512 rows
    crashed viewing it as bytes."""
    import numpy as np

    model, compiled = _compiled(request_columns)
    index = torch.tensor([0] * 300 + [1] + [2] * 350)
    x = torch.from_numpy(np.asfortranarray(_rows(3, index, seed=2).numpy()))
    assert x.stride() == (1, len(index))
    with torch.no_grad():
        want = model(x)
        for _ in range(13):  # past the program choice's trials
            torch.testing.assert_close(compiled(X=x), want)
        torch.testing.assert_close(compiled(X=x, candidate_to_request=index), want)


def test_a_bucket_that_runs_the_plain_program_takes_the_packed_input_as_given():
    """Plain-program buckets neither reduce nor check the request columns: the answer is the
    original model's on the packed input, including one whose user columns vary in a request."""
    from rocs_compiler.runtime.choice.program_choice import PLAIN, SHARED, bucket

    model, compiled = _compiled()
    x = _rows(3, INDEX, seed=2)
    varied = x.clone()
    varied[1, 1] += 1.0  # candidate 1 claims other user features than candidate 0
    with torch.no_grad():
        with pytest.raises(rocs.InputError, match="varies within a request"):
            compiled(X=varied, candidate_to_request=INDEX)  # a trial of the shared program
        compiled._choice.settle(bucket("shared", INDEX.numel(), 3), PLAIN)
        for _ in range(3):
            torch.testing.assert_close(compiled(X=x, candidate_to_request=INDEX), model(x))
            torch.testing.assert_close(
                compiled(X=varied, candidate_to_request=INDEX), model(varied)
            )
        with pytest.raises(rocs.InputError, match="candidate_to_request"):
            compiled(X=x, candidate_to_request=INDEX[:-1])  # the index is still checked
        other = torch.tensor([0, 0, 1, 2, 3, 3, 3])  # four requests: another bucket, shared
        compiled._choice.settle(bucket("shared", other.numel(), 4), SHARED)
        with pytest.raises(rocs.InputError, match="varies within a request"):
            compiled(X=varied, candidate_to_request=other)
