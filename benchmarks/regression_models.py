"""Models of the no-regression benchmark that the zoo does not have.

Each is a small ranking model of a published family, written the way such models are usually
written, with request inputs ``u*`` (R rows in the shared layout) and candidate inputs ``c*``
(N rows). :data:`MODELS` maps a name to ``(build, inputs)``; ``inputs`` maps each input name to
``(shape without the batch dim, kind)`` with kind ``"dense"`` (float32 normal) or ``"ids:V"``
(int64 ids in ``[1, V)``), and the request inputs are the names that start with ``u``.

- ``crossmix``: DCN-M (mixture of low-rank cross experts on ``x`` as a column vector);
- ``multitask_gates``: shared experts, one softmax gate per task computed from request features;
- ``cin``: xDeepFM's compressed interaction network over field embeddings, plus a DNN;
- ``autoint``: multi-head self-attention over field embeddings;
- ``fibinet``: SENET field re-weighting and a bilinear interaction;
- ``deepfm``: FM second-order term over field embeddings plus a DNN;
- ``logistic_regression``: one weight per id field, summed (a tiny model: the per-call cost
  decides it);
- ``fm``: a factorization machine (first order plus pairwise field interactions), also tiny;
- ``wide_deep``: wide linear parts on each side, a deep MLP on the concatenation;
- ``gru_history``, ``lstm_history``: a recurrent encoder over the request's history, then
  attention from the candidate over its outputs (DIEN-like);
- ``transformer_history``: an ``nn.TransformerEncoderLayer`` over the history, scored by a dot
  product with the candidate;
- ``no_share``: request features enter through an elementwise product with the candidate's, so
  nothing is request-only;
- ``mixed_norm``: a layer norm over the concatenated request and candidate features first, so
  nothing is request-only either.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MODELS", "make_inputs"]

D = 16  # embedding width
FU, FC = 4, 3  # request and candidate id fields
VOCAB = 1000
L = 20  # history length


def _mlp(*widths: int) -> nn.Sequential:
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Fields(nn.Module):
    """Field embeddings of request ids ``[B, FU]`` and candidate ids ``[B, FC]``: ``[B, F, D]``."""

    def __init__(self):
        super().__init__()
        self.user = nn.ModuleList(nn.Embedding(VOCAB, D) for _ in range(FU))
        self.item = nn.ModuleList(nn.Embedding(VOCAB, D) for _ in range(FC))

    def forward(self, u_ids, c_ids):
        user = [t(u_ids[:, i]) for i, t in enumerate(self.user)]
        item = [t(c_ids[:, i]) for i, t in enumerate(self.item)]
        return torch.stack(user + item, dim=1)


FIELD_INPUTS = {"u_ids": ((FU,), f"ids:{VOCAB}"), "c_ids": ((FC,), f"ids:{VOCAB}")}
DENSE_INPUTS = {"u": ((32,), "dense"), "c": ((32,), "dense")}
HISTORY_INPUTS = {"u_hist": ((L,), f"ids:{VOCAB}"), "c_item": ((), f"ids:{VOCAB}")}


class CrossMix(nn.Module):
    def __init__(self, d=64, r=16, experts=4, layers=3):
        super().__init__()
        self.U = nn.Parameter(torch.randn(layers, experts, d, r) * 0.1)
        self.V = nn.Parameter(torch.randn(layers, experts, d, r) * 0.1)
        self.C = nn.Parameter(torch.randn(layers, experts, r, r) * 0.1)
        self.b = nn.Parameter(torch.zeros(layers, d, 1))
        self.gate = nn.Linear(d, experts)
        self.layers, self.experts = layers, experts

    def forward(self, u, c):
        x0 = torch.cat([u, c], 1).unsqueeze(2)
        x = x0
        for i in range(self.layers):
            outs = []
            for e in range(self.experts):
                v = torch.tanh(torch.matmul(self.V[i, e].t(), x))
                v = torch.tanh(torch.matmul(self.C[i, e], v))
                outs.append(x0 * (torch.matmul(self.U[i, e], v) + self.b[i]))
            g = torch.softmax(self.gate(x.squeeze(2)), 1)
            x = (torch.stack(outs, 3).squeeze(2) * g.unsqueeze(1)).sum(2, keepdim=True) + x
        return x.squeeze(2).sum(1)


class MultiTaskGates(nn.Module):
    def __init__(self, experts=4, tasks=2, hidden=64):
        super().__init__()
        self.experts = nn.ModuleList(_mlp(64, hidden, hidden) for _ in range(experts))
        self.gates = nn.ModuleList(nn.Linear(32, experts) for _ in range(tasks))
        self.towers = nn.ModuleList(_mlp(hidden, 32, 1) for _ in range(tasks))

    def forward(self, u, c):
        x = torch.cat([u, c], 1)
        experts = torch.stack([e(x) for e in self.experts], 1)  # [B, E, H]
        outs = []
        for gate, tower in zip(self.gates, self.towers):
            w = torch.softmax(gate(u), -1).unsqueeze(-1)  # request-only gate
            outs.append(tower((experts * w).sum(1)))
        return torch.cat(outs, 1)


class CIN(nn.Module):
    def __init__(self, sizes=(16, 16)):
        super().__init__()
        self.fields = Fields()
        f = FU + FC
        self.convs = nn.ModuleList()
        h = f
        for s in sizes:
            self.convs.append(nn.Conv1d(h * f, s, 1))
            h = s
        self.dnn = _mlp(f * D, 64, 32)
        self.out = nn.Linear(sum(sizes) + 32, 1)

    def forward(self, u_ids, c_ids):
        x0 = self.fields(u_ids, c_ids)  # [B, F, D]
        b = x0.shape[0]
        xk, pooled = x0, []
        for conv in self.convs:
            z = torch.einsum("bhd,bmd->bhmd", xk, x0).reshape(b, -1, D)
            xk = torch.relu(conv(z))
            pooled.append(xk.sum(2))
        deep = self.dnn(x0.flatten(1))
        return self.out(torch.cat(pooled + [deep], 1)).squeeze(1)


class AutoInt(nn.Module):
    def __init__(self, heads=2, layers=2):
        super().__init__()
        self.fields = Fields()
        self.attn = nn.ModuleList(nn.MultiheadAttention(D, heads, batch_first=True) for _ in range(layers))
        self.out = nn.Linear((FU + FC) * D, 1)

    def forward(self, u_ids, c_ids):
        x = self.fields(u_ids, c_ids)
        for attn in self.attn:
            x = torch.relu(x + attn(x, x, x, need_weights=False)[0])
        return self.out(x.flatten(1)).squeeze(1)


class FiBiNET(nn.Module):
    def __init__(self, reduction=2):
        super().__init__()
        f = FU + FC
        self.fields = Fields()
        self.squeeze = nn.Sequential(nn.Linear(f, f // reduction), nn.ReLU(), nn.Linear(f // reduction, f), nn.ReLU())
        self.bilinear = nn.Linear(D, D, bias=False)
        self.pairs = [(i, j) for i in range(f) for j in range(i + 1, f)]
        self.mlp = _mlp(2 * len(self.pairs) * D, 64, 1)

    def _interact(self, x):
        left = self.bilinear(x)
        return torch.cat([left[:, i] * x[:, j] for i, j in self.pairs], 1)

    def forward(self, u_ids, c_ids):
        x = self.fields(u_ids, c_ids)
        weights = self.squeeze(x.mean(2))  # SENET: one weight per field
        senet = x * weights.unsqueeze(2)
        return self.mlp(torch.cat([self._interact(x), self._interact(senet)], 1)).squeeze(1)


class DeepFM(nn.Module):
    def __init__(self):
        super().__init__()
        self.fields = Fields()
        self.dnn = _mlp((FU + FC) * D, 64, 32, 1)

    def forward(self, u_ids, c_ids):
        x = self.fields(u_ids, c_ids)
        fm = 0.5 * (x.sum(1).pow(2) - x.pow(2).sum(1)).sum(1)
        return fm + self.dnn(x.flatten(1)).squeeze(1)


class LogisticRegression(nn.Module):
    """A logistic regression over id fields, as CTR libraries write it: one weight per id
    (a width-1 embedding per field), concatenated, summed, plus a bias."""

    def __init__(self):
        super().__init__()
        self.user = nn.ModuleList(nn.Embedding(VOCAB, 1) for _ in range(FU))
        self.item = nn.ModuleList(nn.Embedding(VOCAB, 1) for _ in range(FC))
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, u_ids, c_ids):
        user = [t(u_ids[:, i]) for i, t in enumerate(self.user)]
        item = [t(c_ids[:, i]) for i, t in enumerate(self.item)]
        return torch.sigmoid(torch.cat(user + item, dim=1).sum(1) + self.bias)


class FactorizationMachine(nn.Module):
    """A factorization machine: the logistic regression's first order plus the pairwise
    interactions of the field embeddings, ``0.5 * ((sum v)^2 - sum v^2)``."""

    def __init__(self):
        super().__init__()
        self.first = LogisticRegression()
        self.fields = Fields()

    def forward(self, u_ids, c_ids):
        x = self.fields(u_ids, c_ids)
        second = 0.5 * (x.sum(1).pow(2) - x.pow(2).sum(1)).sum(1)
        return torch.sigmoid(torch.logit(self.first(u_ids, c_ids)) + second)


class WideDeep(nn.Module):
    def __init__(self):
        super().__init__()
        self.wide_u, self.wide_c = nn.Linear(32, 1), nn.Linear(32, 1)
        self.deep = _mlp(64, 128, 64, 1)

    def forward(self, u, c):
        return (self.wide_u(u) + self.wide_c(c) + self.deep(torch.cat([u, c], 1))).squeeze(1)


class RecurrentHistory(nn.Module):
    def __init__(self, cell: str):
        super().__init__()
        self.items = nn.Embedding(VOCAB, D)
        self.rnn = (nn.GRU if cell == "gru" else nn.LSTM)(D, D, batch_first=True)
        self.mlp = _mlp(3 * D, 32, 1)

    def forward(self, u_hist, c_item):
        states, _ = self.rnn(self.items(u_hist))  # [B, L, D]
        target = self.items(c_item)  # [B, D]
        weights = torch.softmax((states * target.unsqueeze(1)).sum(2), 1)
        interest = (weights.unsqueeze(2) * states).sum(1)
        return self.mlp(torch.cat([interest, target, states[:, -1]], 1)).squeeze(1)


class TransformerHistory(nn.Module):
    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(VOCAB, D)
        self.encoder = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
        self.proj = nn.Linear(D, D)

    def forward(self, u_hist, c_item):
        user = self.encoder(self.items(u_hist)).mean(1)
        return (self.proj(user) * self.items(c_item)).sum(1)


class NoShare(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = _mlp(32, 64, 32, 1)

    def forward(self, u, c):
        return self.mlp(u * c).squeeze(1)


class MixedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.mlp = _mlp(64, 64, 32, 1)

    def forward(self, u, c):
        return self.mlp(self.norm(torch.cat([u, c], 1))).squeeze(1)


MODELS = {
    "crossmix": (CrossMix, DENSE_INPUTS),
    "multitask_gates": (MultiTaskGates, DENSE_INPUTS),
    "cin": (CIN, FIELD_INPUTS),
    "autoint": (AutoInt, FIELD_INPUTS),
    "fibinet": (FiBiNET, FIELD_INPUTS),
    "deepfm": (DeepFM, FIELD_INPUTS),
    "wide_deep": (WideDeep, DENSE_INPUTS),
    "gru_history": (lambda: RecurrentHistory("gru"), HISTORY_INPUTS),
    "lstm_history": (lambda: RecurrentHistory("lstm"), HISTORY_INPUTS),
    "transformer_history": (TransformerHistory, HISTORY_INPUTS),
    "logistic_regression": (LogisticRegression, FIELD_INPUTS),
    "fm": (FactorizationMachine, FIELD_INPUTS),
    "no_share": (NoShare, DENSE_INPUTS),
    "mixed_norm": (MixedNorm, DENSE_INPUTS),
}


def make_inputs(inputs: dict, requests: int, candidates: int, generator: torch.Generator) -> dict:
    """Shared-layout inputs: ``requests`` rows for ``u*`` inputs, ``candidates`` rows for others."""
    out = {}
    for name, (shape, kind) in inputs.items():
        rows = requests if name.startswith("u") else candidates
        if kind == "dense":
            out[name] = torch.randn((rows, *shape), generator=generator)
        else:
            vocab = int(kind.split(":")[1])
            out[name] = torch.randint(1, vocab, (rows, *shape), generator=generator)
    return out


