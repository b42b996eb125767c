"""Model transforms that make more of a model request-only (they change the model: retrain).

- :func:`apply_glm`: Generalized Layer Masking. Registered conversions (the zoo's DCNv2, FinalMLP,
  Wukong) convert by their rule; any other model by the lanes of its captured graph
  (:mod:`.glm_generic`).
- :func:`glm_from_zero_blocks`: no retraining: a model whose GLM masks were trained by hand as
  exact-zero blocks of plain ``nn.Linear`` layers gets them as structural masks
  (:mod:`.glm_zero_blocks`).
- :func:`apply_dca`: Deep Cross Attention for candidate-appended sequence models. Registered
  conversions (the zoo's BST, HSTU) convert by their rule; any other model whose sequence part is
  torch's ``nn.TransformerEncoder`` / ``nn.TransformerEncoderLayer`` / self-attention
  ``nn.MultiheadAttention`` by replacing those with their DCA forms (:mod:`.dca_generic`,
  :mod:`.dca_torch`).

Conversions are registered with :func:`register_glm_model` and :func:`register_dca_model` by the
code that defines the models (see :mod:`.registry`).
"""

from .dca import apply_dca
from .glm import apply_glm
from .glm_zero_blocks import glm_from_zero_blocks
from .registry import register_dca_model, register_glm_model

__all__ = [
    "apply_dca", "apply_glm", "glm_from_zero_blocks", "register_dca_model", "register_glm_model",
]  # fmt: skip
