"""Public home of the GLM and DCA layers (defined in ``transforms/layers.py``)."""

from .transforms.layers import *  # noqa: F403
from .transforms.layers import __all__  # noqa: F401
