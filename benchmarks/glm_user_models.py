"""``apply_glm`` / ``apply_dca`` on models written by a user (not zoo classes): exactness, speed.

For each model: ``rocs.apply_glm(model, request_inputs, request_fraction=0.5)`` (the Ranker, the
DIN-like model) or ``rocs.apply_dca(model, request_inputs, example_kwargs=...)`` (the BST-like
``nn.TransformerEncoder`` model), a few Adam steps on random data, then ``rocs.compile``; the
compiled model is checked against eager on a ragged shared-layout batch, and timed for one
request with N candidates against the eager model on replicated inputs (median of interleaved
calls, one torch thread).

Usage::

    python benchmarks/glm_user_models.py --candidates 1000 --repeats 31
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch
from torch import nn

import rocs_compiler as rocs
from models_zoo.user_models import BSTLike, DINLike, Ranker

# BST-like sizes: the MovieLens quality benchmark's (20 history tokens, 3 candidate tokens, D 16)
BST_VOCABS, BST_ITEMS, BST_ITEM_VOCABS = (944, 8, 3, 22), 1683, (18,)
BST_MULTIHOT, BST_LENGTH = 19, 20


def ranker_inputs(requests: int, candidates: int) -> tuple[dict, dict]:
    return {"user_feats": torch.randn(requests, 128)}, {"item_feats": torch.randn(candidates, 32)}


def din_inputs(requests: int, candidates: int) -> tuple[dict, dict]:
    request = {
        "user_id": torch.randint(0, 1000, (requests,)),
        "history": torch.randint(0, 5000, (requests, 20)),
    }
    return request, {"item_id": torch.randint(0, 5000, (candidates,))}


def bst_inputs(requests: int, candidates: int) -> tuple[dict, dict]:
    history = torch.randint(1, BST_ITEMS, (requests, BST_LENGTH))
    history[-1, BST_LENGTH // 2 :] = 0  # a short history
    request = {
        "user_sparse": torch.stack([torch.randint(1, v, (requests,)) for v in BST_VOCABS], 1),
        "history": history,
    }
    item = [torch.randint(1, v, (candidates,)) for v in (BST_ITEMS, *BST_ITEM_VOCABS)]
    multihot = (torch.rand(candidates, BST_MULTIHOT) < 0.2).float()
    return request, {"item_sparse": torch.stack(item, 1), "item_multihot": multihot}


def bst_like() -> BSTLike:
    return BSTLike(BST_VOCABS, BST_ITEMS, BST_ITEM_VOCABS, BST_MULTIHOT, BST_LENGTH)


# name -> (model factory, input maker, transform)
MODELS = {
    "ranker": (Ranker, ranker_inputs, "glm"),
    "din_like": (DINLike, din_inputs, "glm"),
    "bst_like": (bst_like, bst_inputs, "dca"),
}


def replicate(request: dict, candidate: dict, index: torch.Tensor) -> dict:
    return {**{k: v[index] for k, v in request.items()}, **candidate}


def prepare(name: str, steps: int = 5, seed: int = 0):
    """(eager GLM model, compiled model, request input names) after ``steps`` training steps."""
    torch.manual_seed(seed)
    cls, make, transform = MODELS[name]
    request, candidate = make(2, 3)
    example = replicate(request, candidate, torch.tensor([0, 0, 1]))
    request_names = list(request)
    if transform == "dca":
        glm = rocs.apply_dca(cls(), request_names, example_kwargs=example)
    else:
        glm = rocs.apply_glm(cls(), request_names, request_fraction=0.5, example_kwargs=example)
    optimizer = torch.optim.Adam(glm.parameters(), 1e-3)
    for _ in range(steps):
        request, candidate = make(16, 16)
        out = glm(**replicate(request, candidate, torch.arange(16)))
        loss = nn.functional.binary_cross_entropy_with_logits(out, torch.rand_like(out))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    glm.eval()
    return glm, rocs.compile(glm, request_names, example_kwargs=example), make


def median_times(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call; calls interleaved round-robin after one warm-up each."""
    samples = {name: [] for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn()
        for k in range(repeats):
            names = list(fns)[k % len(fns):] + list(fns)[: k % len(fns)]
            for name in names:
                start = time.perf_counter()
                fns[name]()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def measure(name: str, candidates: int, repeats: int) -> dict:
    model, cm, make = prepare(name)
    with torch.no_grad():
        request, candidate = make(3, 7)  # ragged: 2, 4 and 1 candidates, unordered
        index = torch.tensor([1, 0, 1, 1, 2, 0, 1])
        err = float((cm(**request, **candidate, candidate_to_request=index)
                     - model(**replicate(request, candidate, index))).abs().max())
        request, candidate = make(1, candidates)
        index = torch.zeros(candidates, dtype=torch.int64)
        replicated = replicate(request, candidate, index)
    times = median_times(
        {
            "eager": functools.partial(model, **replicated),
            "rocs": functools.partial(cm, **request, **candidate, candidate_to_request=index),
        },
        repeats,
    )
    report = cm.report(candidates=candidates)
    return {
        "model": name,
        "ragged_max_abs_err": err,
        "eager_ms": times["eager"] * 1e3,
        "rocs_ms": times["rocs"] * 1e3,
        "speedup": times["eager"] / times["rocs"],
        "ideal": report.ideal_speedup(candidates, 1),
        "report": str(getattr(model, "rocs_glm_report", None) or model.rocs_dca_report),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| model | N | R | eager ms | rocs ms | speedup | ideal | ragged max abs err |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        r = measure(name, args.candidates, args.repeats)
        print(
            f"| {name} | {args.candidates} | 1 | {r['eager_ms']:.2f} | {r['rocs_ms']:.2f} | "
            f"{r['speedup']:.1f}x | {r['ideal']:.1f}x | {r['ragged_max_abs_err']:.1e} |",
            flush=True,
        )
        print(r["report"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
