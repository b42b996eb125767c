"""Building blocks shared by the zoo models, written the way model code usually has them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn


class MLP(nn.Sequential):
    """Linear layers with an activation between them; `dims` includes the output width.

    The last layer has no activation unless `last_activation` is set (bottom MLPs that feed
    an interaction usually end in one, prediction heads do not).
    """

    def __init__(
        self,
        in_dim: int,
        dims: Sequence[int],
        *,
        activation: Callable[[], nn.Module] = nn.ReLU,
        dropout: float = 0.0,
        last_activation: bool = False,
    ):
        layers: list[nn.Module] = []
        for i, out_dim in enumerate(dims):
            layers.append(nn.Linear(in_dim, out_dim))
            if i < len(dims) - 1 or last_activation:
                layers.append(activation())
                if dropout > 0:
                    layers.append(nn.Dropout(dropout))
            in_dim = out_dim
        super().__init__(*layers)


def embedding(num: int, dim: int, *, padding_idx: int | None = None) -> nn.Embedding:
    """An embedding table with rows of about unit norm, as trained tables tend to have."""
    table = nn.Embedding(num, dim, padding_idx=padding_idx)
    nn.init.normal_(table.weight, std=1.0 / math.sqrt(dim))
    if padding_idx is not None:
        with torch.no_grad():
            table.weight[padding_idx].zero_()
    return table


def fan_in_weights(
    model: nn.Module, seed: int, *, gain: float = 1.0, extra: Sequence[nn.Parameter] = ()
) -> nn.Module:
    """Re-draw every linear layer's weight (and each ``extra`` weight laid out ``[in, out]``)
    from N(0, gain / fan_in) and every embedding table from N(0, 1 / dim), deterministically
    from ``seed``, in place.

    Embedding rows then have about unit norm and linear layers keep the scale of their input
    (``gain=2`` makes up for what a ReLU drops), so scores vary across candidates and requests
    as a trained model's do. Biases, other weights and padding rows (kept at zero) stay.
    """
    g = torch.Generator().manual_seed(seed)

    def redraw(weight: torch.Tensor, variance: float) -> None:
        weight.copy_(torch.randn(weight.shape, generator=g) * math.sqrt(variance))

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                redraw(module.weight, gain / module.in_features)
            elif isinstance(module, nn.Embedding):
                redraw(module.weight, 1.0 / module.embedding_dim)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
        for weight in extra:
            redraw(weight, gain / weight.shape[0])
    return model


def seeded(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """Build `factory()` with weights drawn from `seed`, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory()
    return model.eval()
