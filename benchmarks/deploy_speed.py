"""Deployed programs on one CPU thread: the portable AOTInductor package against the AOTInductor
package of the original model and the in-process compiled model.

    OMP_NUM_THREADS=1 python benchmarks/deploy_speed.py [--models dlrm,...] [--candidates 270,1024]

For each model (``glm_dcnv2``: DCNv2 with GLM masks, half of every layer request-only), one
request (R = 1) with N candidates:

- ``eager``: the original model on the replicated batch (N rows of request features);
- ``compiled``: ``rocs.compile``'s model in this process, shared layout;
- ``portable AOTI``: ``rocs.aoti_package(rocs.export(cm, portable=True))``, loaded with
  ``torch._inductor.aoti_load_package`` (the C++ runtime a C++ server links), shared layout;
- ``original AOTI``: ``torch.export`` of the original model with a dynamic batch, compiled the
  same way, replicated layout.

Each call's thread CPU time (``time.thread_time``, less sensitive than wall time to other
processes on a shared machine), sampled round-robin across the variants, median of the rounds;
every variant's output is first checked against eager. Prints a Markdown table of speedups over
eager; ``--json FILE`` writes the samples' medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rocs_compiler as rocs  # noqa: E402
from models_zoo import ZOO  # noqa: E402

MODELS = ["dlrm", "two_tower", "din", "target_attention", "glm_dcnv2"]


def build(name: str):
    entry = ZOO["dcnv2" if name == "glm_dcnv2" else name]
    model = entry.build()
    if name == "glm_dcnv2":
        model = rocs.apply_glm(model, list(entry.request_inputs), request_fraction=0.5)
    model = model.eval()
    example = entry.make_batch([4, 3], seed=1).replicated()
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example)
    return entry, model, cm, example


def original_package(model, example: dict, path: Path) -> str:
    """AOTInductor package of the original model, every batched input's dim 0 one dynamic size."""
    rows = {v.shape[0] for v in pytree.tree_leaves(example) if isinstance(v, torch.Tensor)}
    batch = Dim("N", min=1)
    one_batch = len(rows) == 1

    def dims_of(value):
        return {0: batch} if isinstance(value, torch.Tensor) and value.dim() and one_batch else None

    dims = pytree.tree_map(dims_of, example)
    with torch.no_grad():
        program = torch.export.export(model, (), example, dynamic_shapes=dims, strict=False)
    return torch._inductor.aoti_compile_and_package(program, package_path=str(path))


def time_rounds(fns: dict, rounds: int) -> dict[str, float]:
    """Median thread CPU seconds per call of each function, sampled round-robin."""
    names = list(fns)
    samples = {n: [] for n in names}
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad():
            for k in range(rounds):
                shift = k % len(names)
                for name in names[shift:] + names[:shift]:
                    start = time.thread_time()
                    fns[name]()
                    samples[name].append(time.thread_time() - start)
    finally:
        gc.enable()
    return {n: statistics.median(s) for n, s in samples.items()}


def _close(out, ref, what: str) -> None:
    for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=what)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--candidates", default="270,1024")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            entry, model, cm, example = build(name)
            start = time.perf_counter()
            portable = rocs.aoti_package(
                rocs.export(cm, portable=True), Path(tmp) / f"{name}_portable.pt2"
            )
            original = original_package(model, example, Path(tmp) / f"{name}_original.pt2")
            built = time.perf_counter() - start
            portable_run = torch._inductor.aoti_load_package(portable)
            original_run = torch._inductor.aoti_load_package(original)
            for n in [int(c) for c in args.candidates.split(",")]:
                batch = entry.make_batch([n], seed=n)
                shared = {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}
                replicated = batch.replicated()
                fns = {
                    "eager": lambda: model(**replicated),
                    "compiled": lambda: cm(**shared),
                    "portable AOTI": lambda: portable_run(**shared),
                    "original AOTI": lambda: original_run(**replicated),
                }
                with torch.no_grad():
                    want = fns["eager"]()
                    for label, fn in fns.items():
                        _close(fn(), want, f"{name} N={n} {label}")
                medians = time_rounds(fns, args.rounds)
                eager = medians["eager"]
                speedup = {k: eager / v for k, v in medians.items()}
                results.append({"model": name, "R": 1, "N": n, "seconds": medians})
                rows.append(
                    f"| {name} | {n} | {eager * 1e3:.2f} | {speedup['compiled']:.2f}x | "
                    f"{speedup['portable AOTI']:.2f}x | {speedup['original AOTI']:.2f}x | "
                    f"{speedup['portable AOTI'] / speedup['compiled']:.2f} | "
                    f"{medians['original AOTI'] / medians['portable AOTI']:.2f}x |"
                )
                print(rows[-1], f"(packages built in {built:.0f} s)", file=sys.stderr, flush=True)
    print("| model | N (R = 1) | eager ms | compiled | portable AOTI | original AOTI | "
          "portable / compiled speedup | portable vs original AOTI |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
