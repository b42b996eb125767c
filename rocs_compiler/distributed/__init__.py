"""Data-parallel training helpers for compiled models.

- ``batch.py``: :class:`RequestBatch`, a training batch of whole requests (shared or drop-in).
- ``checks.py``: the balancer's input contract, checked once.
- ``histories.py``: each request's history length, read from padded ids or given and checked.
- ``costs.py``: a request's predicted cost from a compiled model's FLOPs.
- ``partition.py``: which rank each request goes to ("count" and "cost" policies; pure).
- ``refine.py``: moves and swaps of single requests that lower the largest load.
- ``exchange.py``: the plan's sends and receives packed into one all-to-all.
- ``balance.py``: :class:`RequestBalancer`, the door (``rocs.RequestBalancer``).

Nothing here is imported with the package: ``rocs.RequestBalancer`` imports ``balance.py``.
"""
