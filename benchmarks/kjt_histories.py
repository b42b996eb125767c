"""Jagged histories given as a TorchRec ``KeyedJaggedTensor`` key: padded to the batch's longest
row, and cut to each request's length.

    OMP_NUM_THREADS=1 python benchmarks/kjt_histories.py [--repeats 6] [--candidates 8]

``HistoryAttention`` (``models_zoo/torchrec_models.py``): an ``EmbeddingCollection`` whose
history key the model reads with ``to_padded_dense()`` (as long as the batch's longest row), a
per-position encoder and a target attention of the candidate item over it. One call: one request
with a history of 2,048 events and 63 with 30 (``--short``), ``--candidates`` candidates each.
One thread, interleaved rounds, medians:

- ``eager``: the original model on TorchRec's replicated KJT (every key one row per candidate);
- ``rocs padded``: the compiled model with jagged calls off, the shared-layout KJT (request keys
  one row per request, TorchRec's inverse indices);
- ``rocs jagged``: the compiled model as it is, the same call: its KJT keys are converted to
  padded rows (``formats/kjt.py``), then the requests grouped by the history key's lengths, each
  group cut to its longest (``runtime/call/jagged.py``).

Every output is checked against eager first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rocs_compiler as rocs  # noqa: E402
from models_zoo import torchrec_models as zoo  # noqa: E402
from rocs_compiler.timing import interleaved_medians  # noqa: E402


def _compiled(model, jagged: bool):
    example = zoo.draw([2, 1, 3], seed=0, histories=[3, 1, 2])
    return rocs.compile(
        model, zoo.REQUEST, example_inputs=(example.dense, example.kjt),
        options={"jagged": jagged},
    )  # fmt: skip


def _tails(short: int):
    g = torch.Generator().manual_seed(0)
    yield f"1 x 2048 + 63 x {short}", [2048] + [short] * 63
    for longest in (256, 512):
        yield f"1 x {longest} + 63 x {short}", [longest] + [short] * 63
    yield "64 uniform in 1..2048", torch.randint(1, 2049, (64,), generator=g).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--short", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = zoo.HistoryAttention().eval()
    padded, jagged = _compiled(model, False), _compiled(model, True)
    print(f"HistoryAttention (TorchRec EmbeddingCollection, KJT history) through rocs.compile, "
          f"64 requests x {args.candidates} candidates, one thread, medians of {args.repeats} "
          "interleaved calls\n")  # fmt: skip
    print("| histories | eager ms | rocs padded ms | rocs jagged ms | jagged vs padded "
          "| jagged vs eager | max diff |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for seed, (label, histories) in enumerate(_tails(args.short)):
        batch = zoo.draw([args.candidates] * 64, seed=seed, histories=histories)
        with torch.no_grad():
            want = model(batch.dense, batch.kjt)
            before = jagged._jagged.split_calls
            diff = max(
                (padded(batch.dense, batch.shared) - want).abs().max(),
                (jagged(batch.dense, batch.shared) - want).abs().max(),
            )
            assert jagged._jagged.split_calls > before, "the jagged compile did not split the call"
            ms = interleaved_medians(
                {
                    "eager": lambda: model(batch.dense, batch.kjt),
                    "padded": lambda: padded(batch.dense, batch.shared),
                    "jagged": lambda: jagged(batch.dense, batch.shared),
                },
                args.repeats,
            )
        print(f"| {label} | {ms['eager']:.1f} | {ms['padded']:.1f} | {ms['jagged']:.1f} "
              f"| {ms['padded'] / ms['jagged']:.1f}x | {ms['eager'] / ms['jagged']:.1f}x "
              f"| {float(diff):.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
