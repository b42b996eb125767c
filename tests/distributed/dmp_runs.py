"""What each rank runs in the TorchRec DMP test: a DLRM-like TorchRec model (an
``EmbeddingBagCollection`` of a user table and an item table, then a dense part) under
``DistributedModelParallel``, its EBC sharded table-wise or data-parallel, trained with the dense
part as it is and compiled by rocs (``model.dense = rocs.compile(model.dense, ...)`` before DMP
shards the model)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import rocs_compiler as rocs

STEPS = 10
COUNTS = [1, 3, 5, 2]
DIM = 8
LR = 0.05


class Dense(nn.Module):
    """The dense part: request features and the user's pooled embedding (a request tower),
    the item's embedding, their interaction and an over arch."""

    def __init__(self):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(4 + DIM, 32), nn.ReLU(), nn.Linear(32, DIM))
        self.over = nn.Sequential(nn.Linear(2 * DIM + 1, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, user_dense, user_emb, item_emb):
        u = self.user(torch.cat([user_dense, user_emb], dim=1))
        dot = (u * item_emb).sum(dim=1, keepdim=True)
        return self.over(torch.cat([u, item_emb, dot], dim=1))


class Gathered(nn.Module):
    """The dense part called in the shared layout without rocs: request rows gathered to one
    per candidate, then the dense part as written (eager's meaning of the shared layout)."""

    def __init__(self, dense: nn.Module):
        super().__init__()
        self.dense = dense

    def forward(self, user_dense, user_emb, item_emb, candidate_to_request):
        idx = candidate_to_request
        return self.dense(user_dense[idx], user_emb[idx], item_emb)


class DLRMish(nn.Module):
    """Two EBCs, the user's table pooled once per request (a KJT of R rows) and the items'
    once per candidate, and the dense part called in the shared layout."""

    def __init__(self):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        def tables(name, rows, feature):
            config = EmbeddingBagConfig(
                name=name, embedding_dim=DIM, num_embeddings=rows, feature_names=[feature]
            )
            return EmbeddingBagCollection(tables=[config], device=torch.device("cpu"))

        self.user_tables = tables("t_user", 50, "user_id")
        self.item_tables = tables("t_item", 80, "item_id")
        self.dense = Gathered(Dense())

    def forward(self, user_dense, user_kjt, item_kjt, candidate_to_request):
        user = self.user_tables(user_kjt).values()  # [R, DIM]
        item = self.item_tables(item_kjt).values()  # [N, DIM]
        return self.dense(user_dense, user, item, candidate_to_request=candidate_to_request)


def _kjt(key: str, ids: torch.Tensor):
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(
        keys=[key], values=ids, lengths=torch.ones(len(ids), dtype=torch.int32)
    )


def batch(rank: int, step: int):
    """(user dense rows [R, 4], user KJT [R], item KJT [N], candidate_to_request [N])."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    index = torch.repeat_interleave(torch.arange(len(COUNTS)), torch.tensor(COUNTS))
    index = index[torch.randperm(len(index), generator=gen)]
    users = torch.randint(0, 50, (len(COUNTS),), generator=gen)
    items = torch.randint(0, 80, (len(index),), generator=gen)
    dense = torch.randn(len(COUNTS), 4, generator=gen)
    return dense, _kjt("user_id", users), _kjt("item_id", items), index


def _dense_example():
    gen = torch.Generator().manual_seed(7)
    index = torch.tensor([0, 0, 1, 1, 1])
    return {
        "user_dense": torch.randn(2, 4, generator=gen)[index],
        "user_emb": torch.randn(2, DIM, generator=gen)[index],
        "item_emb": torch.randn(5, DIM, generator=gen),
    }


def compile_dense(model: DLRMish, **options) -> None:
    """The dense part compiled for training, in place of its eager gathering (a TorchRec
    user's one line, before DMP shards the model)."""
    model.dense = rocs.compile(
        model.dense.dense, ["user_dense", "user_emb"], example_kwargs=_dense_example(),
        training=True, options=options,
    )  # fmt: skip


def _dmp(model: nn.Module, sharding: str):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    # On CPU TorchRec shards an EBC table-wise with the fused kernel (SGD applied in backward,
    # fbgemm) and data-parallel with the dense one (tables as plain parameters).
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


def _local(value):
    if hasattr(value, "local_shards"):  # ShardedTensor
        shards = value.local_shards()
        return torch.cat([s.tensor.flatten() for s in shards]) if shards else torch.zeros(0)
    if hasattr(value, "to_local"):
        return value.to_local()
    return value


def _train(dmp, rank: int) -> dict:
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=LR),
    )
    opt = CombinedOptimizer([dmp.fused_optimizer, dense])
    for step in range(STEPS):
        dense, users, items, index = batch(rank, step)
        out = dmp(dense, users, items, index)
        ((out.squeeze(-1) - index.float() / 4) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    # The eager model's dense part sits one level deeper (``Gathered``).
    state = dmp.state_dict().items()
    return {k.replace("dense.dense.", "dense."): _local(v).detach().clone() for k, v in state}


def dmp_against_eager(rank: int, world: int, shardings: list, options: dict) -> list:
    results = []
    for sharding in shardings:
        torch.manual_seed(0)
        model = DLRMish()
        eager = copy.deepcopy(model)
        compile_dense(model, **options)
        run = {}
        for name, net in (("eager", eager), ("compiled", model)):
            torch.manual_seed(1)  # sharding draws the tables' values afresh
            run[name] = _train(_dmp(net, sharding), rank)
        results.append(run)
    return results
