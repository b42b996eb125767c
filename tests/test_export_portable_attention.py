"""Attention in portable programs (``kernels/attention_portable.py``): each request's keys and
values are read per request, never gathered to one copy per candidate, and the program is exact
against the original model on ragged batches (requests with no candidate, shuffled order, a
request that spills beyond ``ceil(N / R)`` candidates and batches where none does), in Python
and, compiled with AOTInductor, through its runtime.

The oracle is the original model on the replicated batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import rocs_compiler as rocs
from models_zoo import get_entry
from models_zoo.target_attention import HIST_LEN
from rocs_compiler.export import rocs_ops_in, symbolic_signature

# (counts, shuffle): a request without candidates and one that spills; equal counts; R = 1; one
# candidate each; ragged without a spill
BATCHES = [([4, 0, 9, 1], True), ([3, 3, 3], True), ([6], False), ([1, 1, 1, 1, 1], True),
           ([2, 0, 2, 1], True)]  # fmt: skip
TOL = dict(rtol=1e-5, atol=1e-5)
GATHERS = {"index_select", "index", "gather"}


def _compiled(model, request_inputs, example):
    cm = rocs.compile(model, request_inputs, example_kwargs=example)
    assert any("broadcast_attention" in op for op in rocs_ops_in(rocs.export(cm))), (
        "the compiled graph attends through rocs::broadcast_attention"
    )
    return cm


def _target_attention():
    entry = get_entry("target_attention")
    model = entry.build()
    cm = _compiled(model, list(entry.request_inputs), entry.make_batch([3, 1, 5]).replicated())
    return entry, model, cm


def key_value_reads(program: torch.export.ExportedProgram, key_shape: tuple) -> list[str]:
    """The rows (as a size expression) of every gather, in the program's graph and in its branches,
    whose source has the shape of the requests' keys or values, ``[rows, *key_shape]``."""
    reads = []
    for module in program.graph_module.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function" or getattr(node.target, "_opname", None) not in GATHERS:
                continue
            source = node.args[0].meta["val"]
            if tuple(source.shape[1:]) == key_shape:
                reads.append(str(node.meta["val"].shape[0]))
    return reads


def test_a_portable_attention_reads_each_requests_keys_and_values_per_request():
    """The zoo's target attention: keys and values ``[R, H, L, D]`` are never gathered to N rows
    (the reference would, ``k[idx]``); they are read in place, and only the tiles of a request
    that spills beyond ``ceil(N / R)`` candidates gather them, at R rows, once for k and once
    for v."""
    entry, model, cm = _target_attention()
    program = rocs.export(cm, portable=True)
    signature = symbolic_signature(program)
    requests = signature["hist_item_ids"]["shape"][0]
    candidates = signature["item_id"]["shape"][0]
    assert requests != candidates
    key_shape = (model.heads, HIST_LEN, model.query.out_features // model.heads)
    reads = key_value_reads(program, key_shape)
    assert candidates not in reads, f"keys or values gathered to one row per candidate: {reads}"
    assert reads == [requests, requests]


def _check(program_call, model, batch, what):
    kwargs = {**batch.kwargs, "candidate_to_request": batch.candidate_to_request}
    with torch.no_grad():
        got, want = program_call(**kwargs), model(**batch.replicated())
    torch.testing.assert_close(got, want, **TOL, msg=what)
    spread = (want - want[0]).abs().max()
    assert spread > 100 * TOL["atol"], f"{what}: rows differ by {spread} only"


def test_a_portable_target_attention_is_exact_on_ragged_batches():
    entry, model, cm = _target_attention()
    run = rocs.export(cm, portable=True).module()
    for i, (counts, shuffle) in enumerate(BATCHES):
        _check(run, model, entry.make_batch(counts, seed=60 + i, shuffle=shuffle), str(counts))


class CandidateAttention(nn.Module):
    """Two queries per candidate attend over its request's history, padded keys masked; the
    attention is the output, so a wrong row shows at full scale."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.key, self.value = nn.Linear(8, 16), nn.Linear(8, 16)
        self.query = nn.Linear(4, 32)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=generator)

    def forward(self, history, lengths, item):
        rows, length, _ = history.shape
        keys = self.key(history).view(rows, length, 2, 8).transpose(1, 2)
        values = self.value(history).view(rows, length, 2, 8).transpose(1, 2)
        queries = self.query(item).view(rows, 2, 2, 8)  # [B, H, Lq, D]
        seen = torch.arange(length) < lengths[:, None]
        mask = seen[:, None, None, :]
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask).flatten(1)


class _Batch:
    def __init__(self, counts, seed, shuffle):
        generator = torch.Generator().manual_seed(seed)
        num_requests = len(counts)
        index = torch.repeat_interleave(torch.arange(num_requests), torch.tensor(counts))
        if shuffle:
            index = index[torch.randperm(index.shape[0], generator=generator)]
        lengths = torch.randint(2, 7, (num_requests,), generator=generator)
        if num_requests > 1:  # the last request has no history: its candidates see no key
            lengths[-1] = 0
        self.kwargs = {
            "history": torch.randn(num_requests, 6, 8, generator=generator),
            "lengths": lengths,
            "item": torch.randn(index.shape[0], 4, generator=generator),
        }
        self.candidate_to_request = index

    def replicated(self):
        index = self.candidate_to_request
        return {**self.kwargs, "history": self.kwargs["history"][index],
                "lengths": self.kwargs["lengths"][index]}  # fmt: skip


def candidate_attention():
    model = CandidateAttention().eval()
    cm = _compiled(model, ["history", "lengths"], _Batch([2, 3], 0, False).replicated())
    return model, cm


def test_a_portable_attention_with_several_queries_per_candidate_is_exact():
    model, cm = candidate_attention()
    program = rocs.export(cm, portable=True)
    requests = symbolic_signature(program)["history"]["shape"][0]
    assert key_value_reads(program, (2, 6, 8)) == [requests, requests]
    run = program.module()
    for i, (counts, shuffle) in enumerate(BATCHES):
        _check(run, model, _Batch(counts, 70 + i, shuffle), str(counts))


@pytest.mark.slow
def test_a_portable_attention_compiles_with_aot_inductor(tmp_path):
    """About a minute on two CPU cores (two C++ compiles)."""
    entry, model, cm = _target_attention()
    runner = torch._inductor.aoti_load_package(
        rocs.aoti_package(rocs.export(cm, portable=True), tmp_path / "target_attention.pt2")
    )
    for i, (counts, shuffle) in enumerate(BATCHES):
        batch = entry.make_batch(counts, seed=80 + i, shuffle=shuffle)
        _check(runner, model, batch, f"target_attention {counts}")
    model, cm = candidate_attention()
    runner = torch._inductor.aoti_load_package(
        rocs.aoti_package(rocs.export(cm, portable=True), tmp_path / "candidate_attention.pt2")
    )
    for i, (counts, shuffle) in enumerate(BATCHES):
        _check(runner, model, _Batch(counts, 90 + i, shuffle), f"candidate attention {counts}")


class PackedKeyValueAttention(nn.Module):
    """``nn.MultiheadAttention`` with the key and the value the same tensor: torch projects them
    with one packed GEMM and hands the attention two views of its output, which share storage."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.history = nn.Linear(8, 16)
        self.query = nn.Linear(4, 16)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 3)

    def forward(self, history, lengths, item):
        states = self.history(history)
        padded = torch.arange(history.shape[1]) >= lengths[:, None]
        query = self.query(item)[:, None, :]
        attended, _ = self.attention(
            query, states, states, key_padding_mask=padded, need_weights=False
        )
        return self.out(attended[:, 0]) * 10


def test_a_portable_attention_over_packed_keys_and_values_lowers_like_aot_inductor():
    """Keys and values that share storage reach the portable attention's ``torch.cond`` as
    copies: the program's decomposition (the step AOTInductor and the ONNX exporter run first)
    refused operands that alias each other."""
    model = PackedKeyValueAttention().eval()
    batch = _Batch([2, 3], 0, False)
    batch.kwargs["lengths"].clamp_(min=1)
    cm = _compiled(model, ["history", "lengths"], batch.replicated())
    run = rocs.export(cm, portable=True).run_decompositions({}).module()
    for i, (counts, shuffle) in enumerate(BATCHES):
        batch = _Batch(counts, 100 + i, shuffle)
        batch.kwargs["lengths"].clamp_(min=1)  # a history of no item is NaN in eager MHA
        _check(run, model, batch, f"packed keys and values {counts}")
