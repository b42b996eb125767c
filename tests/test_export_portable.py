"""Portable programs (``rocs.export(cm, portable=True)``): no ``rocs::`` op, the request side at R
rows, exact against the original model for every zoo model, loaded by ``torch.export.load`` in a
fresh process where ``rocs_compiler`` cannot be imported.

The oracle is the original model on the replicated batch, computed in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from models_zoo import get_entry, names
from rocs_compiler.export import rocs_ops_in

BATCHES = [([3, 1, 5], True), ([1], False), ([2, 2, 9, 1], True)]

# Run in the loading process before anything else: any import of rocs_compiler fails.
BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys

    class _NoRocs(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "rocs_compiler":
                raise ImportError(f"{name} is blocked: the program must load without it")
            return None

    sys.meta_path.insert(0, _NoRocs())
    """
)

_LOAD_ALL = BLOCKER + textwrap.dedent(
    """
    import torch
    from torch.utils import _pytree as pytree

    cases = torch.load(sys.argv[1])
    for name, path, calls in cases:
        module = torch.export.load(path).module()
        worst = 0.0
        with torch.no_grad():
            for kwargs, expected in calls:
                got = pytree.tree_leaves(module(**kwargs))
                want = pytree.tree_leaves(expected)
                assert len(got) == len(want), name
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
                    worst = max(worst, (a - b).abs().max().item())
        print("EXACT", name, worst)
    print("ROCS_IMPORTED", any(m.split(".")[0] == "rocs_compiler" for m in sys.modules))
    """
)


def portable_program(name: str):
    entry = get_entry(name)
    model = entry.build()
    example = entry.make_batch([3, 1, 5]).replicated()
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example)
    return entry, model, cm, rocs.export(cm, portable=True)


def test_every_zoo_model_exports_portably_and_loads_without_rocs_compiler(tmp_path):
    cases, fused = [], 0
    for name in names():
        entry, model, cm, program = portable_program(name)
        assert rocs_ops_in(program) == [], name
        fused += bool(rocs_ops_in(rocs.export(cm)))
        path = tmp_path / f"{name}.pt2"
        rocs.save(program, path)
        calls = []
        with torch.no_grad():
            for i, (counts, shuffle) in enumerate(BATCHES):
                batch = entry.make_batch(counts, seed=30 + i, shuffle=shuffle)
                kwargs = {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}
                calls.append((kwargs, model(**batch.replicated())))
        cases.append((name, str(path), calls))
    assert fused >= len(cases) - 1, "the zoo's programs hold rocs:: ops to replace"
    torch.save(cases, tmp_path / "cases.pt")
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_ALL, str(tmp_path / "cases.pt")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    exact = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("EXACT")]
    assert exact == list(names())
    assert "ROCS_IMPORTED False" in proc.stdout


def test_a_portable_program_shares_the_request_side():
    """The request-only layers run at R rows: the program's largest matmul over request rows has
    R rows (the symbol of the request inputs), not N."""
    entry, model, cm, program = portable_program("dlrm")
    request_symbol = None
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for name in program.graph_signature.user_inputs:
        val = placeholders[name].meta["val"]
        if name == entry.request_inputs[0]:
            request_symbol = str(val.shape[0])
    assert request_symbol is not None
    rows = {
        str(node.meta["val"].shape[0])
        for node in program.graph.nodes
        if getattr(node.target, "_opname", None) in ("linear", "addmm", "mm", "matmul")
    }
    assert request_symbol in rows, f"no matmul at R rows ({request_symbol}): {rows}"


def test_a_portable_program_checks_its_inputs():
    entry, model, cm, program = portable_program("dcnv2")
    batch = entry.make_batch([2, 3], seed=1)
    with pytest.raises(RuntimeError, match="candidate_to_request"):
        program.module()(**batch.replicated(), candidate_to_request=batch.candidate_to_request)


def test_rocs_export_portable_in_the_cli(tmp_path):
    from rocs_compiler.cli.main import main

    path = tmp_path / "dcnv2.pt2"
    assert main(["export", "models_zoo:dcnv2", "--portable", "-o", str(path)]) == 0
    program = torch.export.load(path)
    assert rocs_ops_in(program) == []
    entry = get_entry("dcnv2")
    batch = entry.make_batch([1, 4], seed=2)
    with torch.no_grad():
        got = program.module()(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    want = entry.build()(**batch.replicated())
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
