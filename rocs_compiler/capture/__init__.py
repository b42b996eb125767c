"""Capture: a model and an example batch into an ATen-level FX graph with one dynamic batch
symbol (``trace.py``)."""
