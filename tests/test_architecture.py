"""The package's folders are its stages, and imports point one way (docs/architecture.md).

The picture is drawn from the package's own imports (``grimp``, function-level imports
included): a *room* is a top-level module or folder of ``rocs_compiler``, an *arrow* an import
from one room into another. Every arrow must point down the declared order of layers, so no
import circle can form and nothing calls back up (the runtime never imports the report, the
analysis never imports kernels, no format imports a door).
"""

from __future__ import annotations

import grimp
import networkx as nx
import pytest

PACKAGE = "rocs_compiler"
MAX_ROOMS = 24

# Top to bottom: a room may import only rooms of a lower layer (later in this list), or of
# its own layer where it is listed in SIDEWAYS.
LAYERS = [
    {"demo", "cli"},  # commands over the doors
    {"backend", "serving"},  # doors that build on the library door and saved programs
    {"api", "export", "integrations", "layers"},  # doors and public homes
    {"pipeline"},
    {"transforms", "report"},
    {"passes"},
    {"runtime"},
    {"kernels"},
    {"analysis"},
    {"capture"},
    {"formats"},
    {"ir", "options", "errors", "progress", "timing"},  # vocabulary, imports nothing above
]
SIDEWAYS = {("ir", "errors"), ("options", "errors")}


@pytest.fixture(scope="module")
def rooms() -> nx.DiGraph:
    graph = grimp.build_graph(PACKAGE)
    rooms = nx.DiGraph()
    for module in graph.modules:
        parts = module.split(".")
        if len(parts) > 1:
            rooms.add_node(parts[1])
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = module.split("."), imported.split(".")
            if len(a) > 1 and len(b) > 1 and a[1] != b[1]:
                rooms.add_edge(a[1], b[1])
    return rooms


def test_the_top_level_has_few_rooms_each_in_a_layer(rooms):
    assert len(rooms) <= MAX_ROOMS, sorted(rooms)
    placed = set().union(*LAYERS)
    assert set(rooms) <= placed, f"rooms without a layer: {sorted(set(rooms) - placed)}"


def test_no_import_circle(rooms):
    assert list(nx.simple_cycles(rooms)) == []


def test_every_arrow_points_down(rooms):
    layer = {room: i for i, rooms_of in enumerate(LAYERS) for room in rooms_of}
    upward = [
        f"{a} -> {b}"
        for a, b in rooms.edges
        if layer[b] < layer[a] or (layer[b] == layer[a] and (a, b) not in SIDEWAYS)
    ]
    assert upward == []


def test_no_circle_inside_a_folder():
    graph = grimp.build_graph(PACKAGE)
    modules = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if module.rsplit(".", 1)[0] == imported.rsplit(".", 1)[0]:
                modules.add_edge(module, imported)
    assert list(nx.simple_cycles(modules)) == []
