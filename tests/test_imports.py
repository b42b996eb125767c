"""What ``import rocs_compiler`` and ``rocs --help`` import (not how long they take): the heavy
packages only when a call needs them, with every public name still working.

Each check runs in a fresh interpreter, since this test process has imported everything.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


_LOADED = """
import sys
heavy = ("torch", "triton", "sympy", "torchrec", "rocs_compiler.report.render",
         "rocs_compiler.transforms", "rocs_compiler.integrations", "torch._dynamo")
print(*sorted(m for m in heavy if m in sys.modules))
"""


def test_import_rocs_compiler_imports_no_heavy_package():
    assert _run("import rocs_compiler" + _LOADED).split() == []


def test_cli_help_does_not_import_torch():
    code = """
    import contextlib, io
    from rocs_compiler.cli.main import main
    for argv in (["--help"], ["inspect", "--help"], ["export", "--help"], ["inspect"]):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                main(argv)
            except SystemExit:
                pass
    """
    assert _run(textwrap.dedent(code) + _LOADED).split() == []


def test_public_names_resolve_and_keep_their_kind():
    out = _run(
        """
        import types
        import rocs_compiler as rocs
        # submodules named like the functions they define
        import rocs_compiler.export, rocs_compiler.backend.lowering
        for name in rocs.__all__:
            value = getattr(rocs, name)
            assert not isinstance(value, types.ModuleType), name
        assert callable(rocs.export) and callable(rocs.backend)
        assert rocs.export is rocs_compiler.export  # the function, not the module
        from rocs_compiler import GLMLinear, compile, load
        import rocs_compiler.layers as layers
        assert layers.GLMLinear is GLMLinear
        assert set(rocs.__all__) <= set(dir(rocs))
        print("ok")
        """
    )
    assert out.split() == ["ok"]


def test_rocs_ops_are_registered_by_load_and_compile():
    out = _run(
        """
        import torch
        import rocs_compiler as rocs
        rocs.load  # touching the loader registers the ops a saved program calls
        print(hasattr(torch.ops.rocs, "broadcast_linear"))
        """
    )
    assert out.split() == ["True"]
