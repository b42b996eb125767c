"""An exported program checks its inputs as a compiled model does, inside its graph: the index's
range, and request inputs with one row per candidate passed with an index that groups them
(``export/input_checks.py``). The oracle: the compiled model refuses the same calls, and accepts
the calls the program accepts, with the original model's scores."""

from __future__ import annotations

import pytest
import torch

import rocs_compiler as rocs
from models_zoo import get_entry


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    entry = get_entry("dlrm")
    model = entry.build()
    example = entry.make_batch([3, 1, 5]).replicated()
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example)
    path = tmp_path_factory.mktemp("checks") / "dlrm.pt2"
    rocs.save(rocs.export(cm), path)
    return entry, model, cm, rocs.load(path)


def _bad_calls(entry):
    batch = entry.make_batch([2, 3, 1], seed=5, shuffle=True)
    index = batch.candidate_to_request
    yield "replicated request rows", {**batch.replicated(), "candidate_to_request": index}
    yield "index past R", {**batch.kwargs, "candidate_to_request": index + 1}
    yield "negative index", {**batch.kwargs, "candidate_to_request": index - 1}


def test_a_loaded_program_refuses_what_the_compiled_model_refuses(saved):
    entry, model, cm, program = saved
    for what, call in _bad_calls(entry):
        with torch.no_grad():
            with pytest.raises(rocs.InputError):
                cm(**call)
            with pytest.raises(rocs.InputError, match="candidate_to_request") as refused:
                program(**call)
            assert "\n" not in str(refused.value), what
            with pytest.raises(RuntimeError, match="candidate_to_request"):  # torch's own module
                program.program.module()(**call)


@pytest.mark.parametrize("counts", [[1], [1, 1, 1], [4], [2, 1, 3]])
def test_a_loaded_program_accepts_one_row_per_request_whatever_r_and_n(saved, counts):
    """R = N as a permutation (every request has one candidate), R = N = 1, R < N: exact."""
    entry, model, cm, program = saved
    batch = entry.make_batch(counts, seed=7, shuffle=True)
    with torch.no_grad():
        got = program(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
        torch.testing.assert_close(got, model(**batch.replicated()), rtol=1e-5, atol=1e-5)


def _rows(entry, kwargs: dict, requests: int, candidates: int) -> dict:
    return {k: v[:requests] if k in entry.request_inputs else v[:candidates]
            for k, v in kwargs.items()}  # fmt: skip


def test_a_loaded_program_answers_a_batch_without_candidates_as_eager(saved):
    """R = N = 0 (the in-graph check reduces over no request) and R = 1, N = 0: eager's empty
    scores."""
    entry, model, cm, program = saved
    batch = entry.make_batch([2, 3], seed=8)
    index = torch.zeros(0, dtype=torch.int64)
    for requests in (0, 1):
        kwargs = _rows(entry, batch.kwargs, requests, 0)
        with torch.no_grad():
            expected = model(**{k: v[index] if k in entry.request_inputs else v
                                for k, v in kwargs.items()})  # fmt: skip
            got = program(**kwargs, candidate_to_request=index)
        assert got.shape == expected.shape == (0,), requests
        torch.testing.assert_close(got, expected)


def test_a_loaded_program_names_the_dtype_and_the_length_of_a_bad_index(saved):
    entry, model, cm, program = saved
    batch = entry.make_batch([2, 3], seed=9)
    index = batch.candidate_to_request
    bad = [
        (index.to(torch.int32), "must have dtype torch.int64, got torch.int32"),
        (index[:3], "has 3 entries but the candidate inputs have 5 rows"),
        (torch.cat([index, index[:1]]), "has 6 entries but the candidate inputs have 5 rows"),
    ]
    for wrong, message in bad:
        with torch.no_grad():
            with pytest.raises(rocs.InputError, match=message):
                cm(**batch.kwargs, candidate_to_request=wrong)  # the compiled model's message
            with pytest.raises(rocs.InputError, match=message):
                program(**batch.kwargs, candidate_to_request=wrong)
            with pytest.raises(rocs.InputError, match=message):
                program(*batch.kwargs.values(), wrong)
