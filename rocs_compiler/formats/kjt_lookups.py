"""A TorchRec model whose embedding collections take the padded KJT (``kjt_padded.py``):
``EmbeddingBagCollection`` pools padded rows (``kjt_pooling.py``), ``EmbeddingCollection`` looks
them up (``kjt_sequences.py``); the modules on the way are shallow copies, parameters and
buffers the model's own, so weight updates are seen. The copies are named with the user's
modules they stand in for: the compiled model follows and guards the user's model through them
(``Prepared.watched``), so a module the user replaces later is seen, never the copy's old one."""

from __future__ import annotations

import copy

from torch import nn

from ..errors import CompileError
from .kjt_pooling import PaddedEmbeddingBagCollection
from .kjt_sequences import PaddedEmbeddingCollection


def _collections(model: nn.Module) -> dict[str, type]:
    """The paths of ``model``'s TorchRec collections, each with the module that replaces it."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    replaced = {
        EmbeddingBagCollection: PaddedEmbeddingBagCollection,
        EmbeddingCollection: PaddedEmbeddingCollection,
    }
    return {
        path: replaced[type(module)]
        for path, module in model.named_modules()
        if type(module) in replaced
    }


def with_padded_lookups(model: nn.Module) -> tuple[nn.Module, dict[nn.Module, nn.Module]]:
    """``model`` with every ``EmbeddingBagCollection`` and ``EmbeddingCollection`` taking
    :class:`PaddedKJT` as well, and its stand-ins: each copy with the module it copies.

    The modules from the root to each collection are shallow copies with their own child
    tables; everything else, parameters and buffers included, is the model's own.
    """
    collections = _collections(model)
    if not collections:
        raise CompileError(
            "the model takes a KeyedJaggedTensor but has no torchrec EmbeddingBagCollection or "
            "EmbeddingCollection to look its keys up; rocs compiles KeyedJaggedTensor inputs "
            "read by those"
        )
    if "" in collections:
        return collections[""](model), {}
    root = _copy_module(model)
    stand_ins = {root: model}
    for path, padded in collections.items():
        *parents, leaf = path.split(".")
        parent = root
        for name in parents:
            child = parent._modules[name]
            if child not in stand_ins:
                stand_in = _copy_module(child)
                stand_ins[stand_in] = child
                parent._modules[name] = child = stand_in
            parent = child
        parent._modules[leaf] = padded(parent._modules[leaf])
    return root, stand_ins


def _copy_module(module: nn.Module) -> nn.Module:
    """A shallow copy with its own table of children (parameters and buffers shared)."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    return out
