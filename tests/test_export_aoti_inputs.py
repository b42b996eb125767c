"""An AOTInductor package of ``rocs.export`` with the calls a server makes: one request with one
candidate, no candidates at all, a strided view of a packed input; the package's own input checks
run by default and are turned off by ``AOTI_RUNTIME_CHECK_INPUTS=0`` (read by the loaded package
in its process).

One package, built once for the module (about a minute on two cores), from a model whose weights
changed in place after its last call: the package computes with the new weights. Oracle: the
eager model on the same (replicated) batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import rocs_compiler as rocs


class Tower(nn.Module):
    """A request tower concatenated with the candidate's features into one linear layer, whose
    weight the compiler splits by columns into folded constants."""

    def __init__(self):
        super().__init__()
        self.tower = nn.Linear(4, 8)
        self.head = nn.Linear(16, 3)

    def forward(self, user, item):
        return self.head(torch.cat([torch.relu(self.tower(user)), item], -1))


def _batch(counts: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.tensor(counts, dtype=torch.long)
    index = torch.repeat_interleave(torch.arange(len(counts)), sizes)
    index = index[torch.randperm(index.shape[0], generator=g)]
    user = torch.randn(len(counts), 4, generator=g) * 3
    packed = torch.randn(index.shape[0], 16, generator=g) * 3  # the candidates' packed features
    return user, packed[:, 3:11], index


def _packed_copy(view: torch.Tensor) -> torch.Tensor:
    """A copy with the strides the package was compiled for (``view.contiguous()`` of one row
    keeps the packed row stride, which AOTInductor's input check refuses)."""
    return view.clone(memory_format=torch.contiguous_format)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    torch.manual_seed(0)
    model = Tower().eval()
    user, item, index = _batch([2, 3], seed=0)
    cm = rocs.compile(model, ["user"], example_kwargs={"user": user[index], "item": item})
    with torch.no_grad():
        cm(user=user, item=item, candidate_to_request=index)
        model.head.weight.mul_(-2.0)  # an in-place update after the last call: no call since
    where = tmp_path_factory.mktemp("aoti")
    path = rocs.aoti_package(rocs.export(cm, portable=True), where / "tower.pt2")
    return model, path, where


def _expected(model, user, item, index):
    with torch.no_grad():
        return model(user[index], item)


def test_the_package_computes_with_the_weights_of_the_export_and_answers_an_empty_batch(package):
    model, path, _ = package
    runner = torch._inductor.aoti_load_package(path)
    for counts in ([3, 1, 5], [1], [], [0]):  # ragged; R = N = 1; R = N = 0; R = 1, N = 0
        user, item, index = _batch(counts, seed=len(counts) + 1)
        item = _packed_copy(item)
        with torch.no_grad():
            got = runner(user=user, item=item, candidate_to_request=index)
        torch.testing.assert_close(got, _expected(model, user, item, index), rtol=1e-5, atol=1e-5)


_CHECKED_RUN = textwrap.dedent(
    """
    import sys
    import torch

    runner = torch._inductor.aoti_load_package(sys.argv[1])
    answers = {}
    for name, (user, item, index) in torch.load(sys.argv[2]).items():
        try:
            with torch.no_grad():
                answers[name] = runner(user=user, item=item, candidate_to_request=index)
        except Exception as err:
            answers[name] = str(err)
    torch.save(answers, sys.argv[3])
    """
)


def _run_in_a_server_process(path, where, calls: dict, check_inputs) -> dict:
    """The package's answers to ``calls`` (or the message it raised), in a fresh process whose
    ``AOTI_RUNTIME_CHECK_INPUTS`` is ``check_inputs`` (None: unset)."""
    torch.save(calls, where / "calls.pt")
    env = {k: v for k, v in os.environ.items() if k != "AOTI_RUNTIME_CHECK_INPUTS"}
    if check_inputs is not None:
        env["AOTI_RUNTIME_CHECK_INPUTS"] = check_inputs
    proc = subprocess.run(
        [sys.executable, "-c", _CHECKED_RUN, path, str(where / "calls.pt"), str(where / "out.pt")],
        check=False, capture_output=True, text=True, timeout=300,
        env={**env, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(where / "out.pt")


@pytest.mark.parametrize("check_inputs", [None, "1"], ids=["by-default", "asked-for"])
def test_the_package_checks_its_inputs_takes_any_sizes_and_refuses_a_strided_view(
    package, check_inputs
):
    """The package's input checks run unless the serving process turns them off
    (``export/aoti_checks.py``): R = 1, N = 1 and N = 0 run (Inductor assumes sizes of at
    least 2 unless told otherwise, ``rocs.aoti_package``); the view ``packed[:, 3:11]``, which the
    compiled code would read with the contiguous strides it was compiled for, is refused."""
    model, path, where = package
    calls = {}
    for counts in ([3, 1, 5], [1], [1, 1], [0], []):
        user, item, index = _batch(counts, seed=7)
        calls[f"{counts}"] = (user, _packed_copy(item), index)
    calls["strided"] = _batch([2, 3], seed=8)
    answers = _run_in_a_server_process(path, where, calls, check_inputs)
    strided = answers.pop("strided")
    assert isinstance(strided, str) and "stride" in strided, strided
    for name, got in answers.items():
        assert isinstance(got, torch.Tensor), f"{name}: {got}"
        torch.testing.assert_close(got, _expected(model, *calls[name]), rtol=1e-5, atol=1e-5)


def test_a_server_that_copies_its_inputs_may_turn_the_checks_off(package):
    """``AOTI_RUNTIME_CHECK_INPUTS=0``: no check, so the strided view the default check refuses
    runs (read with the compiled strides: right or wrong depends on the kernels Inductor chose),
    and the caller's copy of it is exact."""
    model, path, where = package
    user, view, index = _batch([2, 3], seed=9)
    calls = {"strided": (user, view, index), "copied": (user, _packed_copy(view), index)}
    answers = _run_in_a_server_process(path, where, calls, "0")
    want = _expected(model, user, view, index)
    assert isinstance(answers["strided"], torch.Tensor), answers["strided"]  # not refused
    torch.testing.assert_close(answers["copied"], want, rtol=1e-5, atol=1e-5)
