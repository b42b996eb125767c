"""The truncation proof (``analysis/truncation.py``, rules in ``analysis/padded_tails.py``).

Oracle, which knows nothing of the rules: a model the proof accepts returns the same rows for a
batch padded to a wide width and for each row cut to its own length (run one row at a time, in
eager); each model the proof refuses is one whose answer does change with the padding (shown on
the model itself), or one that mixes rows."""

from __future__ import annotations

import pytest
import torch

import rocs_compiler as rocs
from rocs_compiler.analysis.truncation import Refusal, Truncation

from padded_models import VOCAB, Pooled, WithLengths

WIDTH = 12

ACCEPTED = [
    "masked_sum", "softmax", "large_negative", "max", "cumsum", "causal", "attention",
    "padded_prefix",
]  # fmt: skip
REFUSED = {
    "mean": "mean",
    "unmasked_sum": "reduces over the history",
    "last": "picks positions of the history",
    "listwise": "mixes candidates",
    "pad_other_value": "pads the history other than on its right with the value its tail holds",
}


def _batch(rows: int, seed: int, *, empty_rows: bool = False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, WIDTH + 1, (rows,), generator=g)
    if empty_rows:
        lengths[::3] = 0
    hist = torch.randint(1, VOCAB, (rows, WIDTH), generator=g)
    hist = hist.masked_fill(torch.arange(WIDTH) >= lengths[:, None], 0)
    return hist, torch.randint(1, VOCAB, (rows,), generator=g), lengths


def _proof(model, example: dict, request_inputs):
    for name in ("hist",):
        torch._dynamo.mark_dynamic(example[name], 1)
    cm = rocs.compile(model.eval(), request_inputs, example_kwargs=example)
    return cm, cm._jagged.truncation or cm.jagged_refused


def _cut_rows(model, hist, item, lengths, keep_one: bool):
    """Each row alone, its history cut to its own length (one position kept when empty and the
    model needs one)."""
    rows = []
    for r in range(hist.shape[0]):
        width = max(int(lengths[r]), 1 if keep_one else 0)
        rows.append(model(hist[r : r + 1, :width], item[r : r + 1]))
    return torch.cat(rows)


@pytest.mark.parametrize("pool", ACCEPTED)
def test_a_model_the_proof_accepts_returns_the_same_rows_cut_to_each_length(pool):
    model = Pooled(pool).eval()
    hist, item, lengths = _batch(5, seed=0)
    cm, proof = _proof(model, {"hist": hist.clone(), "item": item}, ["hist"])
    assert isinstance(proof, Truncation), proof
    assert proof.source.input == "hist" and proof.source.pad == 0
    hist, item, lengths = _batch(9, seed=3)
    with torch.no_grad():
        padded = model(hist, item)
        assert padded.std() > 1e-2
        torch.testing.assert_close(
            _cut_rows(model, hist, item, lengths, True), padded, rtol=1e-5, atol=1e-5
        )
    normalizes = pool in ("softmax", "large_negative", "max", "attention")
    assert bool(proof.needs_content) == normalizes


@pytest.mark.parametrize("pool", sorted(REFUSED))
def test_a_model_whose_answer_reads_the_padding_is_refused_naming_the_node(pool):
    model = Pooled(pool).eval()
    hist, item, lengths = _batch(6, seed=1)
    cm, refused = _proof(model, {"hist": hist.clone(), "item": item}, ["hist"])
    assert cm._jagged.truncation is None and isinstance(refused, str), refused
    assert REFUSED[pool] in refused
    if pool != "listwise":  # the refusal is right: cutting the padding changes the answer
        with torch.no_grad():
            assert not torch.allclose(
                _cut_rows(model, hist, item, lengths, True), model(hist, item), atol=1e-4
            )


def test_a_lengths_input_beside_the_ids_is_a_length_source():
    model = WithLengths().eval()
    hist, item, lengths = _batch(5, seed=2)
    example = {"hist": hist.clone(), "hist_len": lengths, "item": item}
    cm, proof = _proof(model, example, ["hist", "hist_len"])
    assert isinstance(proof, Truncation), proof
    assert proof.source.input == "hist_len" and proof.source.pad is None


def test_the_proof_is_a_refusal_without_a_dynamic_length():
    model = Pooled("masked_sum").eval()
    hist, item, _ = _batch(4, seed=0)
    cm = rocs.compile(model, ["hist"], example_kwargs={"hist": hist, "item": item})
    assert cm._jagged is None and cm.jagged_refused is None
    from rocs_compiler.analysis.truncation import prove_truncation

    captured = cm.pipeline_result.captured
    refusal = prove_truncation(
        captured.graph_module, captured.placeholder_of, ["hist"], captured.batch_symbol
    )
    assert (
        isinstance(refusal, Refusal) and "no input has a dynamic history length" in refusal.reason
    )
