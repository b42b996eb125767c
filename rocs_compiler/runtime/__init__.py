"""Running compiled graphs: the ``CompiledModel`` a user calls (``compiled_model.py``, the face),
one call's path (``call/``: contract, checks, choice, lanes), the measured program choice
(``choice/``), request detection (``rows/``), the straight-line program (``program/``), following
the original model (``follow/``), training (``training/``), the request cache (``cache/``) and
the programs of other modes (``modes/``)."""

from .compiled_model import CompiledModel, InputContract

__all__ = ["CompiledModel", "InputContract"]
