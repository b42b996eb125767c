"""The package's folders are its stages, and imports point one way (docs/architecture.md).

The picture is drawn from the package's own imports (``grimp``, function-level imports
included): a *room* is a top-level module or folder of ``rocs_compiler``, an *arrow* an import
from one room into another. Every arrow must point down the declared order of layers, so no
import circle can form and nothing calls back up (the runtime never imports the report, the
analysis never imports kernels, no format imports a door).
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import networkx as nx
import pytest

PACKAGE = "rocs_compiler"
ROOT = Path(__file__).resolve().parents[1]
MAX_ROOMS = 24

# Top to bottom: a room may import only rooms of a lower layer (later in this list), or of
# its own layer where it is listed in SIDEWAYS.
LAYERS = [
    {"demo", "cli"},  # commands over the doors
    {"backend", "serving"},  # doors that build on the library door and saved programs
    {"api", "export", "integrations", "layers", "distributed"},  # doors and public homes
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


def _tree_modules() -> dict[str, Path]:
    """Every Python module of the checkout by the name it is imported under: dotted names inside
    packages (``rocs_compiler``, ``models_zoo``, ``tests``' packages), the file's stem for a
    script folder (``benchmarks/``, whose scripts import each other by stem)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if any(p.startswith(".") or p in ("build", "node_modules") for p in parts):
            continue
        package = path.parent
        names = [path.stem] if path.stem != "__init__" else []
        while (package / "__init__.py").exists() and package != ROOT:
            names.insert(0, package.name)
            package = package.parent
        scope = "" if package == ROOT else f"{package.relative_to(ROOT)}/"
        modules[scope + ".".join(names)] = path
    return modules


def _imported_names(path: Path, dotted: str) -> set[str]:
    """What ``path`` imports anywhere in it (function bodies included), absolute; a literal
    ``importlib.import_module("...")`` counts as an import."""
    tree = ast.parse(path.read_text(), str(path))
    package = dotted if path.stem == "__init__" else dotted.rpartition(".")[0]
    found = set()

    def absolute(name: str, level: int) -> str:
        base = package.split(".") if package else []
        base = base[: len(base) - (level - 1)] if level > 1 else base
        return ".".join([*base, name] if name else base)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node.module or "", node.level) if node.level else node.module
            found.update(f"{module}.{alias.name}" for alias in node.names)
            found.add(module)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            name = node.args[0].value
            level = len(name) - len(name.lstrip("."))
            found.add(absolute(name.lstrip("."), level) if level else name)
    return found


def test_no_import_circle_anywhere_in_the_tree():
    """Modules, not rooms: no file of the checkout (package, zoo, benchmarks, tests, examples)
    reaches itself through imports, function-level and ``importlib.import_module`` ones included.
    A package's ``__init__`` re-exporting its own modules is not a circle of its modules."""
    modules = _tree_modules()
    graph = nx.DiGraph()
    for key, path in modules.items():
        scope, _, dotted = key.rpartition("/")
        for name in _imported_names(path, dotted):
            target = next((c for c in (f"{scope}/{name}" if scope else None, name) if c in modules),
                          None)  # fmt: skip
            if target is None or target == key:
                continue
            if modules[target].stem == "__init__" and key.startswith(target + "."):
                continue  # a module reading its own package's namespace
            if path.stem == "__init__" and target.startswith(key + "."):
                continue  # a package's namespace made of its modules
            graph.add_edge(key, target)
    assert list(nx.simple_cycles(graph)) == []


# Inside ``runtime/``, top to bottom (docs/architecture.md, "Module map"): the call path uses
# every other room, and nothing below imports it back.
RUNTIME_LAYERS = [
    {"compiled_model"},  # the public face
    {"call"},  # one call's path: contract, checks, choice, lanes
    {"modes", "cache", "training"},
    {"follow", "program"},
    {"choice", "rows"},
]
MAX_FACE_LINES = 300
MAX_FILE_LINES = 500


def test_runtime_rooms_point_down():
    graph = grimp.build_graph(PACKAGE)
    layer = {room: i for i, rooms_of in enumerate(RUNTIME_LAYERS) for room in rooms_of}
    prefix = f"{PACKAGE}.runtime."
    upward, unplaced = [], set()
    for module in graph.modules:
        if not module.startswith(prefix):
            continue
        a = module[len(prefix):].split(".")[0]
        for imported in graph.find_modules_directly_imported_by(module):
            if not imported.startswith(prefix):
                continue
            b = imported[len(prefix):].split(".")[0]
            unplaced |= {r for r in (a, b) if r not in layer}
            if a != b and a in layer and b in layer and layer[b] <= layer[a]:
                upward.append(f"{module} -> {imported}")
    assert not unplaced, f"runtime rooms without a layer: {sorted(unplaced)}"
    assert upward == []


def test_the_compiled_model_is_a_face_and_no_package_file_is_long():
    face = ROOT / PACKAGE / "runtime" / "compiled_model.py"
    assert len(face.read_text().splitlines()) <= MAX_FACE_LINES
    long = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / PACKAGE).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}
