"""One compile, every history length: DIN compiled once with its history length marked dynamic,
then called at lengths 1 to 2048.

    OMP_NUM_THREADS=1 python benchmarks/history_lengths.py [--repeats 30] [--candidates 256]
        [--unmarked]

DIN (``models_zoo/din.py``) with the example's history dims marked
(``torch._dynamo.mark_dynamic(example[name], 1)``, docs/contract.md "Sizes that change between
calls"), one request of ``--candidates`` candidates per call, histories half full; with
``--unmarked``, from an example with nothing marked (the first call at another length compiles the
model again with its length dynamic, ``runtime/modes/new_sizes.py``). Per length, one thread,
interleaved rounds, medians:

- ``eager``: the original model on the replicated batch, under ``torch.no_grad()``;
- ``rocs``: the compiled model's shared-layout call, after :data:`WARM_CALLS` untimed calls at that
  length (the trials of the length's bucket, which time the programs and the original model
  against each other, are over);
- ``graphs compiled``: how many graphs the compiled model has run so far (the example's, and the
  one compiled again for another length where the example marked none);
- ``programs built``: how many straight-line programs the compiled model has built so far (the
  shared and the plain one, ``runtime/program/direct.py``): a length that compiled anything again
  would raise it;
- ``FLOPs per request``: ``cm.report(lengths=...)``, the cost model at that length.

Every call's output is checked against eager first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rocs_compiler as rocs  # noqa: E402
from models_zoo import din  # noqa: E402
from rocs_compiler.timing import interleaved_medians  # noqa: E402

LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Calls before timing a length: the program choice's trials of its bucket (two programs, TRIALS
# calls each, ``runtime/choice/program_choice.py``) and then, in a bucket settled on the plain
# program, the original model's (two arms, ARM_TRIALS calls each, ``runtime/call/original_arm.py``)
# are over, as once a server has warmed up.
WARM_CALLS = 48


def _compiled(model, marked: bool = True):
    example = din.make_batch([4, 3]).replicated()
    for name in ("hist_item_ids", "hist_cat_ids") if marked else ():
        torch._dynamo.mark_dynamic(example[name], 1)
    # Each call's histories are half padding: jagged calls would cut them (benchmarks/jagged_histories.py);
    # this table compares eager and rocs at the same width.
    return rocs.compile(
        model, list(din.REQUEST_INPUTS), example_kwargs=example, options={"jagged": False}
    )


def _call(length: int, candidates: int, seed: int) -> tuple[dict, torch.Tensor]:
    """Shared-layout inputs of one request with a history of ``length`` (half of it events)."""
    batch = din.make_batch([candidates], seed=seed)
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(batch.kwargs)
    for name, vocab in (("hist_item_ids", din.NUM_ITEMS), ("hist_cat_ids", din.NUM_CATS)):
        ids = torch.randint(1, vocab, (1, length), generator=g)
        kwargs[name] = ids.masked_fill(torch.arange(length) >= max(length // 2, 1), 0)
    return kwargs, batch.candidate_to_request


def _programs(cm) -> int:
    return sum(p is not None for p in (cm._runner, cm._plain._runner if cm._plain else None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--candidates", type=int, default=256)
    parser.add_argument("--unmarked", action="store_true", help="compile from an unmarked example")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = din.build(seed=0).eval()
    cm = _compiled(model, marked=not args.unmarked)
    graphs = {id(cm.graph_module)}
    print("| length | eager ms | rocs ms | speedup | graphs compiled | programs built "
          "| FLOPs per request | max diff |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length in LENGTHS:
        kwargs, index = _call(length, args.candidates, seed=length)
        replicated = {n: v[index] if n in din.REQUEST_INPUTS else v for n, v in kwargs.items()}
        with torch.no_grad():
            diff = (cm(**kwargs, candidate_to_request=index) - model(**replicated)).abs().max()
            for _ in range(WARM_CALLS):  # the length's bucket decided, as in a served steady state
                cm(**kwargs, candidate_to_request=index)
            calls = {
                "eager": lambda: model(**replicated),
                "rocs": lambda: cm(**kwargs, candidate_to_request=index),
            }
            ms = interleaved_medians(calls, args.repeats)
        graphs.add(id(cm.graph_module))
        flops = cm.report(candidates=args.candidates, lengths={"hist_item_ids": length})
        print(f"| {length} | {ms['eager']:.2f} | {ms['rocs']:.2f} | {ms['eager'] / ms['rocs']:.2f}x "
              f"| {len(graphs)} | {_programs(cm)} | {flops.request_flops / 1e6:.2f}M | {diff:.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
