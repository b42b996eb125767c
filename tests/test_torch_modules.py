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

D, L, HEADS = 16, 5, 4
INDEX = torch.tensor([0, 0, 1, 2, 2, 2, 1])  # 3 requests with 2, 2 and 3 candidates, shuffled


class HistoryModel(nn.Module):
    """``score(history encoder(hist), item)``; ``sequence_first`` feeds the encoder [L, B, D]."""

    def __init__(self, sequence_first: bool = False):
        super().__init__()
        self.sequence_first = sequence_first
        self.item = nn.Linear(8, D)

    def to_layout(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1) if self.sequence_first else x

    def forward(self, hist, c):
        user = self.encode(hist)
        return (user * self.item(c)).sum(-1)


class SelfAndTargetAttention(HistoryModel):
    """MHA self-attention over the history, then MHA target attention from the candidate."""

    def __init__(self, sequence_first=False, need_weights=True, padding=False, causal=False):
        super().__init__(sequence_first)
        kw = dict(batch_first=not sequence_first)
        self.self_attn = nn.MultiheadAttention(D, HEADS, **kw)
        self.target = nn.MultiheadAttention(D, HEADS, **kw)
        self.need_weights, self.padding, self.causal = need_weights, padding, causal

    def forward(self, hist, c):
        mask = (hist[..., 0] > 1.0) if self.padding else None  # request-side key padding
        if mask is not None:
            mask[:, 0] = False  # every history keeps one key
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1) if self.causal else None
        x = self.to_layout(hist)
        h, _ = self.self_attn(
            x, x, x, key_padding_mask=mask, attn_mask=causal, need_weights=self.need_weights
        )
        q = self.to_layout(self.item(c).unsqueeze(1))
        out, _ = self.target(q, h, h, key_padding_mask=mask, need_weights=self.need_weights)
        return self.to_layout(out).squeeze(1).sum(-1)


class Encoder(HistoryModel):
    def __init__(self, sequence_first=False, norm_first=False, layers=2):
        super().__init__(sequence_first)
        layer = nn.TransformerEncoderLayer(
            D, HEADS, 32, dropout=0.0, batch_first=not sequence_first, norm_first=norm_first
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def encode(self, hist):
        h = self.encoder(self.to_layout(hist))
        return h.mean(0 if self.sequence_first else 1)


class Decoder(HistoryModel):
    """A decoder layer whose target is the request's last item and whose memory is its history."""

    def __init__(self, sequence_first=False, norm_first=False):
        super().__init__(sequence_first)
        self.decoder = nn.TransformerDecoderLayer(
            D, HEADS, 32, dropout=0.0, batch_first=not sequence_first, norm_first=norm_first
        )

    def encode(self, hist):
        memory = self.to_layout(hist)
        target = self.to_layout(hist[:, -1:])
        out = self.decoder(target, memory)
        return self.to_layout(out).squeeze(1)


class Recurrent(HistoryModel):
    """An RNN/GRU/LSTM over the history; the user is its last state plus its mean output."""

    def __init__(self, kind, sequence_first=False, layers=1, bidirectional=False, h0=False):
        super().__init__(sequence_first)
        directions = 2 if bidirectional else 1
        self.rnn = kind(
            D, D // directions, num_layers=layers, batch_first=not sequence_first,
            bidirectional=bidirectional,
        )  # fmt: skip
        self.lstm = kind is nn.LSTM
        self.state_shape = (layers * directions, D // directions)
        self.h0 = nn.Linear(D, layers * directions * (D // directions)) if h0 else None

    def encode(self, hist):
        x = self.to_layout(hist)
        state = None
        if self.h0 is not None:
            h = self.h0(hist[:, 0]).view(hist.shape[0], *self.state_shape).transpose(0, 1)
            state = (h.contiguous(), torch.zeros_like(h)) if self.lstm else h.contiguous()
        out, last = self.rnn(x, state)
        last = last[0] if self.lstm else last
        mean = out.mean(0 if self.sequence_first else 1)
        return mean + last[-1].repeat(1, mean.shape[-1] // last.shape[-1])


class MergedHeads(HistoryModel):
    """Hand-written multi-head self-attention with the heads merged into the batch."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def encode(self, hist):
        b = hist.shape[0]
        q, k, v = self.qkv(hist).chunk(3, -1)
        q, k, v = (t.reshape(b, L, HEADS, D // HEADS).transpose(1, 2).reshape(b * HEADS, L, -1)
                   for t in (q, k, v))  # fmt: skip
        att = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / (D // HEADS) ** 0.5, -1)
        out = torch.bmm(att, v).reshape(b, HEADS, L, -1).transpose(1, 2).reshape(b, L, D)
        return out.mean(1)


class InPlaceHistory(HistoryModel):
    """A history embedding updated in place: ``h += pos``, ``masked_fill_``."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(L, D))
        self.proj = nn.Linear(D, D)

    def encode(self, hist):
        h = self.proj(hist)
        h += self.pos
        h.masked_fill_(hist < -1.0, 0.0)
        h[:, 0].mul_(2.0)
        return h.relu().mean(1)


CASES = {
    "mha": lambda: SelfAndTargetAttention(),
    "mha_seq_first": lambda: SelfAndTargetAttention(sequence_first=True),
    "mha_no_weights": lambda: SelfAndTargetAttention(need_weights=False),
    "mha_seq_first_no_weights": lambda: SelfAndTargetAttention(True, need_weights=False),
    "mha_key_padding": lambda: SelfAndTargetAttention(padding=True),
    "mha_key_padding_no_weights": lambda: SelfAndTargetAttention(need_weights=False, padding=True),
    "mha_causal_mask": lambda: SelfAndTargetAttention(causal=True),
    "encoder": lambda: Encoder(),
    "encoder_seq_first": lambda: Encoder(sequence_first=True),
    "encoder_norm_first": lambda: Encoder(norm_first=True),
    "encoder_seq_first_norm_first": lambda: Encoder(True, norm_first=True),
    "decoder": lambda: Decoder(),
    "decoder_seq_first_norm_first": lambda: Decoder(True, norm_first=True),
    "gru_seq_first": lambda: Recurrent(nn.GRU, sequence_first=True),
    "gru_given_state": lambda: Recurrent(nn.GRU, h0=True),
    "lstm": lambda: Recurrent(nn.LSTM),
    "lstm_two_layers_given_state": lambda: Recurrent(nn.LSTM, layers=2, h0=True),
    "lstm_bidirectional_seq_first": lambda: Recurrent(nn.LSTM, True, bidirectional=True),
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
    report = cm.report(num_candidates=64, num_requests=2)
    assert not report.fallbacks, [(f.op, f.reason, f.module) for f in report.fallbacks]
    assert report.request_flops > report.candidate_flops, "the encoder should be request-side"
