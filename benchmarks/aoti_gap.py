"""Where the AOTInductor package of a rocs program loses to the expert's rewrite (issue #49): the
same package built without the program's in-graph input checks, timed beside both.

    OMP_NUM_THREADS=1 python benchmarks/aoti_gap.py [--models dlrm,glm_dcnv2,history_transformer]
        [--sizes 1x270,4x1024] [--repeats 15] [--boxed]

Variants, each an AOTInductor package of the shared-layout program (``doors.py``'s ``aoti``
door), timed round-robin on one thread, medians of ``--repeats`` rounds, the calling thread's
CPU time:

- ``hand``: ``torch.export`` of the hand rewrite (``hand_rewrites/``), R and N dynamic;
- ``rocs``: ``rocs.aoti_package(rocs.export(cm, portable=True))``, as shipped;
- ``rocs unchecked``: the same program exported with its in-graph input checks taken out
  (``export/input_checks.py``'s ``check_shared_call`` made the identity while exporting: no
  index range, row-count or cap checks), to size what the checks cost.

Every variant's output is compared with the original model's first. ``unchecked`` is a
measurement, not a product: a shipped program keeps its checks (docs/deploy.md). ``--boxed``
times the package's ``loader.boxed_run`` on the flat inputs instead of its Python call (which
reads its input spec from JSON and flattens the inputs on every call, 20-40 us the same for
every variant).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import torch.utils._pytree as pytree
from torch.export._tree_utils import reorder_kwargs

sys.path.insert(0, str(Path(__file__).resolve().parent))

import doors  # noqa: E402
import rocs_compiler as rocs  # noqa: E402
from hand_rewrites import CASES  # noqa: E402
from regression import time_interleaved  # noqa: E402


def unchecked_program(s: doors.Subject):
    """``s``'s portable program exported with ``check_shared_call`` the identity on the index."""
    module = importlib.import_module("rocs_compiler.export")  # the module, not rocs.export
    with mock.patch.object(module, "check_shared_call", lambda leaves, index, *_: index):
        return rocs.export(s.cm, portable=True)


def packages(s: doors.Subject, where: Path) -> dict:
    def load(path):
        return torch._inductor.aoti_load_package(str(path))

    hand = where / f"{s.case.name}_hand.pt2"
    torch._inductor.aoti_compile_and_package(doors.hand_export(s), package_path=str(hand))
    ours, bare = where / f"{s.case.name}_rocs.pt2", where / f"{s.case.name}_unchecked.pt2"
    rocs.aoti_package(s.program, ours)
    rocs.aoti_package(unchecked_program(s), bare)
    return {"hand": load(hand), "rocs": load(ours), "rocs unchecked": load(bare)}


def _call(runner, inputs: dict):
    return lambda: runner(**inputs)


def _boxed(runner, inputs: dict):
    """The package's compiled call on flat inputs, its outputs unflattened as its call does."""
    in_spec, out_spec = map(pytree.treespec_loads, runner.loader.get_call_spec())
    flat = pytree.tree_flatten(((), reorder_kwargs(inputs, in_spec)))[0]
    flat = [x for x in flat if isinstance(x, torch.Tensor)]
    return lambda: pytree.tree_unflatten(runner.loader.boxed_run(list(flat)), out_spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="dlrm,glm_dcnv2,history_transformer")
    parser.add_argument("--sizes", default="1x270,4x1024")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--sample-ms", type=float, default=20.0)
    parser.add_argument("--boxed", action="store_true", help="time loader.boxed_run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    doors.retain_freed_memory()
    where = Path(tempfile.mkdtemp(prefix="rocs_aoti_gap_"))
    print("| model | R | N | hand ms | rocs ms | rocs unchecked ms | hand / rocs "
          "| hand / unchecked | checks' share of rocs |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        s = doors.subject(CASES[name])
        runs = packages(s, where)
        for size in args.sizes.split(","):
            requests, candidates = map(int, size.split("x"))
            counts = doors.ragged_counts(requests, candidates)
            batch = s.case.make_batch(counts, seed=candidates + requests, shuffle=True)
            want = doors.expected(s, batch)
            inputs = doors.shared(batch)
            calls = {}
            with torch.no_grad():
                for variant, runner in runs.items():
                    call = _boxed(runner, inputs) if args.boxed else _call(runner, inputs)
                    torch.testing.assert_close(call(), want, rtol=1e-4, atol=1e-4)
                    calls[variant] = call
                times = time_interleaved(calls, args.repeats, args.sample_ms / 1e3, time.thread_time)
            hand, ours, bare = (times[v] * 1e3 for v in ("hand", "rocs", "rocs unchecked"))
            print(f"| {name} | {requests} | {candidates} | {hand:.3f} | {ours:.3f} | {bare:.3f} "
                  f"| {hand / ours:.2f} | {hand / bare:.2f} | {(ours - bare) / ours:.0%} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
