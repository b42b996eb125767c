"""Attention in portable programs, one CPU thread: the per-request form
(``rocs_compiler/kernels/attention_portable.py``) against the reference portable programs ran
before it, which gathers each request's keys and values once per candidate (``k[idx]``,
``v[idx]``: ``[N, H, L, D]``).

    OMP_NUM_THREADS=1 python benchmarks/portable_attention.py [--rounds 21] [--skip-model]

Two tables, both AOTInductor packages (dynamic R and N, compiled once per variant) loaded with
``torch._inductor.aoti_load_package``:

- the op alone, ``broadcast_attention(q [N, H, 1, D], k, v [R, H, L, D], idx, key_mask [R, L])``,
  for three head shapes and batches from one request to one candidate per request (``ragged``:
  counts drawn uniformly, ``skew``: one request holds almost every candidate);
- the zoo's ``target_attention`` model, ``rocs.export(cm, portable=True)`` with either form.

Each call's thread CPU time (``time.thread_time``), the two variants sampled round-robin, median
of ``--rounds``; every output is checked against the reference first.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.export import Dim

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rocs_compiler as rocs  # noqa: E402
from models_zoo import ZOO  # noqa: E402
from rocs_compiler.kernels import ROCS_OPS  # noqa: E402
from rocs_compiler.kernels.attention_portable import per_request_attention  # noqa: E402

REFERENCE = ROCS_OPS["broadcast_attention"].reference
HEAD_SHAPES = [(2, 64, 32), (2, 50, 16), (4, 200, 64)]  # (H, L, D); the first is target_attention's


def batches() -> dict[str, list[int]]:
    """Candidate counts per request, by a label ``R x N kind``."""
    draw = torch.Generator().manual_seed(1)

    def ragged(requests: int, candidates: int) -> list[int]:
        picks = torch.randint(0, requests, (candidates,), generator=draw)
        return torch.bincount(picks, minlength=requests).tolist()

    return {
        "1 x 270": [270],
        "1 x 1024": [1024],
        "4 x 270 ragged": [100, 20, 120, 30],
        "4 x 1024 equal": [256] * 4,
        "4 x 1024 skew": [1000, 8, 8, 8],
        "64 x 1024 ragged": ragged(64, 1024),
        "512 x 1024 ragged": ragged(512, 1024),
        "256 x 256 one each": [1] * 256,
    }


def op_inputs(counts: list[int], heads: int, length: int, dim: int, seed: int = 0) -> tuple:
    draw = torch.Generator().manual_seed(seed)
    requests, candidates = len(counts), sum(counts)
    index = torch.repeat_interleave(torch.arange(requests), torch.tensor(counts))
    index = index[torch.randperm(candidates, generator=draw)]
    q = torch.randn(candidates, heads, 1, dim, generator=draw)
    k, v = (torch.randn(requests, heads, length, dim, generator=draw) for _ in range(2))
    return q, k, v, index, torch.rand(requests, length, generator=draw) > 0.2


class _Op(torch.nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, q, k, v, index, key_mask):
        return self.form(q, k, v, index, key_mask)


def op_package(form, example: tuple, path: Path):
    requests, candidates = Dim("R", min=1), Dim("N", min=1)
    dims = ({0: candidates}, {0: requests}, {0: requests}, {0: candidates}, {0: requests})
    with torch.no_grad():
        program = torch.export.export(_Op(form), example, dynamic_shapes=dims, strict=False)
    # R = 1 and N = 1 are valid sizes, which Inductor's lower-bound check (2) would refuse.
    configs = {"aot_inductor.check_lowerbound": False}
    return torch._inductor.aoti_compile_and_package(
        program, package_path=str(path), inductor_configs=configs
    )


def time_pair(fns: dict, rounds: int) -> dict[str, float]:
    """Median thread CPU seconds per call of each function, sampled round-robin."""
    samples = {name: [] for name in fns}
    names = list(fns)
    with torch.no_grad():
        for k in range(rounds):
            for name in names[k % len(names) :] + names[: k % len(names)]:
                start = time.thread_time()
                fns[name]()
                samples[name].append(time.thread_time() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def op_table(rounds: int, tmp: Path) -> list[str]:
    rows = ["| H, L, D | R x N | reference ms | per request ms | speedup |",
            "|---|---|---:|---:|---:|"]  # fmt: skip
    for heads, length, dim in HEAD_SHAPES:
        example = op_inputs([2, 1], heads, length, dim)
        runners = {
            name: torch._inductor.aoti_load_package(
                op_package(form, example, tmp / f"{name}_{heads}_{length}_{dim}.pt2")
            )
            for name, form in (("reference", REFERENCE), ("per request", per_request_attention))
        }
        for label, counts in batches().items():
            args = op_inputs(counts, heads, length, dim, seed=len(counts))
            with torch.no_grad():
                want = REFERENCE(*args)
                for name, run in runners.items():
                    torch.testing.assert_close(run(*args), want, rtol=1e-4, atol=1e-5, msg=name)
            fns = {name: (lambda run=run: run(*args)) for name, run in runners.items()}
            ms = {name: s * 1e3 for name, s in time_pair(fns, rounds).items()}
            rows.append(
                f"| {heads}, {length}, {dim} | {label} | {ms['reference']:.2f} | "
                f"{ms['per request']:.2f} | {ms['reference'] / ms['per request']:.1f}x |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


@contextlib.contextmanager
def reference_attention():
    """Portable exports run the reference for attention, as they did before the per-request form
    (the op record without its ``portable``)."""
    record = ROCS_OPS["broadcast_attention"]
    ROCS_OPS["broadcast_attention"] = dataclasses.replace(record, portable=None)
    try:
        yield
    finally:
        ROCS_OPS["broadcast_attention"] = record


def model_table(rounds: int, tmp: Path) -> list[str]:
    entry = ZOO["target_attention"]
    model = entry.build().eval()
    example = entry.make_batch([4, 3], seed=1).replicated()
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example)
    with reference_attention():
        before = rocs.aoti_package(rocs.export(cm, portable=True), tmp / "ta_reference.pt2")
    after = rocs.aoti_package(rocs.export(cm, portable=True), tmp / "ta_per_request.pt2")
    runners = {
        "reference": torch._inductor.aoti_load_package(before),
        "per request": torch._inductor.aoti_load_package(after),
    }
    rows = ["| R x N | eager ms | reference ms | per request ms | speedup |",
            "|---|---:|---:|---:|---:|"]  # fmt: skip
    for label, counts in batches().items():
        batch = entry.make_batch(counts, seed=len(counts), shuffle=True)
        shared = {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}
        replicated = batch.replicated()
        with torch.no_grad():
            want = model(**replicated)
            for name, run in runners.items():
                torch.testing.assert_close(run(**shared), want, rtol=1e-4, atol=1e-5, msg=name)
        fns = {name: (lambda run=run: run(**shared)) for name, run in runners.items()}
        ms = {name: s * 1e3 for name, s in time_pair(fns, rounds).items()}
        eager = time_pair({"eager": lambda: model(**replicated)}, 5)["eager"]
        rows.append(
            f"| {label} | {eager * 1e3:.2f} | {ms['reference']:.2f} | {ms['per request']:.2f} | "
            f"{ms['reference'] / ms['per request']:.1f}x |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--skip-model", action="store_true", help="the op table only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        print("\n".join(op_table(args.rounds, Path(tmp))))
        if not args.skip_model:
            print()
            print("\n".join(model_table(args.rounds, Path(tmp))))


if __name__ == "__main__":
    main()
