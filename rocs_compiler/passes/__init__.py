"""Rewrite passes, one module each, over an FX graph with roles (``analysis/``).

``normalize`` and ``defer`` are rewrite sets run by one engine (``engine.py``) to a fixpoint and
return the graph with the count of each rewrite that fired; ``share`` takes the batch symbol and
returns the shared graph; ``ikbo`` returns it with its fusion counts; ``cleanup`` maps a graph to
a graph; ``verify`` checks the invariants between them. ``pipeline.py`` runs them in order.
"""
