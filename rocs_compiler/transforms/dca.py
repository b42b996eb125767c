"""``apply_dca``: turn a candidate-appended sequence model into Deep Cross Attention.

Any model whose sequence part is torch's ``nn.TransformerEncoder``, ``nn.TransformerEncoderLayer``
or a self-attention ``nn.MultiheadAttention`` over ``[history; candidate tokens]`` converts by the
generic path (:mod:`.dca_generic`): history positions attend to history positions only,
candidate positions to the history and the candidate tokens.

A candidate-appended transformer runs its whole stack per candidate, because history tokens
attend to the candidate token. DCA keeps one stack per request: history tokens attend only to
history tokens, and the candidate token cross-attends into every depth's history states (and,
in the models that have them, request query tokens do the same through their own projections),
built from :class:`~rocs_compiler.layers.DCABlock` and
:class:`~rocs_compiler.layers.CrossAttention`.

The transform converts the model conversions registered with
:func:`~rocs_compiler.transforms.registry.register_dca_model`. The zoo registers ``BST`` and the
``SequenceNet`` backbone (every encoder layer becomes a DCA block starting from that layer's
weights; the attention pattern changes, so the model must be trained or fine-tuned) and ``HSTU``
(causal attention with the candidate last is already request-only on the history, so its DCA form
equals the original model up to float re-association).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from .registry import DCA_CONVERSIONS

__all__ = ["apply_dca"]


def apply_dca(
    model: nn.Module,
    request_inputs: Sequence[str] | str | None = None,
    *,
    history_length: int | None = None,
    example_inputs: tuple = (),
    example_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """A DCA copy of a candidate-appended sequence model (the original is not modified).

    Args:
        model: a model of a conversion registered with :func:`register_dca_model` (its layout is
            fixed by the conversion), or any model whose sequence part is an
            ``nn.TransformerEncoder``, ``nn.TransformerEncoderLayer`` or self-attention
            ``nn.MultiheadAttention`` over ``[history; candidate tokens]``: those modules are
            replaced by their DCA forms (:mod:`.dca_torch`; same parameters and names, so the
            original's ``state_dict`` loads).
        request_inputs: the model's request-side inputs (argument names, or ``"arg.key"``). For a
            registered conversion, checked against it.
        history_length: the number of history positions at the start of every converted
            module's sequence. Without it, it is read from the model's lineage on
            ``example_kwargs`` / ``example_inputs`` (one replicated example batch): the leading
            positions that depend on request inputs only.

    Returns a new module in the original's train/eval mode. A model converted by the generic
    path carries a :class:`~.dca_generic.DCAReport` as ``rocs_dca_report``. Raises
    ``ValueError`` naming what is missing when the model has none of these modules, its
    sequence does not start with the history, or the history cannot be located.
    """
    conversion = DCA_CONVERSIONS.get(model)
    if conversion is None:
        from .dca_generic import apply_dca_generic

        names = [request_inputs] if isinstance(request_inputs, str) else request_inputs
        return apply_dca_generic(model, names, history_length, example_inputs, example_kwargs)
    if request_inputs is not None:
        names = [request_inputs] if isinstance(request_inputs, str) else list(request_inputs)
        if set(names) != set(conversion.request_inputs):
            raise ValueError(
                f"apply_dca: {type(model).__name__} has request inputs "
                f"{sorted(conversion.request_inputs)}; got {sorted(names)}"
            )
    return conversion.convert(model).train(model.training)
