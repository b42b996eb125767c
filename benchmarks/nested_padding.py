"""What following ``nn.TransformerEncoder``'s nested fast path costs a compiled model.

    OMP_NUM_THREADS=1 python benchmarks/nested_padding.py [--repeats 60]

A history ranker whose encoder nests in eager (``models_zoo/user_models.HistoryTransformerRanker``:
right-padded histories of 20 items, two encoder layers, a masked mean and a target attention that
read the states through the padding mask only). Times, one thread, interleaved rounds, medians:

- ``eager``: the original model on the replicated batch, under ``torch.no_grad()``;
- ``rocs``: ``rocs.compile``'s shared-layout call, whose encoder ends in ``rocs::nested_padding``
  (eager's zeros at padded positions, decided per call: ``kernels/nested_padding.py``);
- ``rocs, no op``: the same model compiled with capture's encoder patch off
  (``capture/nested_fast_path.py``), the graph before the op existed; exact for this model only
  because it never reads a padded position's state.

``op / no op`` is the op's cost relative to the rest of the call.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import rocs_compiler as rocs
from models_zoo.user_models import HistoryTransformerRanker
from rocs_compiler.capture import trace
from rocs_compiler.timing import interleaved_medians

LENGTH = 20


def _batch(requests: int, per_request: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, LENGTH + 1, (requests,), generator=g)
    ids = torch.randint(1, 1000, (requests, LENGTH), generator=g)
    history = torch.where(torch.arange(LENGTH) < lengths.unsqueeze(1), ids, 0)  # right padding
    index = torch.arange(requests).repeat_interleave(per_request)
    item = torch.randint(1, 1000, (index.shape[0],), generator=g)
    return history, item, index


def _compile(model, op: bool):
    history, item, index = _batch(3, 2)
    example = {"history": history[index], "item": item}
    patch = contextlib.nullcontext() if op else _without_the_patch()
    with patch:
        return rocs.compile(model, ["history"], example_kwargs=example, options={"autotune": False})


@contextlib.contextmanager
def _without_the_patch():
    real = trace.following_nested_path
    trace.following_nested_path = contextlib.nullcontext
    try:
        yield
    finally:
        trace.following_nested_path = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = HistoryTransformerRanker().eval()
    with_op, without_op = _compile(model, True), _compile(model, False)
    print("| R x N/R | eager ms | rocs ms | rocs, no op ms | op / no op | max diff to eager |")
    print("|---|---:|---:|---:|---:|---:|")
    for requests, per_request in ((1, 256), (4, 256), (16, 64)):
        history, item, index = _batch(requests, per_request, seed=requests)
        with torch.no_grad():
            want = model(history[index], item)
            got = with_op(history=history, item=item, candidate_to_request=index)
            calls = {
                "eager": lambda: model(history[index], item),
                "rocs": lambda: with_op(history=history, item=item, candidate_to_request=index),
                "no_op": lambda: without_op(history=history, item=item, candidate_to_request=index),
            }
            ms = interleaved_medians(calls, args.repeats)
        diff = (got - want).abs().max().item()
        print(f"| {requests} x {per_request} | {ms['eager']:.2f} | {ms['rocs']:.2f} | "
              f"{ms['no_op']:.2f} | {ms['rocs'] / ms['no_op']:.2f} | {diff:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
