"""The ``torch.compile(model, backend="rocs")`` door against eager, Inductor and ``rocs.compile``.

Two tables, each timed in one process with one torch thread, the variants of a row run
round-robin (``regression.time_interleaved``: each round starts from another variant, the
thread's CPU time as the clock, the median over ``--rounds``), under ``torch.no_grad()``, drop-in
calls (the model's own call with replicated request rows):

1. **Transformer ranker** (``models_zoo.user_models.HistoryTransformerRanker``: an
   ``nn.TransformerEncoder`` over the user's history with a padding mask, and the candidate's
   target attention over it), at R requests x N candidates per request:

   - ``eager``: ``model(**replicated)`` (torch's fused fast paths, as a user runs it);
   - ``inductor``: ``torch.compile(model, dynamic=True)``;
   - ``backend``: ``torch.compile(model, backend="rocs", options={...}, dynamic=True)``
     (each ``torch.compile`` wraps a function of its own calling the model, so that the two
     do not share dynamo's cache of compiled frames);
   - ``rocs.compile``: ``rocs.compile(model, ["history"], example_kwargs=...)``.

2. **Nothing to share** (``no_share`` and ``mixed_norm`` of ``regression_models.py``: request
   features meet candidate features before any request-only work): ``inductor`` against
   ``backend``, whose graph then runs as Inductor's, and the difference per call in us.

Outputs are compared with eager before timing (``allclose``, 1e-4). Usage::

    python benchmarks/backend_door.py
    python benchmarks/backend_door.py --rounds 31 --sample-ms 100
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

import rocs_compiler as rocs
from allocator import retain_freed_memory
from models_zoo.user_models import HistoryTransformerRanker
from regression import time_interleaved
from regression_models import MODELS, make_inputs

CELLS = ((1, 1000), (8, 100))
SMALL_CELLS = ((1, 16), (4, 64))
HISTORY, ITEMS = 50, 10_000


def _own_frame(model, names: list[str], tag: str) -> torch.nn.Module:
    """A module calling ``model(*names)`` whose ``forward`` is a code object of its own: dynamo
    keeps its compiled entries per code object, and two ``torch.compile`` wrappers of one model
    would share one cache, each call checking the other backend's guards first. A module, as
    users compile one: ``torch.compile`` of it is an optimized module (which
    ``rocs.shared_call`` calls through its compiled frame, ``backend/user_frame.py``)."""
    source = f"def forward(self, {', '.join(names)}):\n    return self.model({', '.join(names)})\n"
    namespace: dict = {}
    exec(compile(source, f"<{tag}>", "exec"), namespace)
    cls = type(f"OwnFrame_{abs(hash(tag))}", (torch.nn.Module,), {"forward": namespace["forward"]})
    module = cls()
    module.model = model
    return module


def _ranker_batch(requests: int, per_request: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(1, ITEMS, (requests, HISTORY), generator=g)
    lengths = torch.randint(HISTORY // 2, HISTORY + 1, (requests,), generator=g)
    history[torch.arange(HISTORY)[None] >= lengths[:, None]] = 0  # padding at the end
    index = torch.arange(requests).repeat_interleave(per_request)
    item = torch.randint(1, ITEMS, (index.numel(),), generator=g)
    return {"history": history[index], "item": item}


def _check(reference, output, label: str) -> None:
    if not torch.allclose(reference, output, rtol=1e-4, atol=1e-4):
        print(f"  ! {label}: differs from eager by {(reference - output).abs().max().item():.3g}")


def _warm(calls: dict, reference, label: str, count: int = 24) -> None:
    for name, call in calls.items():
        for _ in range(count):  # dynamo's retrace and the program choice settle here
            out = call()
        if name != "eager":
            _check(reference, out, f"{label} {name}")


def transformer_rows(args, clock) -> None:
    print("| R x N/R | eager ms | inductor | backend | rocs.compile |")
    print("|---|---:|---:|---:|---:|")
    torch.manual_seed(0)
    model = HistoryTransformerRanker(
        num_items=ITEMS, dim=64, heads=4, ffn=128, layers=2, history_length=HISTORY
    ).eval()
    options = {"request_inputs": ["history"]}
    names = ["history", "item"]
    backend = torch.compile(
        _own_frame(model, names, "backend"), backend="rocs", options=options, dynamic=True
    )
    inductor = torch.compile(_own_frame(model, names, "inductor"), dynamic=True)
    cm = rocs.compile(model, ["history"], example_kwargs=_ranker_batch(2, 4))
    for requests, per_request in CELLS:
        batch = _ranker_batch(requests, per_request, seed=1)
        calls = {
            "eager": lambda: model(**batch),
            "inductor": lambda: inductor(**batch),
            "backend": lambda: backend(**batch),
            "rocs.compile": lambda: cm(**batch),
        }
        _warm(calls, model(**batch), f"{requests}x{per_request}")
        times = time_interleaved(calls, args.rounds, args.sample_ms / 1e3, clock)
        eager = times["eager"]
        speedups = " | ".join(f"{eager / times[n]:.2f}x" for n in list(calls)[1:])
        print(f"| {requests} x {per_request} | {eager * 1e3:.2f} | {speedups} |")


def nothing_to_share_rows(args, clock) -> None:
    print()
    print(
        "| model | R x N/R | inductor us | backend us | backend - inductor us "
        "| inductor / backend |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for name in ("no_share", "mixed_norm"):
        make, inputs = MODELS[name]
        torch.manual_seed(0)
        model = make().eval()
        requests = [n for n in inputs if n.startswith("u")]
        options = {"request_inputs": requests}
        torch._dynamo.reset()
        names = list(inputs)
        inductor = torch.compile(_own_frame(model, names, "inductor"), dynamic=True)
        backend = torch.compile(
            _own_frame(model, names, "backend"), backend="rocs", options=options, dynamic=True
        )
        for num_requests, per_request in SMALL_CELLS:
            g = torch.Generator().manual_seed(1)
            kwargs = make_inputs(inputs, num_requests, num_requests * per_request, g)
            index = torch.arange(num_requests).repeat_interleave(per_request)
            batch = {k: v[index] if k in requests else v for k, v in kwargs.items()}
            calls = {"inductor": lambda: inductor(**batch), "backend": lambda: backend(**batch)}
            _warm(calls, model(**batch), f"{name} {num_requests}x{per_request}")
            times = time_interleaved(calls, args.rounds, args.sample_ms / 1e3, clock)
            a, b = times["inductor"] * 1e6, times["backend"] * 1e6
            cell = f"{num_requests} x {per_request}"
            print(f"| {name} | {cell} | {a:.1f} | {b:.1f} | {b - a:+.1f} | {a / b:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--sample-ms", type=float, default=50.0)
    parser.add_argument("--only", choices=("transformer", "nothing"), default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    retain_freed_memory()
    warnings.simplefilter("ignore")
    clock = time.thread_time
    with torch.no_grad():
        if args.only in (None, "transformer"):
            transformer_rows(args, clock)
        if args.only in (None, "nothing"):
            nothing_to_share_rows(args, clock)


if __name__ == "__main__":
    main()
