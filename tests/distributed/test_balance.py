"""``rocs.RequestBalancer``: whole requests exchanged between data-parallel ranks so that their
predicted step costs are equal (``rocs_compiler/distributed/``).

Unit tests play the exchange in one process (``balance_runs.exchange_in_process``): every request
lands whole on exactly one rank, "cost" balances at least as well as "count" on heavy-tailed
costs, both are deterministic, a rank without requests works, and bad batches are refused naming
the culprit. The DDP test runs 2 gloo ranks on 127.0.0.1: DDP of the compiled DIN on balanced
batches, 10 SGD steps, equals the eager DIN trained in one process on the union of the ranks'
batches, for both policies and both layouts; without the balancer's loss weights it does not.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from balance_runs import (
    HISTORIES,
    balanced_ddp,
    compiled_din,
    din_batch,
    exchange_in_process,
    single_process,
)
from ranks import run_ranks

import rocs_compiler as rocs
from rocs_compiler.distributed.balance import gathered_requests, request_stats
from rocs_compiler.distributed.checks import check_batch
from rocs_compiler.distributed.costs import (
    LinearCost,
    calibrated_cost,
    flops_cost,
    history_inputs,
    runs_grouped,
)
from rocs_compiler.distributed.histories import content_lengths
from rocs_compiler.distributed.partition import Requests, loads, partition
from rocs_compiler.runtime.call.jagged_groups import unit_costs
from rocs_compiler.runtime.program.calibration import Calibration, Rates

DIN_COST = LinearCost((19200.0, 5120.0), (57760.0, 21904.0))  # DIN's, as flops_cost reads them
POLICIES = ["count", "cost"]
LAYOUTS = ["shared", "dropin"]


def _heavy_tail(world: int, per_rank: int, padded: bool, seed: int = 0) -> Requests:
    """Lengths 8..2048 (log-normal, median 60), 1..64 candidates, DIN's cost."""
    rng = np.random.default_rng(seed)
    count = world * per_rank
    lengths = np.clip(np.round(np.exp(rng.normal(np.log(60), 1.0, count))), 8, 2048)
    candidates = rng.integers(1, 65, count)
    (ar, br), (ac, bc) = DIN_COST.request, DIN_COST.candidate
    return Requests(
        fixed=ar + candidates * ac,
        per_length=br + candidates * bc,
        lengths=lengths.astype(np.int64),
        candidates=candidates,
        home=np.repeat(np.arange(world), per_rank),
        padded=padded,
    )


def _request_rows(batch) -> dict:
    """``{request id: (history content, sorted candidate item ids)}`` of a batch."""
    rows = {}
    for r, rid in enumerate(batch.request["user_profile"][:, 0].tolist()):
        items = batch.candidate["item_id"][batch.candidate_to_request == r]
        history = batch.request["hist_item_ids"][r]
        length = int(content_lengths(history[None], 0)[0])
        assert not history[length:].any(), "padding past a request's length"
        rows[rid] = (history[:length].tolist(), sorted(items.tolist()))
    return rows


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("policy", ["keep", *POLICIES])
def test_every_request_lands_whole_on_exactly_one_rank(policy, layout):
    for step in range(4):
        batches = [din_batch(rank, step, layout=layout) for rank in range(2)]
        out, part = exchange_in_process(batches, DIN_COST, policy)
        want = {}
        for b in batches:
            want.update(_request_rows(b))
        got = {}
        for rank, b in enumerate(out):
            rows = _request_rows(b)
            assert not set(rows) & set(got), "a request on two ranks"
            got.update(rows)
            assert b.layout == layout
            assert b.num_requests == int((part.ranks == rank).sum())
            # A rank's histories are as wide as its longest request.
            if b.num_requests:
                width = b.request["hist_item_ids"].shape[1]
                assert width == int(content_lengths(b.request["hist_item_ids"], 0).max())
        assert got == want  # same requests, each with all its candidates and its history


def test_cost_policy_balances_at_least_as_well_as_count_on_heavy_tailed_costs():
    for padded in (False, True):
        for world, per_rank in [(2, 16), (8, 128)]:
            requests = _heavy_tail(world, per_rank, padded)
            top = {p: partition(requests, world, p).loads.max() for p in ["keep", *POLICIES]}
            assert top["cost"] <= top["count"], (padded, world, top)
            assert top["cost"] < top["keep"], (padded, world, top)
            if not padded:  # equal cost to a part in ten thousand
                assert top["cost"] <= 1.0001 * requests.own.sum() / world


def test_count_policy_deals_equal_counts():
    requests = _heavy_tail(8, 100, padded=True)
    counts = np.bincount(partition(requests, 8, "count").ranks, minlength=8)
    assert counts.tolist() == [100] * 8


def test_partitions_are_deterministic_and_keep_requests_home_where_they_can():
    requests = _heavy_tail(8, 64, padded=True, seed=3)
    for policy in POLICIES:
        first, again = partition(requests, 8, policy), partition(requests, 8, policy)
        assert np.array_equal(first.ranks, again.ranks) and first.algorithm == again.algorithm
    batches = [din_batch(rank, 5) for rank in range(2)]
    for policy in POLICIES:
        out, _ = exchange_in_process(batches, DIN_COST, policy)
        again, _ = exchange_in_process(batches, DIN_COST, policy)
        for a, b in zip(out, again):
            assert torch.equal(a.candidate_to_request, b.candidate_to_request)
            assert all(torch.equal(a.request[n], b.request[n]) for n in a.request)
    # Already balanced: nothing moves.
    even = _heavy_tail(2, 1, padded=False)
    same = Requests(even.fixed[[0, 0]], even.per_length[[0, 0]], even.lengths[[0, 0]],
                    even.candidates[[0, 0]], np.array([0, 1]), False)  # fmt: skip
    assert partition(same, 2, "cost").ranks.tolist() == [0, 1]


def test_a_rank_without_requests_gets_some_and_an_empty_world_works():
    empty = din_batch(1, 0)  # rank 1 loads no requests at step 0
    assert empty.num_requests == 0
    for policy in POLICIES:
        out, _ = exchange_in_process([din_batch(0, 0), empty], DIN_COST, policy)
        assert out[1].num_requests > 0 and out[0].num_requests > 0
    nothing = gathered_requests([torch.zeros(0, 4), torch.zeros(0, 4)], padded=True)
    for policy in POLICIES:
        part = partition(nothing, 2, policy)
        assert part.ranks.shape == (0,) and part.loads.tolist() == [0.0, 0.0]
    # More ranks than requests: some ranks get none; as many: every rank gets one.
    few = _heavy_tail(1, 3, padded=True)
    assert sorted(np.bincount(partition(few, 5, "cost").ranks, minlength=5)) == [0, 0, 1, 1, 1]
    for policy in POLICIES:
        assert sorted(np.bincount(partition(few, 3, policy).ranks, minlength=3)) == [1, 1, 1]


def test_loss_scales_make_the_mean_of_the_ranks_losses_the_global_mean():
    batches = [din_batch(rank, 2) for rank in range(2)]
    losses = [torch.rand(b.num_candidates, generator=torch.Generator().manual_seed(r))
              for r, b in enumerate(batches)]  # fmt: skip
    total = sum(b.num_candidates for b in batches)
    want = torch.cat(losses).mean()
    scaled = [b.__class__(b.request, b.candidate, b.candidate_to_request, world=2,
                          total_candidates=total) for b in batches]  # fmt: skip
    got = sum(b.global_mean(x) for b, x in zip(scaled, losses)) / 2
    torch.testing.assert_close(got, want)


def test_the_dropin_layout_round_trips():
    shared = din_batch(0, 4)
    dropin = din_batch(0, 4, layout="dropin")
    assert dropin.layout == "dropin"
    got = dropin.inputs(leave_out=["label"])
    want = shared.replicated(leave_out=["label"])
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert "candidate_to_request" in shared.inputs()


def _refusal(batch, **kwargs) -> str:
    with pytest.raises(rocs.InputError) as err:
        rocs.RequestBalancer(DIN_COST, histories=HISTORIES, **kwargs).balance(batch)
    return str(err.value)


def _with(batch, **fields):
    return batch.__class__(**{**batch.__dict__, **fields})


def test_refusals_name_the_culprit():
    batch = din_batch(0, 6, requests=4)
    index = batch.candidate_to_request
    keep = index != 2
    no_candidates = _with(
        batch,
        candidate={n: v[keep] for n, v in batch.candidate.items()},
        candidate_to_request=index[keep],
    )
    message = _refusal(no_candidates)
    assert "rank 0" in message and "request 2 has no candidates" in message
    width = batch.request["hist_item_ids"].shape[1]
    lengths = content_lengths(batch.request["hist_item_ids"], 0)
    too_long = lengths.clone()
    too_long[1] = width + 3
    message = _refusal(_with(batch, lengths=too_long))
    assert f"{width + 3} for request 1, past the histories' width {width}" in message
    too_short = lengths.clone()
    too_short[3] -= 1
    message = _refusal(_with(batch, lengths=too_short))
    assert "for request 3, but its histories hold ids up to position" in message
    message = _refusal(_with(batch, lengths=lengths[:2]))
    assert "a row per request (4)" in message
    rows = dict(batch.request, user_profile=batch.request["user_profile"][:3])
    message = _refusal(_with(batch, request=rows))
    assert "request input 'hist_item_ids' has 4 rows, input 'user_profile' 3" in message
    rows = dict(batch.candidate, item_cat=batch.candidate["item_cat"][1:])
    message = _refusal(_with(batch, candidate=rows))
    assert "candidate input 'item_cat' has" in message and "candidate_to_request" in message
    message = _refusal(_with(batch, candidate_to_request=index.clamp(max=2) + 2))
    assert "belongs to request 4, but the batch has 4 requests" in message
    message = _refusal(_with(batch, candidate_to_request=index.int()))
    assert "int64" in message
    # Given lengths that agree with the ids are taken.
    assert rocs.RequestBalancer(DIN_COST, histories=HISTORIES).balance(
        _with(batch, lengths=lengths)
    )


def test_dropin_rows_of_one_request_must_agree():
    shared = din_batch(0, 7, requests=3)
    rows = shared.replicated()
    ids = shared.candidate_to_request
    request = int((torch.bincount(ids) > 1).nonzero()[0])  # one with two rows or more
    row = int((ids == request).nonzero()[-1])
    rows["hist_cat_ids"] = rows["hist_cat_ids"].clone()
    rows["hist_cat_ids"][row, 0] += 1
    match = f"of request {request} differ in request input 'hist_cat_ids'"
    with pytest.raises(rocs.InputError, match=match):
        rocs.RequestBatch.from_replicated(rows, ["user_profile", *HISTORIES], ids)


def test_costs_and_histories_are_read_from_a_compiled_model():
    _, cm = compiled_din()
    assert history_inputs(cm) == HISTORIES
    result = cm.pipeline_result
    size = result.length_sizes()[HISTORIES[0]]
    units = unit_costs(result, HISTORIES[0], int(size.node.hint))
    cost = flops_cost(cm)
    assert cost == LinearCost(tuple(units.request), tuple(units.candidate))
    assert cost == DIN_COST  # the constant the other tests use
    lengths, counts = torch.tensor([1, 10, 100]), torch.tensor([1, 2, 3])
    per_request, per_candidate = result.unit_flops({HISTORIES[0]: 10})
    assert float(cost(lengths, counts)[1]) == pytest.approx(per_request + 2 * per_candidate)
    balancer = rocs.RequestBalancer(cm)
    # The training compile's calls group requests by length, so no rank pads to its longest.
    assert balancer.histories == HISTORIES and runs_grouped(cm)
    assert balancer.grouped and not balancer.padded
    assert rocs.RequestBalancer(cm, grouped=False).padded
    with pytest.raises(ValueError, match="disagree"):
        rocs.RequestBalancer(cm, grouped=True, padded=True)


def test_a_grouped_rank_costs_each_request_at_its_power_of_two_width_at_most_its_longest():
    checked = check_batch(din_batch(0, 3), HISTORIES, 0)
    stats = request_stats(checked, DIN_COST)
    grouped = gathered_requests([stats], padded=False, grouped=True)
    lengths = checked.lengths
    widths = 2 ** torch.ceil(torch.log2(lengths.clamp(min=1).double()))
    assert np.array_equal(grouped.widths, widths.long().numpy())
    torch.testing.assert_close(
        torch.from_numpy(grouped.own), DIN_COST(widths, checked.counts), check_dtype=False
    )
    # Two ranks: the one holding lengths 3 and 5 runs them at widths 4 and 5 (its longest), the
    # other runs 100 at 100 (not 128) and 40 at 64.
    four = Requests(
        fixed=np.array([1.0, 2.0, 3.0, 4.0]), per_length=np.array([10.0, 20.0, 30.0, 40.0]),
        lengths=np.array([3, 5, 100, 40]), candidates=np.ones(4, dtype=np.int64),
        home=np.zeros(4, dtype=np.int64), padded=False, widths=np.array([4, 8, 128, 64]),
    )  # fmt: skip
    want = [1 + 10 * 4 + 2 + 20 * 5, 3 + 30 * 100 + 4 + 40 * 64]
    assert loads(four, np.array([0, 0, 1, 1]), 2).tolist() == want


def _uniform(**rates) -> Calibration:
    """Every family priced by the same ``rates``; no memory or launch terms."""
    families = ("gemm", "bmm", "attention", "gather", "memory", "view", "elementwise")
    return Calibration({family: Rates(**rates) for family in families})


def test_a_calibrated_cost_is_the_compiled_graphs_priced_work_per_request_and_candidate():
    _, cm = compiled_din()
    flops = flops_cost(cm)
    # Priced at a nanosecond a FLOP, the calibrated cost (ms) is the FLOP count / 1e6.
    by_flops = calibrated_cost(cm, _uniform(flops_s=1e-9))
    got = (*by_flops.request, *by_flops.candidate)
    want = (*flops.request, *flops.candidate)
    assert got == pytest.approx([w * 1e-6 for w in want], rel=0.1)
    lengths, counts = torch.tensor([8, 60, 700]), torch.tensor([1, 20, 64])
    predicted, counted = by_flops(lengths, counts), flops(lengths, counts) * 1e-6
    torch.testing.assert_close(predicted, counted, rtol=0.1, atol=0)
    # Priced per launch only, every op runs once per call whatever its rows: a call's fixed
    # cost, the same on every rank, so nothing is left per request or candidate.
    by_launch = calibrated_cost(cm, _uniform(ops_s=1e-5))
    assert max(*by_launch.request, *by_launch.candidate) < 1e-9
    with pytest.raises(TypeError, match="compiled model"):
        rocs.RequestBalancer(DIN_COST, calibration=_uniform(flops_s=1e-9))


# DDP: policies x layouts with the loss weights, then "cost" without them (the honesty check: it
# must not match). Not "keep": rank 1 loads no requests at step 0, and the compiled DIN's
# training backward fails on an empty batch (``runtime/training/table_gradients.py``).
CONFIGS = [(p, layout, True) for p in POLICIES for layout in LAYOUTS] + [("cost", "shared", False)]


@pytest.fixture(scope="module")
def ddp_runs():
    return run_ranks(balanced_ddp, CONFIGS, timeout=400.0)


@pytest.fixture(scope="module")
def oracle():
    return single_process(world=2)


def test_a_balanced_ddp_step_equals_a_single_process_step_on_the_union(ddp_runs, oracle):
    for i, config in enumerate(CONFIGS[:-1]):
        for rank, result in enumerate(ddp_runs):
            got = result["runs"][i]["params"]
            for name, want in oracle.items():
                torch.testing.assert_close(
                    got[name], want, rtol=1e-4, atol=1e-6,
                    msg=lambda m, where=f"{config} rank {rank} {name}": f"{where}: {m}",
                )  # fmt: skip
    # The exchange moved requests: with "cost" the ranks' counts differ from what they loaded,
    # and rank 1, which loaded none at step 0, got some.
    for i, (policy, layout, _) in enumerate(CONFIGS[:4]):
        counts = [result["runs"][i]["counts"] for result in ddp_runs]
        assert counts[1][0][0] > 0
        assert all(c[2] == layout for rank in counts for c in rank)
        loaded = [[din_batch(r, s).num_requests for s in range(10)] for r in range(2)]
        moved = [[c[0] for c in rank] for rank in counts]
        assert moved != loaded, policy
        if policy == "count":
            assert all(abs(a[0] - b[0]) <= 1 for a, b in zip(*counts))


def test_without_the_loss_weights_the_cost_policy_does_not_match(ddp_runs, oracle):
    got = ddp_runs[0]["runs"][-1]["params"]
    far = max(float((got[n] - want).abs().max()) for n, want in oracle.items())
    assert far > 1e-4, far  # the weighted runs are within 1e-7


@pytest.mark.slow
def test_balanced_dmp_equals_a_single_process_step_on_the_union():
    """TorchRec's DMP (EBCs sharded table-wise with fused SGD, or data-parallel; the dense part
    compiled) on balanced batches equals the unsharded eager model trained on the union: both
    policies, both layouts (drop-in: the user's rows replicated per candidate)."""
    pytest.importorskip("torchrec", reason="the DMP test needs torchrec and fbgemm-gpu-cpu")
    from balance_dmp_runs import balanced_dmp, joined
    from balance_dmp_runs import single_process as dmp_single_process

    configs = [
        ("table_wise", "cost", "shared"),
        ("table_wise", "count", "dropin"),
        ("data_parallel", "count", "shared"),
        ("data_parallel", "cost", "dropin"),
    ]
    runs = run_ranks(balanced_dmp, configs, timeout=800.0)
    for i, config in enumerate(configs):
        want = dmp_single_process(joined([r[i]["before"] for r in runs]), world=2)
        got = joined([r[i]["after"] for r in runs])
        for name, value in want.items():
            torch.testing.assert_close(
                got[name].reshape(value.shape), value, rtol=1e-4, atol=1e-6,
                msg=lambda m, where=f"{config} {name}": f"{where}: {m}",
            )  # fmt: skip
        assert [c[0] for c in runs[0][i]["counts"]] != [c[0] for c in runs[1][i]["counts"]]
        assert all(c[2] == config[2] for r in runs for c in r[i]["counts"])


def test_refusals_are_raised_on_every_rank_naming_the_rank(ddp_runs):
    for result in ddp_runs:
        no_candidates, dtype = result["refusals"]
        assert "rank 1: request 2 has no candidates" in no_candidates, no_candidates
        assert "rank 1's batch differs from rank 0's" in dtype and "item_cat" in dtype, dtype


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(["padded", "grouped", "own"]),
    world=st.integers(2, 4),
    count=st.integers(2, 12),
)
def test_the_local_search_weighs_each_move_and_swap_as_the_loads_do(seed, mode, world, count):
    """Every move and swap ``refine`` weighs in closed form gives the larger of the two loads it
    touches exactly as ``loads`` computes them after it, in the three load models."""
    from rocs_compiler.distributed.refine import _move, _Ranks, _swap, _Unit

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, count)
    requests = Requests(
        fixed=rng.uniform(0, 5, count), per_length=rng.uniform(0, 2, count), lengths=lengths,
        candidates=np.ones(count, dtype=np.int64), home=np.zeros(count, dtype=np.int64),
        padded=mode == "padded",
        widths=2 ** np.ceil(np.log2(lengths)).astype(np.int64) if mode == "grouped" else None,
    )  # fmt: skip
    parts = rng.integers(0, world, count)
    unit = _Unit(requests.fixed, requests.per_length, requests.lengths, requests.run_widths)
    ranks = _Ranks.of(unit, parts, world)
    np.testing.assert_allclose(ranks.load, loads(requests, parts, world))
    src = int(np.argmax(ranks.load))
    members = np.nonzero(parts == src)[0]
    load, moved, dest, _ = _move(unit, ranks, src, members)
    after = parts.copy()
    after[moved] = dest
    assert load == pytest.approx(max(loads(requests, after, world)[[src, dest]]))
    for dest in range(world):
        others = np.nonzero(parts == dest)[0]
        if dest == src or not others.shape[0]:
            continue
        load, mine, _, theirs = _swap(unit, ranks, src, members, dest, others)
        after = parts.copy()
        after[mine], after[theirs] = dest, src
        assert load == pytest.approx(max(loads(requests, after, world)[[src, dest]]))
