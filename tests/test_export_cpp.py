"""A portable program compiled by AOTInductor runs from a C++ program without Python
(``examples/cpp/aoti_run.cpp`` through ``torch::inductor::AOTIModelPackageLoader``): its scores
equal the original model's and the Python loader's, and a misused call is refused in C++ by the
checks inside the program.

The C++ program is compiled with the compiler AOTInductor itself uses, against the installed
torch's headers and libraries, while the package compiles (about two minutes on two cores).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from models_zoo import get_entry

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "examples" / "cpp" / "aoti_run.cpp"
DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.int64: "int64",
          torch.int32: "int32", torch.bool: "bool"}  # fmt: skip


def build_command(output: Path) -> list[str]:
    """The compile command of ``aoti_run.cpp`` against this process's torch."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    return [
        get_cpp_compiler(), "-std=c++20", "-O1", str(SOURCE),
        *[f"-I{p}" for p in cpp_extension.include_paths()],
        *[f"-L{p}" for p in libs], *[f"-Wl,-rpath,{p}" for p in libs],
        "-ltorch", "-ltorch_cpu", "-lc10",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", "-o", str(output),
    ]  # fmt: skip


def write_inputs(program: torch.export.ExportedProgram, kwargs: dict, where: Path) -> Path:
    """The call's flat inputs in the program's order, in ``aoti_run``'s input list format."""
    flat = fx_pytree.tree_flatten_spec(((), kwargs), program.call_spec.in_spec)
    where.mkdir()
    lines = []
    for i, tensor in enumerate(flat):
        path = where / f"in_{i}.bin"
        path.write_bytes(tensor.contiguous().numpy().tobytes())
        shape = " ".join(str(s) for s in tensor.shape)
        lines.append(f"{path} {DTYPES[tensor.dtype]} {tensor.dim()} {shape}".rstrip())
    (where / "inputs.txt").write_text("\n".join(lines) + "\n")
    return where / "inputs.txt"


def read_outputs(where: Path) -> list[torch.Tensor]:
    names = {name: dtype for dtype, name in DTYPES.items()}
    outputs = []
    for line in (where / "outputs.txt").read_text().splitlines():
        file, dtype, ndim, *shape = line.split()
        data = bytearray(Path(file).read_bytes())
        flat = torch.frombuffer(data, dtype=names[dtype]) if data else torch.empty(0)
        outputs.append(flat.reshape([int(s) for s in shape[: int(ndim)]]))
    return outputs


def test_a_portable_aoti_package_runs_from_cpp(tmp_path):
    runner_binary = tmp_path / "aoti_run"
    build = subprocess.Popen(
        build_command(runner_binary), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        entry = get_entry("dlrm")
        model = entry.build()
        example = entry.make_batch([3, 1, 5]).replicated()
        cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example)
        program = rocs.export(cm, portable=True)
        package = rocs.aoti_package(program, tmp_path / "dlrm.pt2")
        log, _ = build.communicate(timeout=600)
    finally:
        build.kill()
    assert build.returncode == 0, log[-3000:]
    python_runner = torch._inductor.aoti_load_package(package)

    def run_cpp(kwargs: dict, name: str) -> subprocess.CompletedProcess:
        inputs = write_inputs(program, kwargs, tmp_path / name)
        return subprocess.run(
            [str(runner_binary), package, str(inputs), str(tmp_path / name)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip

    for i, counts in enumerate([[3, 1, 17], [1]]):
        batch = entry.make_batch(counts, seed=40 + i, shuffle=True)
        kwargs = {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}
        proc = run_cpp(kwargs, f"case{i}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = read_outputs(tmp_path / f"case{i}")
        with torch.no_grad():
            want = pytree.tree_leaves(model(**batch.replicated()))
            from_python = pytree.tree_leaves(python_runner(**kwargs))
        assert len(got) == len(want)
        for a, b, c in zip(got, want, from_python):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)

    batch = entry.make_batch([2, 3], seed=1)
    replicated = {**batch.replicated(), "candidate_to_request": batch.candidate_to_request}
    out_of_range = {**batch.kwargs, "candidate_to_request": batch.candidate_to_request + 1}
    for name, kwargs in [("replicated", replicated), ("out_of_range", out_of_range)]:
        proc = run_cpp(kwargs, name)
        assert proc.returncode == 1, (name, proc.stdout, proc.stderr[-2000:])
        assert "error: " in proc.stderr and "candidate_to_request" in proc.stderr, proc.stderr
