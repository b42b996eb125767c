"""torch's own sequence modules as the request-side history encoder.

Each model encodes a request's behaviour history with a module from ``torch.nn`` (attention,
transformer layers, recurrent layers), in either layout (batch first or sequence first), and
scores candidates against it. Inside those modules the batch moves away from dim 0 (``[L, B,
D]``, an RNN state ``[layers, B, H]``) and is merged with the heads (``[B*H, L, d]``); the
whole encoder must still run once per request. Every case is a differential test against
eager on a ragged batch in both call layouts, and asserts that nothing request-only fell back
to per-candidate computation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rocs_compiler as rocs
from models_zoo.history_encoders import (
    Decoder,
    Encoder,
    InPlaceHistory,
    MergedHeads,
    Recurrent,
    SelfAndTargetAttention,
)

D, L = 16, 5
INDEX = torch.tensor([0, 0, 1, 2, 2, 2, 1])  # 3 requests with 2, 2 and 3 candidates, shuffled


CASES = {
    "mha": lambda: SelfAndTargetAttention(),
    "mha_seq_first": lambda: SelfAndTargetAttention(sequence_first=True),
    "mha_no_weights": lambda: SelfAndTargetAttention(need_weights=False),
    "mha_seq_first_no_weights": lambda: SelfAndTargetAttention(
        sequence_first=True, need_weights=False
    ),
    "mha_key_padding": lambda: SelfAndTargetAttention(padding=True),
    "mha_key_padding_no_weights": lambda: SelfAndTargetAttention(need_weights=False, padding=True),
    "mha_causal_mask": lambda: SelfAndTargetAttention(causal=True),
    "encoder": lambda: Encoder(),
    "encoder_seq_first": lambda: Encoder(sequence_first=True),
    "encoder_norm_first": lambda: Encoder(norm_first=True),
    "encoder_seq_first_norm_first": lambda: Encoder(sequence_first=True, norm_first=True),
    # torch's inference fast path (frozen weights, nested tensors) is what eager runs here.
    "encoder_fast_path_settings": lambda: Encoder(nested=True).requires_grad_(False),
    "mha_fast_path_settings": lambda: SelfAndTargetAttention(need_weights=False).requires_grad_(
        False
    ),
    "decoder": lambda: Decoder(),
    "decoder_seq_first_norm_first": lambda: Decoder(sequence_first=True, norm_first=True),
    "gru_seq_first": lambda: Recurrent(nn.GRU, sequence_first=True),
    "gru_given_state": lambda: Recurrent(nn.GRU, h0=True),
    "lstm": lambda: Recurrent(nn.LSTM),
    "lstm_two_layers_given_state": lambda: Recurrent(nn.LSTM, layers=2, h0=True),
    "lstm_bidirectional_seq_first": lambda: Recurrent(
        nn.LSTM, sequence_first=True, bidirectional=True
    ),
    "rnn_two_layers_bidirectional": lambda: Recurrent(nn.RNN, layers=2, bidirectional=True),
    "gru_bidirectional_given_state": lambda: Recurrent(nn.GRU, bidirectional=True, h0=True),
    "merged_heads": lambda: MergedHeads(),
    "in_place_history": lambda: InPlaceHistory(),
}


def _compiled(name: str):
    torch.manual_seed(0)
    model = CASES[name]().eval()
    hist, c = torch.randn(3, L, D), torch.randn(7, 8)
    example = {"hist": hist[[0, 0, 1]], "c": c[:3]}
    return model, rocs.compile(model, ["hist"], example_kwargs=example), hist, c


@pytest.mark.parametrize("name", sorted(CASES))
def test_history_encoder_runs_once_per_request_and_is_exact(name):
    model, cm, hist, c = _compiled(name)
    with torch.no_grad():
        want = model(hist[INDEX], c)
        torch.testing.assert_close(cm(hist=hist, c=c, candidate_to_request=INDEX), want)
        torch.testing.assert_close(cm(hist=hist[INDEX], c=c), want)
        one = torch.tensor([0, 0, 0])
        torch.testing.assert_close(cm(hist=hist[:1], c=c[:3], candidate_to_request=one),
                                   model(hist[one], c[:3]))  # fmt: skip
    report = cm.report(candidates=32, requests=2)
    assert not report.fallbacks, [(f.op, f.reason, f.module) for f in report.fallbacks]
    assert report.request_flops > report.candidate_flops, "the encoder should be request-side"
    if name.startswith("mha") and name != "mha_key_padding":  # K/V read once per request
        assert "rocs.broadcast_attention.default" in report.fused_ops, report.fused_ops


@pytest.mark.parametrize("name", sorted(CASES))
def test_hand_written_rewrite_matches_the_model(name):
    """The baseline of ``benchmarks/lineage.py`` computes what the model computes."""
    torch.manual_seed(0)
    model = CASES[name]().eval()
    hist, c = torch.randn(3, L, D), torch.randn(7, 8)
    with torch.no_grad():
        torch.testing.assert_close(model.shared_forward(hist, c, INDEX), model(hist[INDEX], c))


class BagOfHistory(nn.Module):
    """``nn.EmbeddingBag`` over the flattened history ids with one offset per row."""

    def __init__(self, mode: str):
        super().__init__()
        self.bag = nn.EmbeddingBag(50, D, mode=mode)
        self.item = nn.Linear(8, D)

    def forward(self, ids, c):
        rows, length = ids.shape
        offsets = torch.arange(0, rows * length, length)
        return (self.bag(ids.reshape(-1), offsets) * self.item(c)).sum(-1)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_with_offsets_pools_once_per_request(mode):
    torch.manual_seed(0)
    model = BagOfHistory(mode).eval()
    ids, c = torch.randint(0, 50, (3, L)), torch.randn(7, 8)
    cm = rocs.compile(model, ["ids"], example_kwargs={"ids": ids[[0, 0, 1]], "c": c[:3]})
    with torch.no_grad():
        want = model(ids[INDEX], c)
        torch.testing.assert_close(cm(ids=ids, c=c, candidate_to_request=INDEX), want)
        torch.testing.assert_close(cm(ids=ids[INDEX], c=c), want)
    report = cm.report(candidates=32, requests=2)
    assert not report.fallbacks
    assert report.pass_counts["embedding_bag_rows"] == 1


def test_packed_sequences_are_refused_with_the_reason_or_run_eagerly():
    """``pack_padded_sequence`` cannot be captured by torch.export (its sizes are data); the
    compile error says so, and ``fallback="eager"`` runs the model as it is."""

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(D, D, batch_first=True)

        def forward(self, hist, lengths, c):
            packed = nn.utils.rnn.pack_padded_sequence(
                hist, lengths, batch_first=True, enforce_sorted=False
            )
            _, last = self.rnn(packed)
            return (last[-1] * c).sum(-1)

    model = Packed().eval()
    hist, lengths, c = torch.randn(3, L, D), torch.tensor([5, 3, 2]), torch.randn(7, D)
    example = {"hist": hist[[0, 0, 1]], "lengths": lengths[[0, 0, 1]], "c": c[:3]}
    with pytest.raises(rocs.CompileError, match="pack_padded_sequence"):
        rocs.compile(model, ["hist", "lengths"], example_kwargs=example)
    cm = rocs.compile(model, ["hist", "lengths"], example_kwargs=example, fallback="eager")
    with torch.no_grad():
        torch.testing.assert_close(
            cm(hist=hist[INDEX], lengths=lengths[INDEX], c=c), model(hist[INDEX], lengths[INDEX], c)
        )


@pytest.mark.parametrize("name", ["gru_seq_first", "mha", "encoder_seq_first"])
def test_through_the_torch_compile_backend(name):
    """The same models through ``torch.compile(backend="rocs")``. Dynamo breaks the graph at an
    RNN and compiles helpers called after a break as frames of their own, whose arguments carry
    other names (``to_layout(x)``): those frames run unshared with a warning, never an error."""
    torch.manual_seed(0)
    model = CASES[name]().eval()
    hist, c = torch.randn(3, L, D), torch.randn(7, 8)
    torch._dynamo.reset()
    options = {"request_inputs": ["hist"]}
    compiled = torch.compile(model, backend="rocs", dynamic=True, options=options)
    with torch.no_grad():
        torch.testing.assert_close(compiled(hist[INDEX], c), model(hist[INDEX], c))


@pytest.mark.parametrize("need_weights", [True, False])
def test_target_attention_over_a_fully_padded_history_matches_eager(need_weights):
    """A request whose every key is padded: eager gives NaN for its candidates when it computes
    the weights (a softmax over -inf scores) and zeros through SDPA; the fused op with the same
    float mask gives what eager gives."""

    class AllPadded(SelfAndTargetAttention):
        def key_padding(self, hist):
            return hist[..., 0] > 1.0

        def encode_history(self, hist, mask):
            return self.to_layout(hist)  # no self-attention over the padded history

    torch.manual_seed(0)
    model = AllPadded(padding=True, need_weights=need_weights).eval()
    hist, c = torch.randn(3, L, D).clamp(max=1.0), torch.randn(7, 8)
    hist[1, :, 0] = 5.0  # request 1: every key padded
    cm = rocs.compile(model, ["hist"], example_kwargs={"hist": hist[[0, 0, 1]], "c": c[:3]})
    with torch.no_grad():
        want = model(hist[INDEX], c)
        got = cm(hist=hist, c=c, candidate_to_request=INDEX)
    torch.testing.assert_close(got, want, equal_nan=True)
    # Through SDPA the float mask fuses; with weights, MHA's softmax gives NaN on such rows,
    # where the fused op gives zeros as SDPA does, so that spelling stays unfused (and exact).
    fused = "rocs.broadcast_attention.default" in cm.report().fused_ops
    assert fused == (not need_weights)
