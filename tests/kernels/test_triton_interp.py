"""Run the Triton cases (``triton_cases.py``) under the Triton CPU interpreter.

``TRITON_INTERPRET`` is read when triton is imported, so the cases run in a child process
with ``TRITON_INTERPRET=1 ROCS_TRITON_ON_CPU=1``; this process is unaffected. Skipped only
when triton cannot be imported.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter(tmp_path):
    env = dict(os.environ)
    env.update(
        TRITON_INTERPRET="1",
        ROCS_TRITON_ON_CPU="1",
        ROCS_TRITON_TEST_DEVICE="cpu",
        ROCS_KERNEL_CACHE_DIR=str(tmp_path / "kernels"),
        PYTHONWARNINGS="ignore::RuntimeWarning",  # masked lanes of log/rsqrt in numpy
    )
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
        str(HERE / "triton_cases.py"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout
