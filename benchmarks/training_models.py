"""The models ``training.py`` and its DDP column (``training_ddp.py``) train, built the same way
in both, and the loss and warm-up count they share."""

from __future__ import annotations

import torch

import rocs_compiler as rocs
from models_zoo import ZOO
from rocs_compiler.runtime.choice.program_choice import TRAINING_TRIALS

WARMUP = 2 * TRAINING_TRIALS + 1  # calls per shape before timing: through the choice's trials


def build(name: str):
    """(model in training mode, zoo entry) for ``name``: a zoo name, or ``glm:NAME`` /
    ``dca:NAME`` for its GLM / DCA conversion."""
    kind, _, zoo_name = name.rpartition(":")
    entry = ZOO[zoo_name]
    model = entry.build(seed=0)
    torch.manual_seed(1)
    example = {"example_kwargs": entry.make_batch([2, 3], seed=1).replicated()}
    if kind == "glm":
        model = rocs.apply_glm(model, entry.request_inputs, **example)
    elif kind == "dca":
        model = rocs.apply_dca(model, entry.request_inputs, **example)
    return model.train(), entry


def loss_of(out) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if t.is_floating_point()]
    return sum((t.float() ** 2).mean() for t in leaves)
