"""Training steps of a history encoder with attention dropout: eager vs rocs, per variant.

The model: a 2-layer ``nn.TransformerEncoder`` (d_model 64, 4 heads, FFN 128) over 50 history
items, mean-pooled and scored against the candidate by an MLP; R requests x k impressions. With
dropout 0.1 (torch's default) the attention dropout draws per impression, so in the default mode
the encoder after the first layer's q/k/v projection runs per impression;
``request_dropout="per_request"`` draws one mask per request and shares the whole encoder (a change
of the model). Dropout 0 is the reference for what sharing gives.

Each round runs every variant for ``--block`` steps (forward, backward, SGD step with lr 0), in a
fresh random order, the first step of a block not counted; the time is the median of the counted
steps, by the thread's CPU time with one torch thread. Run:
``OMP_NUM_THREADS=1 python benchmarks/attention_dropout_training.py``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings

import torch
from torch import nn

import rocs_compiler as rocs

D, L = 64, 50


class HistoryRanker(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=dropout, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.item = nn.Linear(D, D)
        self.head = nn.Sequential(nn.Linear(2 * D, D), nn.ReLU(), nn.Linear(D, 1))

    def forward(self, hist, item):
        return self.head(torch.cat([self.enc(hist).mean(1), self.item(item)], -1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    r, k = args.requests, args.k
    idx = torch.arange(r).repeat_interleave(k)
    hist, item = torch.randn(r, L, D), torch.randn(r * k, D)
    variants = {}
    for p in (0.1, 0.0):
        torch.manual_seed(0)
        model = HistoryRanker(p).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        example = dict(hist=hist[idx[: 4 * 2]], item=item[: 4 * 2])
        variants[f"eager p={p}"] = (model, opt, lambda m=model: m(hist[idx], item))
        modes = {"rocs": {}}
        if p:
            modes["rocs per_request"] = {"request_dropout": "per_request"}
        for label, extra in modes.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cm = rocs.compile(
                    model, ["hist"], example_kwargs=example, training=True,
                    options={"autotune": False, **extra},
                )  # fmt: skip
            variants[f"{label} p={p}"] = (
                model, opt, lambda cm=cm: cm(hist=hist, item=item, candidate_to_request=idx)
            )
    times: dict[str, list[float]] = {name: [] for name in variants}
    clock = time.thread_time
    for _ in range(args.repeats):
        order = list(variants)
        random.shuffle(order)
        for name in order:
            model, opt, call = variants[name]
            for step in range(args.block):
                start = clock()
                opt.zero_grad(set_to_none=True)
                call().square().mean().backward()
                opt.step()
                if step:
                    times[name].append(clock() - start)
    base = {p: statistics.median(times[f"eager p={p}"]) for p in (0.1, 0.0)}
    print(f"R={r} k={k} L={L} d={D}, median ms per step (thread CPU time)")
    print("| variant | ms | speedup vs eager (same dropout) |")
    print("|---|---|---|")
    for name, t in times.items():
        p = float(name.split("p=")[1])
        ms = statistics.median(t) * 1e3
        print(f"| {name} | {ms:.1f} | {base[p] * 1e3 / ms:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
