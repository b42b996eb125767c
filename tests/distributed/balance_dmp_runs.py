"""What each rank runs in the balanced DMP test: ``dmp_runs``'s DLRM-like TorchRec model (its
EBCs sharded table-wise or data-parallel, the dense part compiled by rocs) trained on batches
balanced by ``rocs.RequestBalancer``; and the oracle, the same model unsharded and eager in one
process on the union of the ranks' batches.

The user's and the items' ids travel as plain tensors of a row per request and per candidate
(one id each); each rank builds its KeyedJaggedTensors after the exchange. Every gradient is
right with the balancer's loss weights alone: DMP's data-parallel wrapper averages the dense
part's and the data-parallel tables' gradients over the ranks, and the table-wise tables' fused
SGD steps on gradients TorchRec averages the same way (with the tables' learning rate halved,
they end 1e-4 apart).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dmp_runs import LR, DLRMish, _kjt, _local, compile_dense

import rocs_compiler as rocs
from rocs_compiler.distributed.batch import RequestBatch, concat

STEPS = 10


def batch(rank: int, step: int) -> RequestBatch:
    """2..6 requests of 1..8 candidates, shuffled; a label per candidate."""
    g = torch.Generator().manual_seed(31 * rank + 1009 * step + 5)
    requests = int(torch.randint(2, 7, (1,), generator=g))
    counts = torch.randint(1, 9, (requests,), generator=g)
    index = torch.repeat_interleave(torch.arange(requests), counts)
    index = index[torch.randperm(index.shape[0], generator=g)]
    n = index.shape[0]
    return RequestBatch(
        request={
            "user_dense": torch.randn(requests, 4, generator=g),
            "user_id": torch.randint(0, 50, (requests,), generator=g),
        },
        candidate={
            "item_id": torch.randint(0, 80, (n,), generator=g),
            "label": torch.randint(0, 2, (n,), generator=g).float(),
        },
        candidate_to_request=index,
    )


def _call(net, b: RequestBatch) -> torch.Tensor:
    """The model on ``b`` in its layout: shared (a user row per request and the index), or
    drop-in (every row a candidate's, the user's rows replicated, each row its own request)."""
    if b.layout == "dropin":
        rows = b.inputs(leave_out=["label"])
        users, items = _kjt("user_id", rows["user_id"]), _kjt("item_id", rows["item_id"])
        own = torch.arange(rows["item_id"].shape[0])
        return net(rows["user_dense"], users, items, own).squeeze(-1)
    users, items = _kjt("user_id", b.request["user_id"]), _kjt("item_id", b.candidate["item_id"])
    return net(b.request["user_dense"], users, items, b.candidate_to_request).squeeze(-1)


def loaded(rank: int, step: int, layout: str) -> RequestBatch:
    """:func:`batch` as the loader gives it in ``layout`` (drop-in: every row replicated, read
    back with the request of each row)."""
    b = batch(rank, step)
    if layout == "shared":
        return b
    return RequestBatch.from_replicated(
        b.replicated(), ["user_dense", "user_id"], b.candidate_to_request
    )


def _dmp(model, sharding: str):
    """``dmp_runs._dmp``: the EBCs sharded ``sharding``, fused SGD at :data:`LR`."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    kernel = "dense" if sharding == "data_parallel" else "fused"
    constraints = {
        t: ParameterConstraints(sharding_types=[sharding], compute_kernels=[kernel])
        for t in ("t_user", "t_item")
    }
    topology = Topology(world_size=dist.get_world_size(), compute_device="cpu")
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    sharders = [EmbeddingBagCollectionSharder(fused_params=fused)]
    plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
        model, sharders, dist.GroupMember.WORLD
    )
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)


def _state(dmp) -> dict:
    return {k.replace("dense.dense.", "dense."): _local(v).detach().clone()
            for k, v in dmp.state_dict().items()}  # fmt: skip


def balanced_dmp(rank: int, world: int, configs: list) -> list:
    """Per ``(sharding, policy, layout)``: this rank's state before and after :data:`STEPS` SGD
    steps of DMP on balanced batches, and each step's (requests, candidates, layout)."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    results = []
    for sharding, policy, layout in configs:
        torch.manual_seed(0)
        model = DLRMish()
        compile_dense(model, autotune=False)
        torch.manual_seed(1)
        dmp = _dmp(model, sharding)  # sharding draws the tables afresh
        before = _state(dmp)
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())),
            lambda params: torch.optim.SGD(params, lr=LR),
        )
        opt = CombinedOptimizer([dmp.fused_optimizer, dense])
        balancer = rocs.RequestBalancer(model.dense, policy=policy)
        counts = []
        for step in range(STEPS):
            local = balancer.balance(loaded(rank, step, layout))
            out = _call(dmp, local)
            label = local.candidate["label"]
            losses = F.binary_cross_entropy_with_logits(out, label, reduction="none")
            local.global_mean(losses).backward()
            opt.step()
            opt.zero_grad()
            counts.append((local.num_requests, local.num_candidates, local.layout))
        results.append({"before": before, "after": _state(dmp), "counts": counts})
    return results


def single_process(before: dict, world: int) -> dict:
    """The unsharded model, eager, from ``before`` (every rank's shards joined), after
    :data:`STEPS` SGD steps on the union of the ranks' batches with the mean loss."""
    torch.manual_seed(0)
    model = DLRMish()
    state = model.state_dict().items()
    model.load_state_dict(
        {name: before[name.replace("dense.dense.", "dense.")].reshape(v.shape) for name, v in state}
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        union = concat([batch(rank, step) for rank in range(world)])
        label = union.candidate["label"]
        F.binary_cross_entropy_with_logits(_call(model, union), label).backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict().items()
    return {k.replace("dense.dense.", "dense."): v.detach().clone() for k, v in state}


def joined(states: list[dict]) -> dict:
    """Every rank's state joined: a table sharded whole onto one rank taken from that rank."""
    out = {}
    for key in states[0]:
        values = [s[key] for s in states if s[key].numel()]
        out[key] = values[0]
    return out
