"""Embedding bags in ONNX Runtime: the exporter's ``Loop`` over the bags against the bags
``rocs.export_onnx`` writes (``rocs_compiler/export/onnx_bags.py``: bags of 2-D ids, as all three
here, a gather and a reduction over the bag's size; others a gather and a scatter-add).

A ranker with three bags (a request's user ids summed, its padded history averaged, each
candidate's tags max-pooled) is compiled, exported portable, and written to ONNX twice: as the
exporter translates the bags, and with the rewrite. Both sessions (one intra-op thread) and the
eager model are timed interleaved, medians of ``--rounds``, after checking that all three agree.
The same portable program compiled with AOTInductor (``rocs.aoti_package``, loaded in this
process) is timed beside them: the issue's bar is the rewritten ONNX program within 1.5x of it.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/onnx_bags.py
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import tempfile
import time

import numpy as np
import torch
from torch import nn
from torch.fx import _pytree as fx_pytree

import rocs_compiler as rocs

onnx_export = importlib.import_module("rocs_compiler.export.onnx")


class BagRanker(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.user = nn.EmbeddingBag(5000, 32, mode="sum")
        self.history = nn.EmbeddingBag(5000, 32, mode="mean", padding_idx=0)
        self.tags = nn.EmbeddingBag(2000, 32, mode="max")
        self.mlp = nn.Sequential(nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, user_ids, history, tags):
        u = self.user(user_ids) + self.history(history)
        return self.mlp(torch.cat([u, self.history(history), self.tags(tags)], 1))


def batch(counts: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    requests = len(counts)
    index = torch.repeat_interleave(torch.arange(requests), torch.tensor(counts))
    history = torch.randint(1, 5000, (requests, 50), generator=g)
    history[:, 40:] = 0
    kwargs = {
        "user_ids": torch.randint(0, 5000, (requests, 4), generator=g),
        "history": history,
        "tags": torch.randint(0, 2000, (index.shape[0], 5), generator=g),
    }
    return kwargs, index


def replicated(kwargs: dict, index: torch.Tensor) -> dict:
    return {k: (v if k == "tags" else v[index]) for k, v in kwargs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import onnxruntime as ort

    model = BagRanker().eval()
    example, index = batch([3, 1, 5], seed=0)
    cm = rocs.compile(model, ["user_ids", "history"], example_kwargs=replicated(example, index))
    program = rocs.export(cm, portable=True)
    folder = tempfile.mkdtemp()
    rewrite = onnx_export.with_gathered_bags
    sessions = {}
    for name, bags in (("Loop", lambda p: p), ("gather", rewrite)):
        onnx_export.with_gathered_bags = bags
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        path = rocs.export_onnx(program, os.path.join(folder, f"{name}.onnx"))
        sessions[name] = ort.InferenceSession(path, options)
    onnx_export.with_gathered_bags = rewrite
    aoti = torch._inductor.aoti_load_package(
        rocs.aoti_package(program, os.path.join(folder, "bags.pt2"))
    )
    print("| R x N | eager ms | ORT, exporter's Loop ms | ORT, rocs bags ms "
          "| Loop / rocs | AOTInductor ms | rocs / AOTInductor |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for requests, candidates in ((1, 270), (4, 1024)):
        kwargs, index = batch([candidates // requests] * requests, seed=7)
        flat = fx_pytree.tree_flatten_spec(
            ((), {**kwargs, "candidate_to_request": index}), program.call_spec.in_spec
        )
        feeds = {
            name: {i.name: t.numpy() for i, t in zip(s.get_inputs(), flat)}
            for name, s in sessions.items()
        }
        eager_inputs = replicated(kwargs, index)
        times = {name: [] for name in ("eager", *sessions, "aoti")}
        shared = {**kwargs, "candidate_to_request": index}
        with torch.no_grad():
            want = model(**eager_inputs).numpy()
            for _ in range(args.rounds):
                start = time.perf_counter()
                model(**eager_inputs)
                times["eager"].append(time.perf_counter() - start)
                for name, session in sessions.items():
                    start = time.perf_counter()
                    got = session.run(None, feeds[name])[0]
                    times[name].append(time.perf_counter() - start)
                    assert np.allclose(got, want, rtol=1e-4, atol=1e-5), name
                start = time.perf_counter()
                got = aoti(**shared)
                times["aoti"].append(time.perf_counter() - start)
                assert np.allclose(got.numpy(), want, rtol=1e-4, atol=1e-5), "aoti"
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"| {requests} x {candidates} | {ms['eager']:.2f} | {ms['Loop']:.2f} | "
              f"{ms['gather']:.2f} | {ms['Loop'] / ms['gather']:.1f}x | {ms['aoti']:.2f} "
              f"| {ms['gather'] / ms['aoti']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
