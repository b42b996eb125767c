"""Models from other libraries, compiled as users write them: eager vs rocs.

    python benchmarks/ecosystem.py [--requests 4] [--candidates 512] [--repeats 15]
                                   [--libraries deepctr torchrec]

DeepCTR-Torch models (``models_zoo/deepctr_models.py``: DeepFM, WDL, DCN, DIN, MMOE) with the
user's features named as column ranges of the packed input ``X``, and TorchRec models
(``models_zoo/torchrec_models.py``: DLRM, DLRM_DCN, DLRM_Projection, transformer DLRM,
SimpleDeepFMNN) with the user's keys of the ``KeyedJaggedTensor`` named, at ``--requests``
requests x ``--candidates`` candidates each, one torch thread. Eager runs the model on the
replicated rows (how both libraries' models are called); rocs runs in the drop-in layout (the
same call) and with ``candidate_to_request`` given (for TorchRec, the KJT with the user's keys at
one row per request). TorchRec's own shared layout (the same KJT, expanded by its inverse
indices inside ``EmbeddingBagCollection``) is timed too. Medians of interleaved repeats, in one
process; prints Markdown tables and checks that every output matches eager.
"""

from __future__ import annotations

import argparse
import warnings

import torch

import rocs_compiler as rocs
from rocs_compiler.timing import interleaved_medians


def _close(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return all(_close(x, y) for x, y in zip(a, b))
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def measure(name: str, requests: int, candidates: int, repeats: int) -> str:
    from models_zoo.deepctr_models import build, draw, request_ranges

    model, user, _ = build(name)
    example, _ = draw(model, user, [2, 1, 3], seed=0)
    compiled = rocs.compile(model, request_ranges(model, user), example_kwargs={"X": example})
    x, index = draw(model, user, [candidates] * requests, seed=1)
    calls = {
        "eager": lambda: model(x),
        "drop-in": lambda: compiled(X=x),
        "indexed": lambda: compiled(X=x, candidate_to_request=index),
    }
    with torch.no_grad():
        results = {k: fn() for k, fn in calls.items()}
        exact = all(_close(results[k], results["eager"]) for k in ("drop-in", "indexed"))
        medians = interleaved_medians(calls, repeats)
    eager, dropin, indexed = (medians[k] for k in calls)
    report = compiled.report(candidates=candidates, requests=requests)
    return (
        f"| {name} | {eager:.2f} | {dropin:.2f} | {indexed:.2f} | {eager / dropin:.2f}x | "
        f"{eager / indexed:.2f}x | {report.ideal_speedup():.2f}x | {exact} |"
    )


def measure_torchrec(name: str, requests: int, candidates: int, repeats: int) -> str:
    from models_zoo import torchrec_models as zoo

    model, request, _ = zoo.build(name)
    example = zoo.draw([2, 1, 3], seed=0)
    compiled = rocs.compile(model, request, example_inputs=(example.dense, example.kjt))
    batch = zoo.draw([candidates] * requests, seed=1)
    calls = {
        "eager": lambda: model(batch.dense, batch.kjt),
        "eager shared": lambda: model(batch.dense, batch.shared),
        "drop-in": lambda: compiled(batch.dense, batch.kjt),
        "indexed": lambda: compiled(batch.dense, batch.shared, candidate_to_request=batch.index),
    }
    with torch.no_grad():
        results = {k: fn() for k, fn in calls.items()}
        exact = all(_close(results[k], results["eager"]) for k in calls)
        medians = interleaved_medians(calls, repeats)
    eager, eager_shared, dropin, indexed = (medians[k] for k in calls)
    report = compiled.report(candidates=candidates, requests=requests)
    return (
        f"| {name} | {eager:.2f} | {eager_shared:.2f} | {dropin:.2f} | {indexed:.2f} | "
        f"{eager / dropin:.2f}x | {eager / indexed:.2f}x | {report.ideal_speedup():.2f}x | "
        f"{exact} |"
    )


def _chosen(models, library_models):
    """The named models of one library (every one when none is named)."""
    return library_models if models is None else [m for m in models if m in library_models]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--candidates", type=int, default=512, help="candidates per request")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--models", nargs="*", default=None,
                        help="default: every model of each library")  # fmt: skip
    parser.add_argument("--libraries", nargs="*", default=["deepctr", "torchrec"])
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    shape = f"{args.requests} requests x {args.candidates} candidates, one thread; ms (medians)"
    if "deepctr" in args.libraries:
        from models_zoo.deepctr_models import MODELS

        _table(f"DeepCTR-Torch, {shape}", ["rocs drop-in", "rocs indexed"])
        for name in _chosen(args.models, MODELS):
            print(measure(name, args.requests, args.candidates, args.repeats), flush=True)
    if "torchrec" in args.libraries:
        from models_zoo.torchrec_models import MODELS

        variants = ["eager, TorchRec shared KJT", "rocs drop-in", "rocs indexed"]
        _table(f"\nTorchRec, {shape}", variants)
        for name in _chosen(args.models, MODELS):
            print(measure_torchrec(name, args.requests, args.candidates, args.repeats), flush=True)
    return 0



def _table(title: str, variants: list[str]) -> None:
    """Print ``title`` and the head of a table: model, eager, ``variants``, ratios, exactness."""
    columns = ["model", "eager", *variants, "drop-in vs eager", "indexed vs eager",
               "ideal (FLOPs)", "exact"]  # fmt: skip
    print(f"{title}\n")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


if __name__ == "__main__":
    raise SystemExit(main())
