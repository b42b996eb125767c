"""ROCS-native layers: Generalized Layer Masking (GLM) and Deep Cross Attention (DCA).

GLM splits every hidden state into an ordered *request group* (first) and *candidate group*
(last). Information may flow from request lanes into candidate lanes, never back, so the request
lanes of every layer are functions of request-side inputs only and the compiler runs them once
per request. Each layer here produces its output as ``torch.cat([request, candidate], -1)`` (or
along the feature axis for ``[B, F, D]`` stacks) of per-group computations: the request outputs
are computed from the request inputs alone, so the masked block is *structural*, skipped by the
forward rather than multiplied by zero. Eager, training and compiled models therefore agree on
every input, an inf or NaN in a candidate lane included (``x @ (W * mask).T`` would put
``inf * 0 = NaN`` into the request lanes), and the compiler needs no weight values to find the
lanes: the concatenation rewrites read them from the graph. Zeros in ordinary weights are never
exploited: they change when weights are refreshed, and skipping them changes NaN propagation.

Masked weights are ``torch.nn.utils.parametrize`` parametrizations ``W = W_raw * mask`` with a
constant mask buffer, so ``layer.weight`` shows the zero block and is exactly zero there after
any optimizer step (weight decay included). The forward never reads the block, so it receives
exactly zero gradient; the raw block starts at zero and stays zero under SGD and Adam as well.

DCA keeps a history stack request-only: history tokens attend only to history tokens, and at
every depth request-side and candidate-side query tokens cross-attend into that depth's history
states through their own K/V projections. Only the candidate queries and their attention run per
candidate; the compiler computes the history stack and every K/V projection once per request.

Shapes use ``B`` rows (requests or candidates), ``D`` features, ``F`` feature fields, ``L``
history positions and ``H`` heads.

The layers live in ``glm_masking.py`` (the mask and masked weights), ``glm_layers.py`` (the GLM
layers) and ``dca_layers.py`` (the DCA layers); this module is their home, re-exported as
``rocs_compiler.layers``.
"""

from __future__ import annotations

from .dca_layers import CrossAttention, DCABlock, nonempty_key_mask
from .glm_layers import (
    GLMFactorizationMachine,
    GLMLinear,
    GLMLinearCompression,
    GroupLayerNorm,
    glm_mlp,
)
from .glm_masking import BlockMask, glm_mask

__all__ = [
    "BlockMask",
    "CrossAttention",
    "DCABlock",
    "GLMFactorizationMachine",
    "GLMLinear",
    "GLMLinearCompression",
    "GroupLayerNorm",
    "glm_mask",
    "glm_mlp",
    "nonempty_key_mask",
]
