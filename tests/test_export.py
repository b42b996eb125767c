"""``rocs.export`` / ``rocs.save`` / ``rocs.load``: dynamic R and N, exactness, loading in a fresh
process, and AOTInductor packaging.

The oracle is the original model on the replicated batch (and the CompiledModel itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from models_zoo import get_entry

BATCHES = [([3, 1, 5], True), ([1], False), ([6], False), ([2, 2, 9, 1], True)]


def _assert_close(out, ref, what: str) -> None:
    got, want = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _compiled(name):
    entry = get_entry(name)
    model = entry.build()
    example = entry.make_batch([3, 1, 5]).replicated()
    return entry, model, rocs.compile(model, list(entry.request_inputs), example_kwargs=example)


@pytest.mark.parametrize("name", ["dlrm", "mmoe", "bst"])  # plain args; dicts in and out; sequences
def test_exported_program_is_exact_for_any_r_and_n(name):
    entry, model, cm = _compiled(name)
    program = rocs.export(cm)
    assert isinstance(program, torch.export.ExportedProgram)
    assert len(program.range_constraints) == 2, "one dynamic size for R and one for N"
    module = program.module()
    with torch.no_grad():
        for i, (counts, shuffle) in enumerate(BATCHES):
            batch = entry.make_batch(counts, seed=i, shuffle=shuffle)
            out = module(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
            _assert_close(out, model(**batch.replicated()), f"{name} {counts}")
            compiled = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
            _assert_close(out, compiled, f"{name} {counts} vs CompiledModel")


def test_export_accepts_an_example_batch():
    entry, model, cm = _compiled("dcnv2")
    batch = entry.make_batch([2, 4], seed=3)
    program = rocs.export(cm, example=batch)
    out = program.module()(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    _assert_close(out, model(**batch.replicated()), "example batch")
    with pytest.raises(rocs.InputError, match="candidate_to_request"):
        rocs.export(cm, example=batch.kwargs)


def test_export_of_an_eager_fallback_is_an_error():
    class Untraceable(nn.Module):
        def forward(self, user, item):
            if user.sum() > 0:  # data-dependent control flow
                return user + item
            return user - item

    with pytest.warns(UserWarning):
        cm = rocs.compile(
            Untraceable().eval(),
            ["user"],
            example_inputs=(torch.ones(4, 2), torch.ones(4, 2)),
            fallback="eager",
        )
    with pytest.raises(rocs.CompileError, match="nothing to export"):
        rocs.export(cm)


_LOAD_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import rocs_compiler as rocs

    program = rocs.load(sys.argv[1])
    cases = torch.load(sys.argv[2])
    worst = 0.0
    for kwargs, index, expected in cases:
        out = program.module()(**kwargs, candidate_to_request=index)
        worst = max(worst, (out - expected).abs().max().item())
    print("MAX_ERROR", worst)
    print("FOREIGN", sorted(m for m in sys.modules if m.split(".")[0] in ("models_zoo",)))
    """
)

_BARE_LOAD_SCRIPT = "import sys, torch; torch.export.load(sys.argv[1])"


def test_saved_program_loads_in_a_fresh_process(tmp_path):
    entry, model, cm = _compiled("dlrm")
    program = rocs.export(cm)
    assert any(
        n.target.namespace == "rocs"
        for n in program.graph.nodes
        if n.op == "call_function" and hasattr(n.target, "namespace")
    ), "the test needs a graph with rocs:: ops"
    path = tmp_path / "dlrm.pt2"
    rocs.save(program, path)
    cases = []
    with torch.no_grad():
        for i, (counts, shuffle) in enumerate(BATCHES):
            batch = entry.make_batch(counts, seed=10 + i, shuffle=shuffle)
            cases.append((batch.kwargs, batch.candidate_to_request, model(**batch.replicated())))
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, str(path), str(tmp_path / "cases.pt")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert float(lines["MAX_ERROR"]) < 1e-5
    assert lines["FOREIGN"] == "[]", "the loading process should import only torch and rocs"

    bare = subprocess.run(
        [sys.executable, "-c", _BARE_LOAD_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert bare.returncode != 0, "loading without rocs_compiler should fail on the rocs:: ops"
    assert "rocs" in bare.stderr


_TORCH_LOAD_SCRIPT = textwrap.dedent(
    """
    import sys
    {imports}
    program = torch.export.load(sys.argv[1])
    kwargs, index, expected = torch.load(sys.argv[2])
    out = program.module()(**kwargs, candidate_to_request=index)
    print("MAX_ERROR", (out - expected).abs().max().item())
    print("COMPILER", sorted(m for m in sys.modules if m.startswith("rocs_compiler.kernels.")))
    """
)


@pytest.mark.parametrize("imports", ["import torch, rocs_compiler", "import rocs_compiler, torch"])
def test_importing_the_package_makes_a_saved_program_loadable_by_torch(tmp_path, imports):
    """``torch.export.load`` resolves the rocs:: ops after ``import rocs_compiler`` in either
    order; the ops' kernels load when the program first runs, not at the import."""
    entry, model, cm = _compiled("dlrm")
    program = rocs.export(cm)
    assert any(getattr(n.target, "namespace", None) == "rocs" for n in program.graph.nodes)
    rocs.save(program, tmp_path / "m.pt2")
    batch = entry.make_batch([2, 5, 1], seed=4, shuffle=True)
    with torch.no_grad():
        expected = model(**batch.replicated())
    torch.save((batch.kwargs, batch.candidate_to_request, expected), tmp_path / "case.pt")
    script = _TORCH_LOAD_SCRIPT.format(imports=imports)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "m.pt2"), str(tmp_path / "case.pt")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert float(lines["MAX_ERROR"]) < 1e-5
    assert "rocs_compiler.kernels.library" in lines["COMPILER"]


@pytest.mark.slow
def test_aot_inductor_package_is_exact(tmp_path):
    """AOTInductor compiles the exported program (rocs:: ops included) into a .pt2 package.

    About 45 s on two CPU cores (C++ compile).
    """
    entry, model, cm = _compiled("dlrm")
    program = rocs.export(cm)
    start = time.perf_counter()
    path = rocs.aoti_package(program, tmp_path / "dlrm_aoti.pt2")
    elapsed = time.perf_counter() - start
    runner = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        for i, (counts, shuffle) in enumerate(BATCHES):
            batch = entry.make_batch(counts, seed=20 + i, shuffle=shuffle)
            out = runner(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
            _assert_close(out, model(**batch.replicated()), f"aoti {counts}")
    print(f"AOTInductor package built in {elapsed:.1f} s")


class _Positional(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.user = nn.Linear(4, 6)
        self.item = nn.Linear(3, 6)

    def forward(self, user, item):
        return (self.user(user) * self.item(item)).sum(-1)


def test_a_loaded_program_takes_the_models_positional_arguments(tmp_path):
    model = _Positional().eval()
    user, item = torch.randn(3, 4), torch.randn(6, 3)
    index = torch.tensor([2, 0, 0, 1, 2, 2])
    cm = rocs.compile(model, ["user"], example_inputs=(user[index], item))
    rocs.save(rocs.export(cm), tmp_path / "positional.pt2")
    program = rocs.load(tmp_path / "positional.pt2")
    assert isinstance(program, rocs.LoadedProgram)
    assert program.argument_names == ["user", "item", "candidate_to_request"]
    assert isinstance(program.program, torch.export.ExportedProgram)
    with torch.no_grad():
        expected = model(user[index], item)
        for out in (
            program(user, item, index),
            program.module()(user, item, index),
            program.module()(user, item, candidate_to_request=index),
            program(user=user, item=item, candidate_to_request=index),
        ):
            torch.testing.assert_close(out, expected)
    with pytest.raises(TypeError, match="by position and by name: user"):
        program(user, user=user, item=item, candidate_to_request=index)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        program(user, item, index, index)
