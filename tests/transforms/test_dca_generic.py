"""``apply_dca`` on models that are not registered conversions: torch's encoder modules.

Oracles that do not know the transform: the original module run on the whole sequence with a
block attention mask (history rows may not see candidate columns) equals the DCA form; history
states do not move when candidate inputs do; the compiled DCA model equals its eager forward on
ragged batches in both call layouts.
"""

from __future__ import annotations

import functools

import pytest
import torch
from models_for_tests import assert_outputs_match, check_both_conventions
from torch import nn

import rocs_compiler as rocs
from models_zoo import backbones as bb
from models_zoo.user_models import BSTLike, Ranker
from rocs_compiler.transforms.dca_torch import (
    DCAMultiheadAttention,
    DCATransformerEncoder,
    DCATransformerEncoderLayer,
)

torch.set_num_threads(1)

L = 6
SCHEMA = bb.FeatureSchema(
    request_vocabs=(40, 8, 3), num_items=60, history_length=L, candidate_vocabs=(10,), multihot=5
)
C = 3  # BSTLike's candidate tokens: item id, item field, genres
BATCHES = [([3, 1, 5], True), ([1], False), ([2, 4, 1], True)]


def _bst(batch_first: bool, norm_first: bool = False) -> BSTLike:
    torch.manual_seed(0)
    return BSTLike(
        SCHEMA.request_vocabs, SCHEMA.num_items, SCHEMA.candidate_vocabs, SCHEMA.multihot, L,
        dim=8, heads=2, ffn=16, layers=2, head=(16,), batch_first=batch_first,
        norm_first=norm_first,
    )  # fmt: skip


def _example() -> dict:
    return bb.random_batch(SCHEMA, [4, 3], seed=11).replicated()


def _train(model: nn.Module, steps: int = 3) -> nn.Module:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        batch = bb.random_batch(SCHEMA, [3, 2, 4], seed=100 + step).replicated()
        loss = nn.functional.binary_cross_entropy_with_logits(
            model(**batch), torch.rand(9, generator=torch.Generator().manual_seed(step))
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@functools.cache
def _compiled(batch_first: bool, norm_first: bool = False):
    vanilla = _bst(batch_first, norm_first)
    dca = rocs.apply_dca(vanilla, bb.REQUEST_INPUTS, example_kwargs=_example())
    dca.load_state_dict(vanilla.state_dict())
    _train(dca)
    cm = rocs.compile(dca, list(bb.REQUEST_INPUTS), example_kwargs=_example())
    cm_vanilla = rocs.compile(vanilla.eval(), list(bb.REQUEST_INPUTS), example_kwargs=_example())
    return vanilla, dca, cm, cm_vanilla


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_bst_like_transforms_trains_and_compiles_exactly(batch_first):
    vanilla, dca, cm, cm_vanilla = _compiled(batch_first)
    assert type(dca.encoder) is DCATransformerEncoder
    assert dca.encoder.history_length == L
    assert dca.rocs_dca_report.converted == {
        "encoder": f"TransformerEncoder, history positions 0..{L} of {L + C}"
    }
    assert dca.state_dict().keys() == vanilla.state_dict().keys()
    assert type(vanilla.encoder) is nn.TransformerEncoder  # the original is left alone
    for counts, shuffle in BATCHES:
        batch = bb.random_batch(SCHEMA, counts, seed=5, shuffle=shuffle)
        check_both_conventions(cm, dca, batch, f"BSTLike {counts}")
    # The history stack runs once per request: most FLOPs leave the candidate side.
    before, after = cm_vanilla.report(100, 1), cm.report(100, 1)
    assert not after.fallbacks, after.fallbacks
    assert after.request_share > before.request_share
    assert after.amortized_flops(100) < 0.6 * before.amortized_flops(100)


@pytest.mark.parametrize("batch_first, norm_first", [(True, False), (False, True)])
def test_dca_form_is_the_block_masked_original(batch_first, norm_first):
    """DCA = the original encoder with history rows barred from candidate columns."""
    vanilla = _bst(batch_first, norm_first).eval()
    dca = rocs.apply_dca(vanilla, history_length=L).eval()
    x = torch.randn(5, L + C, 8)
    padding = torch.zeros(5, L + C, dtype=torch.bool)
    padding[0, 2:L] = True  # some history padded, never all of it
    padding[3, 0] = True
    block = torch.zeros(L + C, L + C, dtype=torch.bool)
    block[:L, L:] = True  # True = may not attend
    if not batch_first:
        x = x.transpose(0, 1)
    with torch.no_grad():
        expected = vanilla.encoder(x, mask=block, src_key_padding_mask=padding)
        got = dca.encoder(x, src_key_padding_mask=padding)
    assert_outputs_match(got, expected, "DCA vs block-masked encoder")


def test_history_states_ignore_candidates():
    _, dca, _, _ = _compiled(True)
    states = []
    for seed in (1, 2):
        x = torch.randn(4, L + C, 8, generator=torch.Generator().manual_seed(seed))
        x[:, :L] = torch.randn(4, L, 8, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            states.append(dca.encoder(x)[:, :L])
    assert torch.equal(*states)


def test_empty_history_stays_finite():
    _, dca, cm, _ = _compiled(False)
    batch = bb.random_batch(SCHEMA, [2, 3], seed=9)
    batch.kwargs["history"][1] = 0
    with torch.no_grad():
        out = dca(**batch.replicated())
    assert torch.isfinite(out).all()
    check_both_conventions(cm, dca, batch, "empty history")


def test_explicit_history_length_needs_no_example():
    vanilla = _bst(True)
    dca = rocs.apply_dca(vanilla, history_length=L)
    assert dca.encoder.history_length == L
    converted = dca.rocs_dca_report.converted
    assert converted == {"encoder": f"TransformerEncoder, history positions 0..{L}"}


# ---------------------------------------------------------------------------------------------
# nn.TransformerEncoderLayer and nn.MultiheadAttention inside a user's own layer


class _TokenModel(nn.Module):
    """[history items; candidate item] through an encoder layer or a hand-written post-LN layer
    around ``nn.MultiheadAttention``; the head reads the mean history state and the candidate."""

    def __init__(self, kind: str, batch_first: bool, dim: int = 8, items: int = 50):
        super().__init__()
        self.kind, self.batch_first = kind, batch_first
        self.emb = nn.Embedding(items, dim)
        self.pos = nn.Parameter(torch.randn(L + 1, dim))
        if kind == "mha":
            self.attn = nn.MultiheadAttention(dim, 2, batch_first=batch_first)
            self.norm = nn.LayerNorm(dim)
            self.ffn = nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Linear(16, dim))
        else:
            self.layer = nn.TransformerEncoderLayer(
                dim, 2, 16, dropout=0.0, batch_first=batch_first
            )
        self.out = nn.Linear(2 * dim, 1)

    def forward(self, history, item):
        x = torch.cat([self.emb(history), self.emb(item)[:, None]], 1) + self.pos
        padding = torch.cat([history, item[:, None]], 1) == 0
        x = x if self.batch_first else x.transpose(0, 1)
        if self.kind == "mha":
            a, _ = self.attn(x, x, x, key_padding_mask=padding)
            x = self.norm(x + a)
            x = x + self.ffn(x)
        else:
            x = self.layer(x, src_key_padding_mask=padding)
        x = x if self.batch_first else x.transpose(0, 1)
        return self.out(torch.cat([x[:, :-1].mean(1), x[:, -1]], -1)).squeeze(-1)


def _token_inputs(requests: int, candidates: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(1, 50, (requests, L), generator=g)
    history[-1, 2:] = 0
    return {"history": history}, {"item": torch.randint(1, 50, (candidates,), generator=g)}


@pytest.mark.parametrize(
    "kind, batch_first, form",
    [("layer", True, DCATransformerEncoderLayer), ("mha", False, DCAMultiheadAttention)],
)
def test_encoder_layer_and_attention_convert_and_compile_exactly(kind, batch_first, form):
    torch.manual_seed(0)
    vanilla = _TokenModel(kind, batch_first)
    request, candidate = _token_inputs(3, 3)
    example = {"history": request["history"][[0, 0, 1]], **candidate}
    dca = rocs.apply_dca(vanilla, ["history"], example_kwargs=example).eval()
    assert type(getattr(dca, "attn" if kind == "mha" else "layer")) is form
    cm = rocs.compile(dca, ["history"], example_kwargs=example)
    before = rocs.compile(vanilla.eval(), ["history"], example_kwargs=example).report(100, 1)
    assert cm.report(100, 1).amortized_flops(100) < 0.5 * before.amortized_flops(100)
    request, candidate = _token_inputs(3, 7, seed=4)
    index = torch.tensor([2, 0, 1, 1, 2, 0, 1])
    with torch.no_grad():
        expected = dca(request["history"][index], candidate["item"])
        assert_outputs_match(cm(**request, **candidate, candidate_to_request=index), expected)
        assert_outputs_match(cm(history=request["history"][index], **candidate), expected)


# ---------------------------------------------------------------------------------------------
# Clear errors


def test_model_without_a_sequence_module_is_refused():
    with pytest.raises(ValueError, match=r"Ranker has no nn\.TransformerEncoder"):
        rocs.apply_dca(Ranker(), ["user_feats"], example_kwargs={})


def test_without_history_length_or_example_asks_for_one():
    with pytest.raises(ValueError, match=r"'encoder'.*example_kwargs=.*history_length="):
        rocs.apply_dca(_bst(True), bb.REQUEST_INPUTS)


class _CandidateFirst(_TokenModel):
    def forward(self, history, item):
        x = torch.cat([self.emb(item)[:, None], self.emb(history)], 1) + self.pos
        return self.layer(x).mean((1, 2))


def test_candidate_before_history_is_refused():
    request, candidate = _token_inputs(2, 2)
    with pytest.raises(ValueError, match=r"request-only positions are \[1, 2, 3, 4, 5, 6\]"):
        model = _CandidateFirst("layer", True)
        rocs.apply_dca(model, ["history"], example_kwargs={**request, **candidate})


class _HistoryEncoder(_TokenModel):
    """The encoder reads the history only (already request-only); target attention after it."""

    def __init__(self):
        super().__init__("layer", True)
        self.target = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, history, item):
        h = self.layer(self.emb(history))
        q = self.emb(item)[:, None]
        return self.target(q, h, h)[0].sum((1, 2))


def test_nothing_to_convert_says_why():
    request, candidate = _token_inputs(2, 2)
    why = r"nothing in _HistoryEncoder.*history encoder.*not a self-attention"
    with pytest.raises(ValueError, match=why):
        rocs.apply_dca(_HistoryEncoder(), ["history"], example_kwargs={**request, **candidate})


def test_unsupported_attention_options_are_refused():
    model = _TokenModel("mha", True)
    model.attn = nn.MultiheadAttention(8, 2, batch_first=True, kdim=4, vdim=4)
    with pytest.raises(ValueError, match=r"MultiheadAttention at attn has kdim/vdim"):
        rocs.apply_dca(model, history_length=L)
    model.attn = nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        rocs.apply_dca(model, history_length=L)


def test_dca_attention_refuses_cross_attention_calls():
    attn = DCAMultiheadAttention.convert(nn.MultiheadAttention(8, 2, batch_first=True), 3)
    x, y = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="query, key and value the same tensor"):
        attn(x, y, y)
    with pytest.raises(ValueError, match="no candidate token"):
        short = x[:, :3]
        attn(short, short, short)


def test_glm_on_the_dca_model_reads_the_history_stack_as_request_lanes():
    """The lanes see through the DCA encoder: the head's request group holds the user fields
    and the pooled history states (both request-only), not the candidate tokens."""
    _, dca, _, _ = _compiled(True)
    glm = rocs.apply_glm(dca, bb.REQUEST_INPUTS, example_kwargs=_example())
    dim, fields = 8, len(SCHEMA.request_vocabs)
    assert glm.rocs_glm_report.transformed == {
        "mlp.0": f"request lanes {(fields + 1) * dim}/{(fields + 1 + C) * dim} -> 8/16"
    }
    cm = rocs.compile(glm.eval(), list(bb.REQUEST_INPUTS), example_kwargs=_example())
    check_both_conventions(cm, glm, bb.random_batch(SCHEMA, [2, 3], seed=8, shuffle=True), "GLM")


def test_lane_taints_are_sound_through_the_dca_encoder():
    """Non-interference: every element the lane analysis calls request-only (attention rows,
    ``any`` reductions of the masks included) is bit-identical when the candidate inputs change."""
    from rocs_compiler.analysis.driver import analyze
    from rocs_compiler.capture.trace import capture
    from rocs_compiler.analysis.segments import run_taints

    _, dca, _, _ = _compiled(True)
    example = _example()
    cg = capture(dca, (), example, list(bb.REQUEST_INPUTS))
    analyze(cg.graph_module, {cg.placeholder_of[n] for n in cg.request_inputs}, cg.batch_symbol)
    other = dict(example, **{
        k: v for k, v in bb.random_batch(SCHEMA, [4, 3], seed=12).replicated().items()
        if k not in bb.REQUEST_INPUTS
    })  # fmt: skip
    values, taints = run_taints(cg.graph_module, [example[n] for n in cg.input_names])
    moved, _ = run_taints(cg.graph_module, [other[n] for n in cg.input_names])
    checked = 0
    for node, taint in taints.items():
        value = values[node]
        if not isinstance(value, torch.Tensor) or not isinstance(taint, torch.Tensor):
            continue
        clean = ~taint
        assert torch.equal(value[clean], moved[node][clean]), node.name
        checked += int(node.target is torch.ops.aten.scaled_dot_product_attention.default
                       and bool(clean.any()))  # fmt: skip
    assert checked == 2  # the history self-attention of both layers
