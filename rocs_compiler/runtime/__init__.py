"""Running compiled graphs: the ``CompiledModel`` a user calls, the straight-line program it runs
(``direct.py``, with in-place planning in ``inplace.py``), the Inductor lowering of the backend
(``lowering.py``) and the request detection of drop-in calls (``request_detection.py``)."""

from .compiled_model import CompiledModel, InputContract

__all__ = ["CompiledModel", "InputContract"]
