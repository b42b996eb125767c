"""Drawing compiled graphs: DOT/SVG through Graphviz, and a self-contained HTML report.

- :mod:`.view`: the drawing model (role-coloured nodes, broadcast and shape-only edges) from a
  pipeline result or an exported program;
- :mod:`.dot`: DOT text and the ``dot`` program;
- :mod:`.svg`: the speedup plot;
- :mod:`.html` and ``viewer.js``: one HTML page whose inline script lays out and draws the
  graphs (zoom, pan, search, module groups, node details).
"""

from .dot import DotNotFound, dot_available, run_dot, to_dot
from .html import html_page
from .svg import speedup_svg
from .view import GraphView, exported_costs, view_from_exported, view_from_pipeline

__all__ = [
    "DotNotFound",
    "GraphView",
    "dot_available",
    "exported_costs",
    "html_page",
    "run_dot",
    "speedup_svg",
    "to_dot",
    "view_from_exported",
    "view_from_pipeline",
]
