"""Running compiled graphs: the ``CompiledModel`` a user calls (one class for every input format
of ``formats/``), the straight-line program it runs (``direct.py``, with in-place planning in
``inplace.py``), the plain program and the choice between the two (``plain.py``,
``program_choice.py``), the request detection of drop-in calls (``request_detection.py``), input
checks, weight refresh and refused backward."""

from .compiled_model import CompiledModel, InputContract

__all__ = ["CompiledModel", "InputContract"]
