"""Model transforms that make more of a model request-only (they change the model: retrain).

- :func:`apply_glm`: Generalized Layer Masking for DCNv2, FinalMLP and Wukong-style models.
- :func:`apply_dca`: Deep Cross Attention for candidate-appended sequence models (BST, HSTU).

Schema-parametrized backbones both transforms know live in :mod:`.backbones`.
"""

from .dca import apply_dca
from .glm import apply_glm

__all__ = ["apply_dca", "apply_glm"]
