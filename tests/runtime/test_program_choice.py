"""The shared and plain programs: both exact, and each call bucket keeps the faster one."""

from __future__ import annotations

import pytest
import torch
from models_for_tests import USER_ITEM_MLP, check_both_conventions
from torch import nn

import rocs_compiler as rocs
from models_zoo.registry import ZOO
from rocs_compiler.runtime.call import choosing, lanes, path, prior
from rocs_compiler.runtime.call import settled_plain
from rocs_compiler.runtime.choice import program_choice
from rocs_compiler.runtime.choice.program_choice import PLAIN, SHARED, TRIALS, ProgramChoice, bucket
from rocs_compiler.runtime.call.original_arm import PROGRAM


def test_trials_alternate_shared_first_and_the_lower_minimum_wins():
    choice = ProgramChoice(trials=3)
    key = bucket("shared", 16, 1)
    seen = []
    for _ in range(6):
        program = choice.next_trial(key)
        seen.append(program)
        assert choice.decided(key) is None
        choice.record(key, program, {SHARED: 2.0, PLAIN: 1.0}[program])
    assert seen == [SHARED, PLAIN] * 3
    assert choice.decided(key) == PLAIN
    choice.record(key, SHARED, 0.0)  # after the decision, nothing moves it
    assert choice.decisions() == {key: PLAIN}


def test_the_first_trial_of_each_program_is_not_counted():
    choice = ProgramChoice(trials=2)
    key = bucket("dropin", 100)
    for seconds in ({SHARED: 9.0, PLAIN: 1.0}, {SHARED: 1.0, PLAIN: 2.0}):
        for program in (SHARED, PLAIN):
            choice.record(key, program, seconds[program])
    assert choice.decided(key) == SHARED


@pytest.mark.parametrize("shared_time, expected", [(0.97, PLAIN), (0.90, SHARED)])
def test_a_margin_makes_a_close_shared_lead_a_tie_that_goes_plain(shared_time, expected):
    """Drop-in buckets: the shared program must lead by the margin (``DROPIN_MARGIN``)."""
    choice = ProgramChoice(trials=2)
    key = bucket("dropin", 16, 4)
    for _ in range(4):
        program = choice.next_trial(key, margin=0.05)
        choice.record(key, program, shared_time if program == SHARED else 1.0)
    assert choice.decided(key) == expected


def test_dropin_calls_ask_for_the_margin(monkeypatch):
    margins = []
    real = ProgramChoice.next_trial

    def next_trial(self, key, margin=0.0):
        margins.append((key[0], margin))
        return real(self, key, margin)

    monkeypatch.setattr(ProgramChoice, "next_trial", next_trial)
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    batch = USER_ITEM_MLP.batch([3, 2], seed=1)
    with torch.no_grad():
        cm(**batch.replicated())
        cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    assert margins == [("dropin", program_choice.DROPIN_MARGIN), ("shared", 0.0)]


def test_once_a_row_count_shares_its_other_buckets_compare_without_a_margin(monkeypatch):
    """Every call of the row count then finds requests: neither the margin nor the time to find
    them favours a program."""
    seen = []
    real = ProgramChoice.run

    def run(self, key, shared, plain, settle=None, shared_extra=0.0, margin=0.0, clock=None):
        seen.append((key, shared_extra, margin))
        return real(self, key, shared, plain, settle, shared_extra, margin, clock)

    monkeypatch.setattr(ProgramChoice, "run", run)
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    two, four = USER_ITEM_MLP.batch([3, 3], seed=1), USER_ITEM_MLP.batch([2, 2, 1, 1], seed=2)
    with torch.no_grad():
        cm(**two.replicated())  # 6 rows, 2 requests: the first trial, nothing shares yet
        cm._choice.settle(bucket("dropin", 6, 2), SHARED)
        cm(**four.replicated())  # 6 rows, 4 requests: another bucket of the row count
    (first, extra_first, margin_first), (second, extra_second, margin_second) = seen
    assert first == bucket("dropin", 6, 2) and second == bucket("dropin", 6, 4)
    assert extra_first > 0 and margin_first == program_choice.DROPIN_MARGIN
    assert extra_second == 0.0 and margin_second == 0.0


def test_buckets_round_sizes_up_to_powers_of_two():
    assert bucket("shared", 9, 2) == bucket("shared", 15, 3) != bucket("shared", 16, 3)
    assert bucket("dropin", 1024) != bucket("shared", 1024, 0)


@pytest.mark.parametrize("fast", [SHARED, PLAIN])
def test_a_bucket_keeps_the_program_its_calls_measured_faster(monkeypatch, fast):
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    batch = USER_ITEM_MLP.batch([3, 1, 2], seed=4, shuffle=True)
    ran = []
    real_plain, real_run = lanes.run_plain, lanes.run
    clock_value = [0.0]

    def fake_now():
        return clock_value[0]

    def plain(*args):
        ran.append(PLAIN)
        clock_value[0] += 1.0 if fast == PLAIN else 2.0
        return real_plain(*args)

    def shared(*args):
        ran.append(SHARED)
        clock_value[0] += 1.0 if fast == SHARED else 2.0
        return real_run(*args)

    def settled(*args):  # a bucket settled on the plain program: ``runtime/call/settled_plain.py``
        result = real_settled(*args)
        if result is not settled_plain.NOT_TAKEN:
            ran.append(PLAIN)
        return result

    real_settled = path.run_settled_plain
    # The settled plain bucket's own measurement against the original model is not this test's
    # (tests/runtime/test_original_arm.py): it keeps the plain program.
    cm._originals.settle(bucket("shared", 6, 3), PROGRAM)
    monkeypatch.setattr(program_choice, "now", fake_now)
    monkeypatch.setattr(choosing, "call_clock", lambda on_cpu=True: fake_now)
    monkeypatch.setattr(choosing, "run_plain", plain)
    monkeypatch.setattr(choosing, "run", shared)
    monkeypatch.setattr(path, "run_settled_plain", settled)
    with torch.no_grad():
        want = model(**batch.replicated())
        for _ in range(2 * TRIALS + 3):
            got = cm(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert ran[: 2 * TRIALS] == [SHARED, PLAIN] * TRIALS
    assert ran[2 * TRIALS :] == [fast] * 3
    assert cm.program_choices() == {bucket("shared", 6, 3): fast}


ZOO_NAMES = ["dlrm", "mmoe", "din", "two_tower"]


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_both_programs_are_exact_on_ragged_batches(name):
    entry = ZOO[name]
    model = entry.build()
    example = entry.make_batch([3, 2]).replicated()
    cm = rocs.compile(model, list(entry.request_inputs), example_kwargs=example)
    batch = entry.make_batch([4, 1, 3], seed=2, shuffle=True)
    with torch.no_grad():
        for _ in range(2 * TRIALS):  # both programs run in each layout's bucket
            check_both_conventions(cm, model, batch, name)
        leaves = cm.contract.leaves((), batch.replicated())
        plain = lanes.run_plain(cm, leaves, None)
    expected = model(**batch.replicated())
    torch.testing.assert_close(plain, expected, rtol=0, atol=0)  # the model's own ops


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.user, self.item = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, user, item):
        return ((self.user(user) * self.scale) * self.item(item)).sum(-1), self.scale


def test_the_plain_program_follows_weights_and_moves():
    model = _Scaled().eval()
    user, item = torch.randn(5, 4), torch.randn(5, 4)
    cm = rocs.compile(model, ["user"], example_kwargs={"user": user, "item": item})
    leaves = {"user": user, "item": item}
    with torch.no_grad():
        model.user.weight.mul_(3.0)  # in place
        model.item.bias = nn.Parameter(torch.randn(4))  # reassigned
        got, scale = lanes.run_plain(cm, dict(leaves), None)
        want, want_scale = model(user, item)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert torch.equal(scale, want_scale) and scale is not model.scale  # a copy, not ours
        cm.to(torch.float64)
        model.to(torch.float64)
        got, _ = lanes.run_plain(cm, {"user": user.double(), "item": item.double()}, None)
        torch.testing.assert_close(got, model(user.double(), item.double())[0])


def test_autotune_off_keeps_only_the_shared_program():
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model, options={"autotune": False})
    batch = USER_ITEM_MLP.batch([2, 2], seed=1)
    with torch.no_grad():
        for _ in range(2 * TRIALS + 1):
            check_both_conventions(cm, model, batch, "autotune off")
    assert cm._plain is None and cm.program_choices() == {}


def test_a_row_count_whose_buckets_all_chose_plain_is_a_plain_row_class():
    choice = ProgramChoice(trials=2)
    row_class = bucket("dropin", 16)[:2]
    for requests, plain_faster in ((1, True), (4, True)):
        key = bucket("dropin", 16, requests)
        for _ in range(2):
            for program in (SHARED, PLAIN):
                assert choice.next_trial(key) in (SHARED, PLAIN)
                fast = (program == PLAIN) == plain_faster
                choice.record(key, program, 1.0 if fast else 2.0)
        assert choice.everywhere(row_class) == PLAIN
    key = bucket("dropin", 16, 9)
    choice.next_trial(key)  # a new request count is being measured: no row_class answer
    assert choice.everywhere(row_class) is None
    for _ in range(2):
        for program in (SHARED, PLAIN):
            choice.record(key, program, 1.0 if program == SHARED else 2.0)
    assert choice.everywhere(row_class) is None  # its buckets disagree


def test_call_replicated_takes_part_in_the_choice_and_keeps_its_checks():
    model = USER_ITEM_MLP.build()
    cm = USER_ITEM_MLP.compile(model)
    batch = USER_ITEM_MLP.batch([3, 1, 2], seed=6, shuffle=True)
    replicated, index = batch.replicated(), batch.candidate_to_request
    with torch.no_grad():
        want = model(**replicated)
        for _ in range(2 * TRIALS + 1):
            got = cm.call_replicated(**replicated, candidate_to_request=index)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert bucket("replicated", 6, 3) in cm.program_choices()
        largest = int(torch.bincount(index).argmax())  # the request with 3 candidates
        varying = dict(replicated, user=replicated["user"].clone())
        varying["user"][int((index == largest).nonzero()[-1])] += 1.0
        with pytest.raises(rocs.InputError, match="varies within a request|differ"):
            cm.call_replicated(**varying, candidate_to_request=index)


def test_a_bucket_with_a_clear_flop_gain_is_settled_without_trials(monkeypatch):
    """A history encoder run per candidate would cost many shared calls: one call settles it."""
    entry = ZOO["target_attention"]
    model = entry.build()
    cm = rocs.compile(
        model, list(entry.request_inputs), example_kwargs=entry.make_batch([3, 2]).replicated()
    )
    monkeypatch.setattr(choosing, "run_plain", lambda *a: pytest.fail("the plain program ran"))
    batch = entry.make_batch([300, 200], seed=1)  # grouped: drop-in finds the 2 requests
    with torch.no_grad():
        for _ in range(3):
            check_both_conventions(cm, model, batch, "target_attention")
    assert set(cm.program_choices().values()) == {SHARED}
    small = USER_ITEM_MLP.compile(USER_ITEM_MLP.build())
    with torch.no_grad():
        batch = USER_ITEM_MLP.batch([2, 1], seed=2)
        small(**batch.kwargs, candidate_to_request=batch.candidate_to_request)
    assert small.program_choices() == {}  # a small bucket is measured first


def test_a_bucket_with_nothing_to_share_keeps_the_plain_program_unless_shared_clearly_leads():
    """FLOP ideal below ``LOW_GAIN``: the shared program is the plain one rewritten, and a lead
    smaller than ``LOW_GAIN_MARGIN`` in five timed calls is noise."""
    assert program_choice.margin_for(1.0) == program_choice.LOW_GAIN_MARGIN
    assert program_choice.margin_for(1.0, 0.10) == 0.10  # a larger margin stands
    assert program_choice.margin_for(0.0) == 0.0  # no FLOP count: measured as it is
    assert program_choice.margin_for(3.0) == 0.0

    class NoShare(nn.Module):  # the request features enter through a product: nothing shares
        def __init__(self):
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, u, c):
            return self.mlp(u * c).squeeze(-1)

    torch.manual_seed(0)
    u, c = torch.randn(2, 8), torch.randn(5, 8)
    index = torch.tensor([0, 0, 0, 1, 1])
    cm = rocs.compile(NoShare().eval(), ["u"], example_kwargs=dict(u=u[index], c=c))
    assert prior.margin(cm, 5, 2) == program_choice.LOW_GAIN_MARGIN
    assert prior.margin(cm, 5, 2, program_choice.DROPIN_MARGIN) == program_choice.DROPIN_MARGIN
    assert prior.margin(USER_ITEM_MLP.compile(USER_ITEM_MLP.build()), 16, 1) == 0.0
