"""Compile time of ``rocs.compile`` on the zoo models, stage by stage.

    python benchmarks/compile_time.py [--models dlrm,bst] [--repeats 3]

``deep_mixed`` is a synthetic large graph (request and candidate fields stacked, then a deep
elementwise/norm stack over the mixed tensor) that stresses the rewrite engine. Prints a Markdown
table: graph size (nodes of the logical graph after the rewrites, and of the shared graph), the
median wall time of the whole ``rocs.compile`` call and of the rewrite passes alone (defer, to
their fixpoint, and ikbo), over ``--repeats`` compiles in one process with one torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

import rocs_compiler as rocs
from models_zoo import ZOO


@contextmanager
def _timed_calls(module, name: str, sink: list[float]):
    """Accumulate the wall time of every call of ``module.name`` into ``sink``."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, original)


class DeepMixed(torch.nn.Module):
    """A large graph for the rewrite engine: many request and candidate fields concatenated,
    then a deep stack of elementwise ops, norms and linear maps over the mixed tensor."""

    def __init__(self, fields: int = 16, dim: int = 8, depth: int = 24):
        super().__init__()
        self.fields, self.dim = fields, dim
        width = 2 * fields * dim
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, user, item):
        pieces = list(user.split(self.dim, 1)) + list(item.split(self.dim, 1))
        x = torch.stack(pieces, 1)  # [B, 2 F, D]: request fields first
        for norm in self.norms:
            x = norm(torch.sigmoid(x) * 0.5 + torch.tanh(x))
        return self.head(x.flatten(1)).squeeze(-1)


def _model_and_example(name: str):
    if name == "deep_mixed":
        model = DeepMixed().eval()
        width = model.fields * model.dim
        example = {"user": torch.randn(7, width), "item": torch.randn(7, width)}
        return model, ["user"], example
    entry = ZOO[name]
    return entry.build(), entry.request_inputs, entry.make_batch([4, 3]).replicated()


def measure(name: str, repeats: int) -> dict:
    from rocs_compiler.passes import defer as defer_module
    from rocs_compiler.passes import ikbo as ikbo_module

    model, request_inputs, example = _model_and_example(name)
    totals, rewrites = [], []
    cm = None
    for _ in range(repeats):
        spent: list[float] = []
        with _timed_calls(defer_module, "defer", spent), _timed_calls(ikbo_module, "ikbo", spent):
            start = time.perf_counter()
            cm = rocs.compile(model, request_inputs=request_inputs, example_kwargs=example)
            totals.append(time.perf_counter() - start)
        rewrites.append(sum(spent))
    result = cm.pipeline_result
    return {
        "model": name,
        "logical nodes": len(result.logical_graph.graph.nodes),
        "shared nodes": len(result.shared_graph.graph.nodes),
        "compile s": statistics.median(totals),
        "rewrites s": statistics.median(rewrites),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default=",".join([*ZOO, "deep_mixed"]), help="comma-separated zoo names"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(name, args.repeats) for name in args.models.split(",")]
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
