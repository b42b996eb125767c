"""Optimizer drift after 30 steps: the training compile vs eager, read against two float32-only
differences of eager itself: the same batches with their rows permuted (summation order only) and
the model run in float64. Dropout off. Max absolute parameter difference per pair; the table in
docs/contract.md ("Optimizer drift"). Run:
``PYTHONPATH=.:tests OMP_NUM_THREADS=1 python benchmarks/training_drift.py dcnv2 din dlrm``.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch.utils import _pytree as pytree

import rocs_compiler as rocs
from models_zoo import ZOO

sys.path.insert(0, "tests/runtime")
from training_testing import loss_of  # noqa: E402

STEPS = 30
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}


def run(model, call, batches, optimizer: str) -> dict:
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss_of(call(batches[step % len(batches)]), seed=step % len(batches)).backward()
        opt.step()
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def distance(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def rows_of(n: int, fn):
    """``fn`` on every tensor with ``n`` rows (the replicated batch's rows)."""
    return lambda t: fn(t) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n else t


def permuted_call(model):
    def call(batch):
        n = batch.candidate_to_request.shape[0]
        order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        back = torch.argsort(order)
        out = model(**pytree.tree_map(rows_of(n, lambda t: t[order]), batch.replicated()))
        return pytree.tree_map(rows_of(n, lambda t: t[back]), out)

    return call


def float64_call(model):
    def cast(dtype):
        return lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return lambda batch: pytree.tree_map(
        cast(torch.float32), model(**pytree.tree_map(cast(torch.float64), batch.replicated()))
    )


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    print("| model | optimizer | rocs - eager | eager permuted - eager | eager - float64 | rocs - float64 |")
    print("|---|---|---|---|---|---|")
    for name in names:
        entry = ZOO[name]
        base = entry.build(seed=0).train()
        for module in base.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            if isinstance(module, torch.nn.MultiheadAttention):
                module.dropout = 0.0
        counts = [[1, 3, 17], [4, 4], [2, 1, 1, 5]]
        batches = [entry.make_batch(c, seed=s, shuffle=True) for s, c in enumerate(counts)]
        for optimizer in OPTIMIZERS:
            eager_model, permuted_model = copy.deepcopy(base), copy.deepcopy(base)
            wide_model, compiled_model = copy.deepcopy(base).double(), copy.deepcopy(base)
            eager = run(eager_model, lambda b: eager_model(**b.replicated()), batches, optimizer)
            permuted = run(permuted_model, permuted_call(permuted_model), batches, optimizer)
            wide = run(wide_model, float64_call(wide_model), batches, optimizer)
            cm = rocs.compile(
                compiled_model, list(entry.request_inputs), example_kwargs=batches[0].replicated(),
                training=True, options={"autotune": False},
            )  # fmt: skip
            compiled = run(
                compiled_model,
                lambda b: cm(**b.kwargs, candidate_to_request=b.candidate_to_request),
                batches,
                optimizer,
            )
            print(
                f"| {name} | {optimizer} | {distance(compiled, eager):.1e} | "
                f"{distance(permuted, eager):.1e} | {distance(eager, wide):.1e} | "
                f"{distance(compiled, wide):.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:] or ["dcnv2", "din", "dlrm", "wukong", "bst"])
