"""Training benchmark: one training step, eager on replicated rows vs the training compile.

For each model and each number of impressions per request k, a batch of R requests with k
impressions each is built, and one training step is timed two ways:

- ``eager``: ``model(**batch.replicated())``, the loss, ``backward()``, ``optimizer.step()``;
- ``rocs``: the same step through ``cm = rocs.compile(model, ..., training=True)`` in the shared
  layout (``cm(**batch.kwargs, candidate_to_request=idx)``), the model's own parameters.

The optimizer is SGD with learning rate 0 (its step costs what a step costs; the weights stay put,
so every round times the same computation). The variants run round-robin, each round starting
from the other one; the reported time is the median of ``--repeats`` rounds. Columns:

- **speedup**: eager time / rocs time;
- **ideal**: ``cm.report(num_candidates=R * k, num_requests=R).ideal_speedup()``, the forward FLOP
  ratio. A backward op costs about twice its forward and is shared exactly as its forward is,
  so the forward+backward ratio equals it under that approximation;
- **efficiency**: speedup / ideal;
- **saved MB**: bytes of the tensors autograd saved for the backward (distinct storages other
  than the model's weights, counted with ``torch.autograd.graph.saved_tensors_hooks``), eager /
  rocs: the activations of request rows are kept per request.

Each step's loss is compared with eager's once per shape; a mismatch is printed.

Usage::

    python benchmarks/training.py                              # default models, k in 1 4 16 64
    python benchmarks/training.py --models dlrm --ks 1 16 --requests 4 --repeats 5
    python benchmarks/training.py --quick --json out.json      # tiny sizes (for tests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rocs_compiler as rocs
from models_zoo import ZOO

DEFAULT_MODELS = ["two_tower", "din", "dlrm", "glm:dcnv2", "dca:bst"]


def build(name: str):
    """(model in training mode, zoo entry) for ``name``: a zoo name, or ``glm:NAME`` /
    ``dca:NAME`` for its GLM / DCA conversion."""
    kind, _, zoo_name = name.rpartition(":")
    entry = ZOO[zoo_name]
    model = entry.build(seed=0)
    torch.manual_seed(1)
    if kind == "glm":
        model = rocs.apply_glm(model, entry.request_inputs)
    elif kind == "dca":
        model = rocs.apply_dca(model, entry.request_inputs)
    return model.train(), entry


def loss_of(out) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if t.is_floating_point()]
    return sum((t.float() ** 2).mean() for t in leaves)


def saved_bytes(step, weights: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for the backward during ``step()``'s
    forward (the step's backward frees them), the model's own weights (storages ``weights``)
    not counted: they exist anyway."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def measure(name: str, ks: list[int], requests: int, repeats: int) -> list[dict]:
    model, entry = build(name)
    example = entry.make_batch([2, 3], seed=1).replicated()
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example, training=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    rows = []
    for k in ks:
        batch = entry.make_batch([k] * requests, seed=2)
        replicated = batch.replicated()
        results = {}

        def eager_step(replicated=replicated):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model(**replicated))
            loss.backward()
            opt.step()
            return float(loss)

        def rocs_step(batch=batch):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request))
            loss.backward()
            opt.step()
            return float(loss)

        steps = {"eager": eager_step, "rocs": rocs_step}
        losses = {}
        for v, step in steps.items():  # warm-up and the loss check, one seed each (dropout alike)
            torch.manual_seed(0)
            losses[v] = step()
        if abs(losses["eager"] - losses["rocs"]) > 1e-3 * max(1.0, abs(losses["eager"])):
            print(f"MISMATCH {name} k={k}: eager loss {losses['eager']}, rocs {losses['rocs']}",
                  file=sys.stderr)  # fmt: skip
        times = {v: [] for v in steps}
        for round_ in range(repeats):
            order = list(steps) if round_ % 2 == 0 else list(reversed(steps))
            for v in order:
                start = time.perf_counter()
                steps[v]()
                times[v].append(time.perf_counter() - start)
        for v in steps:
            results[v] = statistics.median(times[v])
        weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        saved = {v: saved_bytes(steps[v], weights) for v in steps}
        ideal = cm.report(num_candidates=requests * k, num_requests=requests).ideal_speedup()
        speedup = results["eager"] / results["rocs"]
        rows.append(
            {
                "model": name, "requests": requests, "k": k, "eager_ms": 1e3 * results["eager"],
                "rocs_ms": 1e3 * results["rocs"], "speedup": speedup, "ideal": ideal,
                "efficiency": speedup / ideal, "eager_saved_mb": saved["eager"] / 2**20,
                "rocs_saved_mb": saved["rocs"] / 2**20,
                "loss_diff": abs(losses["eager"] - losses["rocs"]),
            }
        )  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| model | R | k | eager ms | rocs ms | speedup | ideal | efficiency | saved MB eager / rocs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['requests']} | {r['k']} | {r['eager_ms']:.2f} | {r['rocs_ms']:.2f} "
            f"| {r['speedup']:.2f}x | {r['ideal']:.2f}x | {r['efficiency']:.2f} "
            f"| {r['eager_saved_mb']:.2f} / {r['rocs_saved_mb']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats (for tests)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.ks, args.requests, args.repeats = [1, 4], 2, 2
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        rows += measure(name, args.ks, args.requests, args.repeats)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
