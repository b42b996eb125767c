"""Drawing compiled graphs: DOT/SVG through Graphviz, or SVG and HTML drawn here.

- :mod:`.view`: the drawing model (role-coloured nodes, broadcast edges) from a pipeline result
  or an exported program;
- :mod:`.dot`: DOT text and the ``dot`` program;
- :mod:`.svg`: a layered layout drawn without Graphviz, and the speedup plot;
- :mod:`.html`: one self-contained HTML page.
"""

from .dot import DotNotFound, dot_available, run_dot, to_dot
from .html import html_page
from .svg import graph_svg, speedup_svg
from .view import GraphView, exported_costs, view_from_exported, view_from_pipeline

__all__ = [
    "DotNotFound",
    "GraphView",
    "dot_available",
    "exported_costs",
    "graph_svg",
    "html_page",
    "run_dot",
    "speedup_svg",
    "to_dot",
    "view_from_exported",
    "view_from_pipeline",
]
