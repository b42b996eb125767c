"""``apply_dca``: turn a candidate-appended sequence model into Deep Cross Attention.

A candidate-appended transformer runs its whole stack per candidate, because history tokens
attend to the candidate token. DCA keeps one stack per request: history tokens attend only to
history tokens, and the candidate token cross-attends into every depth's history states (and,
in the models that have them, request query tokens do the same through their own projections),
built from :class:`~rocs_compiler.layers.DCABlock` and
:class:`~rocs_compiler.layers.CrossAttention`.

The transform converts the model families registered with
:func:`~rocs_compiler.transforms.registry.register_dca_family`. The zoo registers ``BST`` and the
``SequenceNet`` backbone (every encoder layer becomes a DCA block starting from that layer's
weights; the attention pattern changes, so the model must be trained or fine-tuned) and ``HSTU``
(causal attention with the candidate last is already request-only on the history, so its DCA form
equals the original model up to float re-association).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .registry import DCA_FAMILIES

__all__ = ["apply_dca"]


def apply_dca(model: nn.Module, request_inputs: Sequence[str] | str | None = None) -> nn.Module:
    """A DCA copy of a candidate-appended sequence model (the original is not modified).

    ``model`` must be of a family registered with :func:`register_dca_family`.
    ``request_inputs``, when given, must be the model's request-side inputs (the history and the
    user features); the DCA layout is fixed by the model family.
    """
    family = DCA_FAMILIES.find(model)
    if request_inputs is not None:
        names = [request_inputs] if isinstance(request_inputs, str) else list(request_inputs)
        if set(names) != set(family.request_inputs):
            raise ValueError(
                f"apply_dca: {type(model).__name__} has request inputs {sorted(family.request_inputs)}; "
                f"got {sorted(names)}"
            )
    return family.convert(model).train(model.training)
