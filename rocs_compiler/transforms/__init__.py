"""Model transforms that make more of a model request-only (they change the model: retrain).

- :func:`apply_glm`: Generalized Layer Masking for DCNv2, FinalMLP and Wukong-style models.
- :func:`apply_dca`: Deep Cross Attention for candidate-appended sequence models (BST, HSTU).

Both convert the model families registered with :func:`register_glm_family` and
:func:`register_dca_family` by the code that defines the models (see :mod:`.registry`).
"""

from .dca import apply_dca
from .glm import apply_glm
from .registry import register_dca_family, register_glm_family

__all__ = ["apply_dca", "apply_glm", "register_dca_family", "register_glm_family"]
