"""Reports: the structured report of a compiled model (``build.py``), per-module totals, graph
text and the drawings of ``render/``."""
