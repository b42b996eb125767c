"""What a strided input costs an AOTInductor package, and what each way of making it safe costs.

    OMP_NUM_THREADS=1 python benchmarks/aoti_input_checks.py [--model dlrm] [--candidates 270,1024]

Builds the portable package of a zoo model (``rocs.aoti_package(rocs.export(cm, portable=True))``)
and, at R = 1 with N candidates whose features are a view of a packed ``[N, 2 * width]`` tensor,
reports on one thread:

- the error of the package's scores on the view (AOTInductor reads every input with the strides
  it was compiled for);
- one call on contiguous inputs with the package's own check of dtypes, sizes and strides off
  (``AOTI_RUNTIME_CHECK_INPUTS=0``) and on (``=1``, the default of ``rocs.aoti_package``'s
  packages; each setting in its own process, which reads it once);
- the copy a caller makes of the view (``clone(memory_format=torch.contiguous_format)``).

Each time is the median of rounds of thread CPU time (``time.thread_time``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rocs_compiler as rocs
from models_zoo import get_entry

ROUNDS = 200


def _median_us(fn, rounds: int = ROUNDS) -> float:
    fn()
    samples = []
    for _ in range(rounds):
        start = time.thread_time()
        fn()
        samples.append(time.thread_time() - start)
    return statistics.median(samples) * 1e6


def _copies(views: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.clone(memory_format=torch.contiguous_format) for v in views]


def _calls(entry, candidates: int) -> dict:
    """A call of one request with ``candidates`` candidates: contiguous, and with every candidate
    input a column view of a packed tensor of twice its width."""
    batch = entry.make_batch([candidates], seed=1)
    contiguous = {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}
    strided = dict(contiguous)
    for name, value in batch.kwargs.items():
        if name not in entry.request_inputs and value.dim() == 2:
            packed = torch.cat([value, value], 1)
            strided[name] = packed[:, value.shape[1] :]
    return {"contiguous": contiguous, "strided": strided}


def child(package: str, calls_path: str) -> None:
    runner = torch._inductor.aoti_load_package(package)
    checked = os.environ.get("AOTI_RUNTIME_CHECK_INPUTS", "1") != "0"  # on unless turned off
    for candidates, calls in torch.load(calls_path).items():
        with torch.no_grad():
            us = _median_us(functools.partial(runner, **calls["contiguous"]))
        print(f"N={candidates} checks={'on' if checked else 'off'} call_us={us:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dlrm")
    parser.add_argument("--candidates", default="270,1024")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        return child(*args.child)
    entry = get_entry(args.model)
    model = entry.build().eval()
    example = entry.make_batch([3, 1, 5]).replicated()
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example)
    where = Path(tempfile.mkdtemp())
    package = rocs.aoti_package(rocs.export(cm, portable=True), where / "model.pt2")
    # This process measures what an unchecked package makes of the view: its checks off (the
    # package reads the variable once, at its first call).
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "0"
    runner = torch._inductor.aoti_load_package(package)
    all_calls = {int(n): _calls(entry, int(n)) for n in args.candidates.split(",")}
    for candidates, calls in all_calls.items():
        with torch.no_grad():
            right = runner(**calls["contiguous"])
            wrong = runner(**calls["strided"])
        views = [v for v in calls["strided"].values() if not v.is_contiguous()]
        copy_us = _median_us(functools.partial(_copies, views))
        print(f"N={candidates} strided_error={(wrong - right).abs().max().item():.3g} "
              f"caller_copy_us={copy_us:.1f}")  # fmt: skip
    torch.save(all_calls, where / "calls.pt")
    for checks in ("0", "1"):
        env = {**os.environ, "AOTI_RUNTIME_CHECK_INPUTS": checks, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, __file__, "--child", package, str(where / "calls.pt")]
        print(
            subprocess.run(command, check=False, env=env, capture_output=True, text=True).stdout,
            end="",
        )


if __name__ == "__main__":
    main()
