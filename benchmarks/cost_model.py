"""The cost model against measured time: every zoo model's predicted milliseconds per call
(``cm.cost().predict_ms(rocs.calibrate(), R=..., N=..., ...)``) beside the measured ones.

    python benchmarks/cost_model.py [--models din dlrm] [--quick] [--retain] [--json out.json]

One torch thread, ``torch.no_grad()``. First ``rocs.calibrate()`` (single ops only, no model),
then the per-call overhead of a compiled model's call path (``Calibration.call_s``, which
``calibrate`` does not measure) from a one-layer model that is not in the zoo: its measured call
at R = N = 1 less its ops' predicted time. Then per zoo model, compiled once with
``options={"autotune": False, "jagged": False}`` (so every call runs the shared program at the
call's padded width; history lengths of DIN, HSTU and target attention marked dynamic in the
example), every cell of R in {1, 4, 16} x N in {64, 512, 2048} (R requests of N / R candidates
each) and, for those three models, two or three history lengths (histories full: no padding).
Each cell is warmed up, then timed in interleaved rounds (per round, every cell of the model in
turn: one untimed call, then calls lasting at least 5 ms), with the thread's CPU time; the table
gives the medians over rounds.
``ratio`` is predicted / measured; the summary counts the cells within 25%.

``--retain``: glibc's malloc keeps freed memory for the whole run, calibration included
(``allocator.py``, as ``doors.py`` times). By default it serves large blocks with ``mmap`` and
trims its heap depending on the order of earlier allocations, so a call that allocates tens of
megabytes faults on fresh pages in one cell and not in the next (DIN at N x L = 102,400 token
rows: 67 ms in one cell, 106-114 ms in cells of the same sizes): the calibration models the faults
of blocks past 32 MiB (``mapped_s``), not the allocator's history.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rocs_compiler as rocs  # noqa: E402
from allocator import retain_freed_memory  # noqa: E402
from models_zoo import ZOO, din, hstu, target_attention  # noqa: E402

SIZES = [(r, n) for r in (1, 4, 16) for n in (64, 512, 2048)]
QUICK_SIZES = [(1, 64), (4, 512), (16, 2048)]
# model -> ({history input: vocabulary}, lengths timed); the others keep their fixed length.
HISTORIES = {
    "din": ({"hist_item_ids": din.NUM_ITEMS, "hist_cat_ids": din.NUM_CATS}, (10, 50, 200)),
    "hstu": ({"hist_item_ids": hstu.NUM_ITEMS, "hist_actions": hstu.NUM_ACTIONS}, (8, 24)),
    "target_attention": ({"hist_item_ids": target_attention.NUM_ITEMS}, (16, 64)),
}
OPTIONS = {"autotune": False, "jagged": False}
TOLERANCE = 0.25


class _OneLayer(torch.nn.Module):
    """Not a zoo model: one linear layer over a request and a candidate feature."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, user, item):
        return self.linear(torch.cat([user, item], 1)).squeeze(1)


def _call_ms(fn, min_ms: float = 5.0) -> float:
    """ms per call of ``fn`` over enough calls to last ``min_ms``, after one untimed call (the
    cell before it in the round left other data in the caches)."""
    fn()
    start = time.thread_time()
    fn()
    once = max((time.thread_time() - start) * 1e3, 1e-3)
    loops = max(1, int(min_ms / once))
    start = time.thread_time()
    for _ in range(loops):
        fn()
    return (time.thread_time() - start) * 1e3 / loops


def _interleaved(calls: dict, rounds: int, warmup: int = 3) -> dict:
    """Median ms per call of each of ``calls``, each timed once per round, the cells in turn."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    times = {key: [] for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            times[key].append(_call_ms(fn))
    return {key: statistics.median(values) for key, values in times.items()}


def call_overhead_s(calibration: rocs.Calibration, rounds: int) -> float:
    """The compiled model's per-call overhead: a one-layer model's call, less its ops."""
    model = _OneLayer().eval()
    example = {"user": torch.randn(6, 4), "item": torch.randn(6, 4)}
    cm = rocs.compile(model, ["user"], example_kwargs=example, options=OPTIONS)
    user, item, index = torch.randn(1, 4), torch.randn(1, 4), torch.zeros(1, dtype=torch.long)
    measured = _interleaved({"call": lambda: cm(user=user, item=item, candidate_to_request=index)},
                            rounds)["call"]  # fmt: skip
    ops = cm.cost().predict_ms(calibration, R=1, N=1)
    return max(measured - ops, 0.0) / 1e3


def _with_histories(kwargs: dict, vocabs: dict, length: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    kwargs = dict(kwargs)
    for name, vocab in vocabs.items():
        kwargs[name] = torch.randint(1, vocab, (kwargs[name].shape[0], length), generator=g)
    return kwargs


def measure_model(name: str, calibration, sizes, rounds: int, quick: bool) -> list[dict]:
    entry = ZOO[name]
    model = entry.build(seed=0).eval()
    example = entry.make_batch([4, 3]).replicated()
    vocabs, lengths = HISTORIES.get(name, ({}, (None,)))
    if quick:
        lengths = (lengths[0], lengths[-1]) if lengths[0] is not None else lengths
    for history in vocabs:
        torch._dynamo.mark_dynamic(example[history], 1)
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example, options=OPTIONS)
    cost = cm.cost()
    cells, calls = [], {}
    for length in lengths:
        for requests, candidates in sizes:
            batch = entry.make_batch([candidates // requests] * requests, seed=candidates)
            kwargs = batch.kwargs
            if length is not None:
                kwargs = _with_histories(kwargs, vocabs, length, seed=length)
            index = batch.candidate_to_request
            key = (requests, candidates, length)
            calls[key] = lambda kwargs=kwargs, index=index: cm(**kwargs, candidate_to_request=index)
            at_length = {} if length is None else {h: length for h in vocabs}
            predicted = cost.predict_ms(calibration, R=requests, N=candidates, **at_length)
            cells.append({"model": name, "R": requests, "N": candidates, "L": length,
                          "predicted_ms": predicted})  # fmt: skip
    with torch.no_grad():
        measured = _interleaved(calls, rounds)
    choices = set(cm.program_choices().values())
    if choices - {"shared"}:
        print(f"# {name}: calls ran {sorted(choices)}, not only the shared program")
    for cell in cells:
        cell["measured_ms"] = measured[(cell["R"], cell["N"], cell["L"])]
        cell["ratio"] = cell["predicted_ms"] / cell["measured_ms"]
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--quick", action="store_true", help="3 sizes, 2 lengths, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--calibration-seconds", type=float, default=3.0)
    parser.add_argument("--json", type=Path, default=None, help="write cells and calibration")
    parser.add_argument("--retain", action="store_true", help="malloc keeps freed memory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.retain and not retain_freed_memory():
        print("# --retain: this malloc is not glibc's; it runs as it is")
    rounds = args.rounds or (5 if args.quick else 9)
    sizes = QUICK_SIZES if args.quick else SIZES

    started = time.perf_counter()
    calibration = rocs.calibrate(args.calibration_seconds)
    with torch.no_grad():
        calibration = dataclasses.replace(calibration, call_s=call_overhead_s(calibration, rounds))
    print(f"# calibration: {calibration.samples} single-op samples, median fit error "
          f"{calibration.median_error:.1%}, call overhead {calibration.call_s * 1e6:.0f} us, "
          f"{time.perf_counter() - started:.1f} s")  # fmt: skip
    print("| model | R | N | L | predicted ms | measured ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    cells = []
    for name in args.models:
        try:
            mine = measure_model(name, calibration, sizes, rounds, args.quick)
        except Exception as error:  # a model that cannot be measured is named, never skipped
            print(f"# {name}: not measured: {type(error).__name__}: {error}")
            continue
        for c in mine:
            length = "-" if c["L"] is None else c["L"]
            print(f"| {name} | {c['R']} | {c['N']} | {length} | {c['predicted_ms']:.3f} "
                  f"| {c['measured_ms']:.3f} | {c['ratio']:.2f} |", flush=True)  # fmt: skip
        cells += mine
    within = sum(abs(c["ratio"] - 1) <= TOLERANCE for c in cells)
    print(
        f"# within {TOLERANCE:.0%}: {within}/{len(cells)} cells "
        f"({within / max(len(cells), 1):.0%}); total {time.perf_counter() - started:.0f} s"
    )
    if args.json is not None:
        payload = {"calibration": json.loads(calibration.to_json()), "cells": cells}
        args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
