"""Shared test helpers for the IKBO ops: index strategies and random inputs.

``candidate_to_request`` batches are drawn the way serving produces them and the way they
break kernels: R = 1, ragged counts, requests with one candidate or none, equal counts
(the grouped fast path), sorted or shuffled order.
"""

from __future__ import annotations

import torch

try:  # the Triton cases also run on machines without hypothesis
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    st = None


def make_index(counts: list[int], perm_seed: int | None = None) -> torch.Tensor:
    """int64 [N] index with ``counts[r]`` candidates for request r, optionally shuffled."""
    idx = torch.repeat_interleave(
        torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64)
    )
    if perm_seed is not None:
        gen = torch.Generator().manual_seed(perm_seed)
        idx = idx[torch.randperm(idx.shape[0], generator=gen)]
    return idx


def _candidate_index(draw, max_requests: int = 5, max_per_request: int = 6):
    """Draw ``(R, idx)`` covering the shapes listed in the module docstring."""
    num_requests = draw(st.integers(1, max_requests))
    if draw(st.booleans()):
        counts = [draw(st.integers(1, max_per_request))] * num_requests
    else:
        counts = draw(
            st.lists(st.integers(0, max_per_request), min_size=num_requests, max_size=num_requests)
        )
    if sum(counts) == 0:
        counts[0] = 1
    shuffle = draw(st.booleans())
    perm_seed = draw(st.integers(0, 2**16)) if shuffle else None
    return num_requests, make_index(counts, perm_seed)


candidate_index = st.composite(_candidate_index) if st is not None else None


def randn(*shape, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


def random_mask(num_requests: int, length: int, seed: int, fully_masked: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(num_requests, length, generator=gen) > 0.3
    if fully_masked is not None:
        mask[fully_masked] = False
    return mask


# -- autograd cases: every op, small shapes, inputs requiring grad -------------------------------


AUTOGRAD_INDEXES = {
    "ragged_shuffled": (4, make_index([1, 3, 0, 5], perm_seed=3)),
    "one_request": (1, make_index([4])),
    "each_its_own": (5, make_index([1, 1, 1, 1, 1], perm_seed=1)),
    "equal_contiguous": (3, make_index([2, 2, 2])),
}


def autograd_cases(index_name: str, dtype=torch.float64) -> list:
    """(op name, args) of every ``rocs::`` op with small inputs of ``dtype`` requiring grad,
    at the index layout ``AUTOGRAD_INDEXES[index_name]``."""
    r, idx = AUTOGRAD_INDEXES[index_name]
    DT = dtype  # noqa: N806

    def _leaf(*shape, seed):
        return randn(*shape, seed=seed, dtype=dtype).requires_grad_()

    n = idx.shape[0]
    mask = torch.ones(r, 4, dtype=torch.bool)
    mask[:, 3] = False
    bias = torch.zeros(r, 2, 1, 4, dtype=DT)
    bias[:, :, :, 0] = -float("inf")
    bias = bias.requires_grad_()
    fully_masked = mask.clone()
    fully_masked[0] = False
    weights = torch.randn(4, 3, dtype=DT, generator=torch.Generator().manual_seed(2))
    right_padded = torch.arange(4) >= torch.tensor([4, 2, 0, 3, 1])[:r].unsqueeze(1)
    holed = right_padded.clone()
    holed[-1, 0] = True  # the last request is padded on the left: nothing nests
    return [
        (
            "broadcast_linear",
            (_leaf(n, 3, seed=1), _leaf(2, 3, seed=2), _leaf(2, seed=3), _leaf(r, 2, seed=4), idx),
        ),
        (
            "broadcast_linear",
            (_leaf(n, 3, seed=1), _leaf(2, 3, seed=2), None, _leaf(r, 2, seed=4), idx),
        ),
        (
            "broadcast_linear_compression",
            (_leaf(n, 3, 2, seed=5), _leaf(2, 3, seed=6), _leaf(r, 2, 2, seed=7), idx),
        ),
        (
            "broadcast_linear_compression",
            (_leaf(n, 3, 1, seed=5), _leaf(2, 3, seed=6), _leaf(r, 2, 1, seed=7), idx),
        ),
        (
            "broadcast_attention",
            (_leaf(n, 2, 2, 3, seed=8), _leaf(r, 2, 4, 3, seed=9), _leaf(r, 2, 4, 3, seed=10), idx),
        ),
        (
            "broadcast_attention",
            (
                _leaf(n, 2, 1, 3, seed=8),
                _leaf(r, 2, 4, 3, seed=9),
                _leaf(r, 2, 4, 3, seed=10),
                idx,
                mask,
                0.7,
            ),
        ),
        (
            "broadcast_attention",
            (
                _leaf(n, 2, 1, 3, seed=8),
                _leaf(r, 2, 4, 3, seed=9),
                _leaf(r, 2, 4, 3, seed=10),
                idx,
                None,
                None,
                bias,
            ),
        ),
        (
            "broadcast_attention",  # request 0 attends to nothing: zero output, zero gradient
            (
                _leaf(n, 2, 2, 3, seed=8),
                _leaf(r, 2, 4, 3, seed=9),
                _leaf(r, 2, 4, 3, seed=10),
                idx,
                fully_masked,
            ),
        ),
        (
            "broadcast_attention",  # only the candidate side wants a gradient
            (
                _leaf(n, 2, 2, 3, seed=8),
                randn(r, 2, 4, 3, seed=9, dtype=DT),
                randn(r, 2, 4, 3, seed=10, dtype=DT),
                idx,
            ),
        ),
        ("broadcast_interaction", (_leaf(r, 3, 4, seed=11), _leaf(n, 2, 4, seed=12), idx)),
        (
            "broadcast_interaction",
            (_leaf(r, 3, 4, seed=11), randn(n, 2, 4, seed=12, dtype=DT), idx),
        ),
        (
            "broadcast_interaction",
            (randn(r, 3, 4, seed=11, dtype=DT), _leaf(n, 2, 4, seed=12), idx),
        ),
        (
            "broadcast_pointwise",
            (
                "mul(sigmoid(add(c0, r0)), r1)",
                [_leaf(n, 3, seed=13)],
                [_leaf(r, 3, seed=14), _leaf(r, 3, seed=15)],
                idx,
            ),
        ),
        (
            "broadcast_pointwise",
            (
                "where(c0, r0, tanh(c1))",
                [torch.randint(0, 2, (n, 3)).to(DT), _leaf(n, 3, seed=16)],
                [_leaf(r, 3, seed=17)],
                idx,
            ),
        ),
        ("broadcast_pointwise", ("relu(r0)", [], [_leaf(r, 3, seed=18)], idx)),
        (
            "embedding_bag_rows",
            (weights.requires_grad_(), torch.tensor([[0, 1], [2, 2], [3, 0]]), 1, None),
        ),
        (
            "embedding_bag_rows",
            (weights.clone().requires_grad_(), torch.tensor([[0, 1], [2, 2], [3, 0]]), 0, 0),
        ),
        (  # mean over non-padding entries; an all-padding row is zero
            "embedding_bag_rows",
            (weights.clone().requires_grad_(), torch.tensor([[0, 1], [2, 2], [3, 3]]), 1, 3),
        ),
        (  # a negative padding_idx counts from the end, as in aten
            "embedding_bag_rows",
            (weights.clone().requires_grad_(), torch.tensor([[0, 3], [2, 1], [3, 0]]), 0, -1),
        ),
        (
            "embedding_bag_rows",
            (weights.clone().requires_grad_(), torch.tensor([[0, 1], [2, 2], [3, 0]]), 2, None),
        ),
        ("nested_padding", (_leaf(r, 4, 3, seed=19), right_padded, idx)),
        ("nested_padding", (_leaf(r, 4, 3, seed=19), holed, idx)),
        ("nested_padding", (_leaf(r, 4, 3, seed=19), right_padded)),
    ]


def differentiable_leaves(args) -> list:
    """The tensors of ``args`` (lists flattened) that require grad."""
    out = []
    for a in args:
        items = a if isinstance(a, list) else [a]
        out += [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]
    return out
