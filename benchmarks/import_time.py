"""Start-up cost: ``import torch``, ``import rocs_compiler`` (alone and after torch), ``rocs --help``
and a CLI input error.

    python benchmarks/import_time.py [--repeats 5]

Each case runs in a fresh Python subprocess (``python -c ...`` or ``python -m rocs_compiler.cli``)
from the repository root, timed from spawn to exit. "cold" is the first run of a case (the
first of this script's runs: the OS file cache may already hold the files from earlier
processes), "warm" the median of the ``--repeats`` runs after it. The CLI input error is
``rocs inspect model.py:Ranker`` on a model without example inputs (it loads torch and the
model, then stops at the missing ``--input``). Prints a Markdown table with the exit code and
which of torch, Triton and sympy the case imported.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Ranker(nn.Module):
        def __init__(self):
            super().__init__()
            self.user = nn.Linear(8, 4)

        def forward(self, user, item):
            return self.user(user).sum(-1) + item.float()
    """
)

HEAVY = ("torch", "triton", "sympy")


def _cases(model_file: Path) -> dict[str, list[str]]:
    cli = ["-m", "rocs_compiler.cli"]
    return {
        "import torch": ["-c", "import torch"],
        "import rocs_compiler": ["-c", "import rocs_compiler"],
        # torch, then the rocs:: ops' schemas (what a process loading a saved program pays)
        "import torch, rocs_compiler": ["-c", "import torch, rocs_compiler"],
        "rocs --help": [*cli, "--help"],
        "rocs CLI input error": [*cli, "inspect", f"{model_file}:Ranker", "--request", "user"],
    }


def _heavy_imports(arguments: list[str]) -> str:
    """The heavy packages a case imports, from one more run under ``-X importtime`` (not timed:
    the listing slows the run down)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", *arguments], cwd=ROOT, capture_output=True, text=True
    )
    names = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    return " ".join(m for m in HEAVY if m in names) or "-"


def _run(arguments: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *arguments], cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - start, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="warm runs per case (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_file = Path(tmp) / "ranker_model.py"
        model_file.write_text(_MODEL)
        rows = []
        for name, arguments in _cases(model_file).items():
            cold, code = _run(arguments)
            warm = statistics.median(_run(arguments)[0] for _ in range(args.repeats))
            rows.append((name, cold, warm, code, _heavy_imports(arguments)))
    print("| case | cold s | warm s (median) | exit | imports |")
    print("|---|---:|---:|---:|---|")
    for name, cold, warm, code, loaded in rows:
        print(f"| {name} | {cold:.2f} | {warm:.2f} | {code} | {loaded} |")


if __name__ == "__main__":
    main()
