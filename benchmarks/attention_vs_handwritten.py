"""Target attention over an encoded history: rocs vs a hand-written per-request rewrite.

The zoo's ``target_attention`` model encodes the user's history with a transformer and lets each
candidate attend over it. A serving engineer would rewrite it by hand: encode each history once,
then group candidates by request so each request's K/V is read once. This script measures the
original model on replicated inputs, that hand-written rewrite, and the model compiled by rocs
(shared layout), side by side in one process, and checks that all three agree.

    python benchmarks/attention_vs_handwritten.py [--candidates 1024] [--requests 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
import torch.nn.functional as F

import rocs_compiler as rocs
from rocs_compiler.timing import median_ms
from models_zoo import ZOO


@torch.no_grad()
def handwritten(model, user_profile, hist_item_ids, item_id, item_cat, candidate_to_request):
    """The model, rewritten by hand for the shared layout (R request rows, N candidate rows)."""
    num_requests = hist_item_ids.shape[0]
    key_mask = hist_item_ids != 0
    h = model.item_table(hist_item_ids) + model.position
    for layer in model.encoder:
        h = layer(h, key_mask)
    heads = model.heads
    target = model.item_table(item_id) + model.cat_table(item_cat)
    dim_head = target.shape[-1] // heads
    k = model.key(h).view(num_requests, -1, heads, dim_head).transpose(1, 2)
    v = model.value(h).view(num_requests, -1, heads, dim_head).transpose(1, 2)
    q = model.query(target).view(-1, heads, dim_head)
    order = torch.argsort(candidate_to_request, stable=True)
    counts = torch.bincount(candidate_to_request, minlength=num_requests).tolist()
    pooled = torch.empty_like(q)
    start = 0
    for r, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start:start + count]
        queries = q.index_select(0, rows).transpose(0, 1).unsqueeze(0)  # [1, H, count, Dh]
        out = F.scaled_dot_product_attention(
            queries, k[r:r + 1], v[r:r + 1], attn_mask=key_mask[r][None, None, None, :]
        )
        pooled.index_copy_(0, rows, out.squeeze(0).transpose(0, 1))
        start += count
    profile = [table(user_profile[:, i]) for i, table in enumerate(model.profile)]
    profile = torch.cat(profile, dim=-1).index_select(0, candidate_to_request)
    features = torch.cat([profile, pooled.reshape(pooled.shape[0], -1), target], dim=-1)
    return model.top(features).squeeze(-1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", type=int, default=1024, help="candidates per request")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    entry = ZOO["target_attention"]
    model = entry.build(0)
    compiled = rocs.compile(model, entry.request_inputs, example_kwargs=entry.make_batch([4, 3]).replicated())
    print(f"| R | N/request | eager ms | hand-written ms | rocs ms | rocs / hand-written | exact |")
    print("|---|---|---|---|---|---|---|")
    for num_requests in args.requests:
        batch = entry.make_batch([args.candidates] * num_requests, seed=1, shuffle=True)
        replicated = batch.replicated()
        idx = batch.candidate_to_request
        with torch.no_grad():
            expected = model(**replicated)
        mine = handwritten(model, **batch.kwargs, candidate_to_request=idx)
        ours = compiled(**batch.kwargs, candidate_to_request=idx)
        exact = torch.allclose(mine, expected, rtol=1e-4, atol=1e-5) and torch.allclose(
            ours, expected, rtol=1e-4, atol=1e-5
        )
        timings = {"eager": [], "hand": [], "rocs": []}
        calls = {
            "eager": lambda: model(**replicated),
            "hand": lambda: handwritten(model, **batch.kwargs, candidate_to_request=idx),
            "rocs": lambda: compiled(**batch.kwargs, candidate_to_request=idx),
        }
        with torch.no_grad():
            for _ in range(3):  # interleave so drift hits all three alike
                for name, fn in calls.items():
                    timings[name].append(median_ms(fn, max(args.repeats // 3, 1)))
        eager, hand, ours_ms = (statistics.median(timings[k]) for k in ("eager", "hand", "rocs"))
        print(
            f"| {num_requests} | {args.candidates} | {eager:.1f} | {hand:.2f} | {ours_ms:.2f} | "
            f"{ours_ms / hand:.2f} | {exact} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
