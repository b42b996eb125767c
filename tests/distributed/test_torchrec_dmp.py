"""TorchRec's DistributedModelParallel with the dense part compiled by rocs: a DLRM-like model
whose EmbeddingBagCollections are sharded table-wise (fused SGD in backward) or data-parallel,
trained for 10 steps on 2 ranks (gloo, 127.0.0.1), equals the same DMP without rocs.

Before: the compiled dense part had no parameters, so DMP's data-parallel wrapper neither synced
nor (with an optimizer over ``dmp.named_parameters()``) trained it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec", reason="the DMP test needs torchrec and fbgemm-gpu-cpu")

from dmp_runs import dmp_against_eager  # noqa: E402
from ranks import run_ranks  # noqa: E402

SHARDINGS = ["table_wise", "data_parallel"]


@pytest.mark.slow
def test_dmp_with_a_compiled_dense_part_equals_dmp_without_rocs():
    runs = run_ranks(dmp_against_eager, SHARDINGS, {"autotune": False})
    for rank, results in enumerate(runs):
        for sharding, got in zip(SHARDINGS, results):
            assert set(got["compiled"]) == set(got["eager"])
            for name, want in got["eager"].items():
                torch.testing.assert_close(
                    got["compiled"][name], want, rtol=1e-4, atol=1e-6,
                    msg=lambda m, name=name: f"{sharding} rank {rank} {name}: {m}",
                )  # fmt: skip
