"""One call on its way down the path (``path.py``), as one value: the call as made (``args``,
``kwargs`` and its ``candidate_to_request``, ``index``), made once at the door and handed to every
later step, which reads the call from it rather than from loose arguments.

The index's range is checked here and nowhere else in the runtime (:meth:`Call.requests_reached`),
at most once per call: a later step that needs it checked finds the answer kept. A gather of
request rows by the index (:meth:`Call.gather`) lets the CPU's ``index_select`` check the range
as it reads, and names a value out of range by the same check.

Identity: a step's view of the call is the call as made; the range found for the index holds for
the rest of the call (the index is not changed while it runs).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...kernels.index_contract import index_bounds, index_trusted, out_of_range


class Call:
    """A call of the compiled model: ``args``, ``kwargs``, ``index`` (None: drop-in)."""

    __slots__ = ("args", "kwargs", "index", "checked", "reached")

    def __init__(self, args: tuple, kwargs: dict, index: Any):
        self.args = args
        self.kwargs = kwargs
        self.index = index
        self.checked = False  # the index's type, length and device (``checks.check_index``)
        self.reached = -1  # the requests the index reaches, once its range is checked

    def requests_reached(self, num_requests: int) -> int:
        """Raise ``IndexRangeError`` unless every value of ``index`` (an int64 ``[N]`` tensor)
        lies in ``[0, num_requests)``; return the largest value plus one (0 when empty). The
        runtime's one range check: the values are read once per call."""
        reached = self.reached
        if 0 <= reached <= num_requests:
            return reached
        index = self.index
        if not index.shape[0]:
            self.reached = 0
            return 0
        low, high = index_bounds(index)
        if low < 0 or high >= num_requests:
            raise out_of_range(low, high, num_requests)
        self.reached = high + 1
        return high + 1

    def gather(self, leaves: dict, names: Iterable[str], num_requests: int) -> dict:
        """``{name: leaves[name][index]}`` for the request leaves ``names`` (``num_requests``
        rows each): on the CPU the gather checks the index's range as it reads; on CUDA, which
        does not, the index is checked first unless the caller trusts it
        (``rocs.trusted_index``)."""
        index = self.index
        if index.is_cuda and not index_trusted():
            self.requests_reached(num_requests)
        try:
            return {n: leaves[n].index_select(0, index) for n in names}
        except IndexError:
            self.requests_reached(num_requests)  # raises IndexRangeError
            raise

