"""History encoders built from torch's own modules: eager vs rocs vs a hand-written rewrite.

    python benchmarks/lineage.py [--requests 2] [--candidates 256] [--repeats 15]

One model per construct of ``models_zoo/history_encoders.py`` (``nn.MultiheadAttention`` self and
target attention, ``nn.TransformerEncoder`` in both layouts, ``nn.TransformerDecoderLayer``,
``nn.GRU``/``nn.LSTM``/``nn.RNN``, heads merged into the batch, a history updated in place),
at ``--requests`` requests x ``--candidates`` candidates each, one torch thread. Three callers
run side by side in one process, interleaved, medians of repeated runs:

* eager: the model on replicated inputs (what a serving stack runs without rocs);
* hand: ``model.shared_forward``, the per-request rewrite a serving engineer would write;
* rocs: the compiled model, shared layout (the same inputs as the hand rewrite).

Prints a Markdown table with the speedups over eager and ``rocs / hand`` (speed of rocs as a
fraction of the hand rewrite's: above 1 means rocs is faster) and whether all three agree.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

import rocs_compiler as rocs
from models_zoo.history_encoders import (
    Decoder,
    Encoder,
    InPlaceHistory,
    MergedHeads,
    Recurrent,
    SelfAndTargetAttention,
)
from models_zoo import request_index
from rocs_compiler.timing import interleaved_medians

DIM, LENGTH, HEADS = 64, 32, 4
SIZES = dict(dim=DIM, length=LENGTH, heads=HEADS)
MODELS = {
    "MHA self + target attention": lambda: SelfAndTargetAttention(**SIZES),
    "MHA, sequence first, key padding": lambda: SelfAndTargetAttention(
        **SIZES, sequence_first=True, padding=True
    ),
    "TransformerEncoder, sequence first": lambda: Encoder(**SIZES, sequence_first=True),
    "TransformerEncoder, batch first, norm first": lambda: Encoder(**SIZES, norm_first=True),
    "TransformerDecoderLayer": lambda: Decoder(**SIZES),
    "GRU, sequence first": lambda: Recurrent(nn.GRU, **SIZES, sequence_first=True),
    "LSTM, batch first, 2 layers, given state": lambda: Recurrent(
        nn.LSTM, **SIZES, layers=2, h0=True
    ),
    "RNN, bidirectional": lambda: Recurrent(nn.RNN, **SIZES, bidirectional=True),
    "heads merged into the batch (bmm)": lambda: MergedHeads(**SIZES),
    "history updated in place": lambda: InPlaceHistory(**SIZES),
}


def measure(name: str, num_requests: int, candidates: int, repeats: int) -> str:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    hist = torch.randn(num_requests, LENGTH, DIM)
    index = request_index([candidates] * num_requests, shuffle=True)
    c = torch.randn(index.numel(), 8)
    example = {"hist": hist[index[:4]], "c": c[:4]}
    compiled = rocs.compile(model, ["hist"], example_kwargs=example)
    replicated = hist.index_select(0, index)
    calls = {
        "eager": lambda: model(replicated, c),
        "hand": lambda: model.shared_forward(hist, c, index),
        "rocs": lambda: compiled(hist=hist, c=c, candidate_to_request=index),
    }
    with torch.no_grad():
        results = {k: fn() for k, fn in calls.items()}
        exact = all(
            torch.allclose(results[k], results["eager"], rtol=1e-4, atol=1e-4)
            for k in ("hand", "rocs")
        )
        medians = interleaved_medians(calls, repeats)
    eager, hand, ours = (medians[k] for k in ("eager", "hand", "rocs"))
    fallbacks = len(compiled.report(candidates=candidates, requests=num_requests).fallbacks)
    return (
        f"| {name} | {eager:.1f} | {hand:.2f} | {ours:.2f} | {eager / hand:.1f}x | "
        f"{eager / ours:.1f}x | {hand / ours:.2f} | {fallbacks} | {exact} |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--candidates", type=int, default=256, help="candidates per request")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--models", nargs="*", default=list(MODELS), help="a subset of the rows")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    print(
        f"{args.requests} requests x {args.candidates} candidates, history [{LENGTH}, {DIM}], "
        f"{HEADS} heads, one thread; times in ms (medians)\n"
    )
    print("| history encoder | eager | hand | rocs | hand vs eager | rocs vs eager | "
          "rocs / hand | fallbacks | exact |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        print(measure(name, args.requests, args.candidates, args.repeats), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
