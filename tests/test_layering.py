"""No import runs back up: the core imports nothing of the drop-in, the Space or the test models, the drop-in
nothing of the Space or the test models, the Space nothing of the test models (the package facade, `__init__.py`,
may reach the drop-in lazily)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_runtime"
ABOVE_CORE = ("llama_compat", "space", "testing")


def imported(path: Path) -> set[str]:
    """The package's own modules a file imports, as top-level names under dflash_runtime ("space", "hub", ...)."""
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 0 for a core module, 1 inside a subpackage
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "dflash_runtime" and len(parts) > 1:
                    names.add(parts[1])
                continue
            if node.level - 1 < depth:
                continue  # within the same subpackage
            if node.module:
                names.add(node.module.split(".")[0])
            else:
                names.update(alias.name for alias in node.names)
    return names


def core_id(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"
                                        and p.relative_to(PACKAGE).parts[0] not in ABOVE_CORE), ids=core_id)
def test_the_core_imports_nothing_above_it(path: Path) -> None:
    assert not imported(path) & set(ABOVE_CORE)


@pytest.mark.parametrize("path", sorted((PACKAGE / "llama_compat").glob("*.py")), ids=lambda p: p.name)
def test_the_drop_in_imports_nothing_of_the_space_or_the_test_models(path: Path) -> None:
    assert not imported(path) & {"space", "testing"}


SPACE = PACKAGE / "space"


def space_id(path: Path) -> str:
    return str(path.relative_to(SPACE))


@pytest.mark.parametrize("path", sorted(SPACE.rglob("*.py")), ids=space_id)
def test_the_space_imports_nothing_of_the_test_models(path: Path) -> None:
    assert "testing" not in imported(path)  # app.py hands the offline demo its generated pair


def space_imports(graph: dict[str, set[str]], part: str) -> dict[str, set[str]]:
    """What each module of one part of the Space (`web`, `page`, `gpu`, ...) imports of the Space's other modules."""
    return {module: {m for m in targets if m.startswith("space.")}
            for module, targets in graph.items() if module.startswith(f"space.{part}.")}


def reaches(imports: dict[str, set[str]], part: str) -> dict[str, set[str]]:
    return {module: found for module, targets in imports.items()
            if (found := {m for m in targets if m.startswith(f"space.{part}.")})}


def test_the_space_is_laid_out_by_its_two_processes() -> None:
    """The web side (the page and the web process's GPU calls) imports nothing of the GPU side, only the data that
    crosses (app.py hands the GPU function in); the GPU side imports nothing of the page nor of the web side."""
    graph = module_graph(PACKAGE)
    assert {"space.web.service", "space.page.endpoints", "space.gpu.host", "space.gpu_job"} <= set(graph)
    assert reaches(space_imports(graph, "web"), "gpu") == {}
    assert reaches(space_imports(graph, "page"), "gpu") == {}
    assert reaches(space_imports(graph, "gpu"), "page") == {}
    assert reaches(space_imports(graph, "gpu"), "web") == {}
    assert reaches(space_imports(graph, "web"), "page") == {}  # the page sits above the web side, never below it
    setup = space_imports(graph, "setup")
    assert {part: reaches(setup, part) for part in ("page", "web", "gpu")} == {"page": {}, "web": {}, "gpu": {}}
    shared = {"space.gpu_job", "space.requests", "space.provenance", "space.scrub"}
    assert not {m for s in shared for m in graph[s] if m.startswith(("space.page.", "space.web.", "space.gpu."))}


def test_the_process_check_sees_an_import_of_the_gpu_side(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    for sub in ("space", "space/web", "space/gpu"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "space" / "gpu" / "host.py").write_text("")
    (package / "space" / "web" / "service.py").write_text("def f():\n    from ..gpu import host\n")
    found = reaches(space_imports(module_graph(package), "web"), "gpu")
    assert found == {"space.web.service": {"space.gpu.__init__", "space.gpu.host"}}  # a lazy import is an arrow too


def test_the_check_sees_imports_across_levels() -> None:
    sub = PACKAGE / "llama_compat" / "llama.py"
    assert "files" in imported(sub)  # a relative import two levels up is seen
    assert "engine" in imported(PACKAGE / "__init__.py")


def module_graph(package: Path) -> dict[str, set[str]]:
    """Every module of a package (dotted below it: "pair", "space.gpu.host", "__init__" for a package's facade) and the
    modules of the same package it imports, wherever the import stands (module level, in a function, under
    TYPE_CHECKING): an arrow is an arrow."""
    files = {p: ".".join(p.relative_to(package).with_suffix("").parts) for p in package.rglob("*.py")}
    known = set(files.values())

    def resolve(base: list[str], name: str) -> str | None:
        dotted = ".".join([*base, name] if name else base)
        if dotted in known:
            return dotted
        if f"{dotted}.__init__" in known:  # a subpackage: its facade
            return f"{dotted}.__init__"
        facade = ".".join([*base, "__init__"]) if base else "__init__"
        return facade if facade in known else None

    graph: dict[str, set[str]] = {}
    for path, module in files.items():
        here = module.split(".")[:-1]  # the module's own subpackage
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 0:
                    parts = (node.module or "").split(".")
                    if parts[0] != package.name:
                        continue
                    base = parts[1:]
                else:
                    base = here[:len(here) - (node.level - 1)] + ((node.module or "").split(".") if node.module else [])
                target = ".".join(base)
                if node.module and target in known:
                    edges.add(target)
                for alias in node.names:  # `from . import methods`: a module; `from .x import y`: x (or its y)
                    found = resolve(base, alias.name)
                    if found is not None and (found != f"{target}.__init__" or not node.module):
                        edges.add(found)
                if node.module and target not in known:
                    found = resolve(base, "")
                    if found is not None:
                        edges.add(found)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == package.name and len(parts) > 1:
                        found = resolve(parts[1:-1], parts[-1])
                        if found is not None:
                            edges.add(found)
        edges.discard(module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: the import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_the_package() -> None:
    graph = module_graph(PACKAGE)
    assert {"pair", "methods", "drafters.drafting", "drafters.dflash", "engine"} <= set(graph)
    assert circles(graph) == []


def test_the_pair_names_no_method_and_the_registry_sits_above_it() -> None:
    graph = module_graph(PACKAGE)
    methods = {f"drafters.{m}" for m in ("dflash", "mtp", "ngram", "eagle3", "draft_simple")}
    assert not any(m == "methods" or m.startswith("drafters.") for m in graph["pair"])  # the pair names no method
    assert methods <= graph["methods"]  # the registry reaches every method's module
    assert "methods" not in set().union(*(graph[m] for m in methods | {"drafters.drafting"}))


# The core's rooms (a folder, or a module standing alone) in the order of the data path: each imports only rooms
# before its own. `results/` (a request's statistics, events and tables) is plain data, filled and read by the rooms
# above it; what stands above the engine (cli/, openai_api/, llama_compat/, space/, testing/) is not in the line.
DATA_PATH = ("errors", "deprecated", "native", "results", "files", "pair", "drafters", "methods", "cache", "text",
             "decoding", "engine")


def room(module: str) -> str:
    return module.split(".")[0]


def against_the_data_path(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The arrows of the core's rooms that run to a later room of the data path, or out of it: (module, import)."""
    order = {name: i for i, name in enumerate(DATA_PATH)}
    return sorted((module, target) for module, targets in graph.items() if room(module) in order
                  for target in targets
                  if room(target) != room(module) and order.get(room(target), len(order)) > order[room(module)])


def test_the_rooms_follow_the_data_path() -> None:
    """native/ (the foundation) imports nothing above it; drafters/ nothing of cache/ or of what runs a step; nothing
    of the core imports the command line, the servers or the Space."""
    graph = module_graph(PACKAGE)
    assert {room(m) for m in graph} >= set(DATA_PATH)
    assert against_the_data_path(graph) == []


def test_the_data_path_check_finds_an_arrow_back() -> None:
    graph = {"native.memory": {"errors"}, "drafters.mtp": {"pair", "native.memory"}, "cache.spares": {"drafters.mtp"},
             "pair": {"native.memory"}}
    assert against_the_data_path(graph) == []
    graph["native.memory"].add("cache.spares")
    graph["pair"].add("cli.main")
    assert against_the_data_path(graph) == [("native.memory", "cache.spares"), ("pair", "cli.main")]


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .sub.c import g\n")
    (package / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                          "if TYPE_CHECKING:\n    from ..a import x\n")
    (package / "d.py").write_text("from .a import y\n")
    (package / "e.py").write_text("from . import sub\n")  # a subpackage's facade is a module of its own
    graph = module_graph(package)
    assert circles(graph) == [["a", "b", "sub.c"]] and graph["e"] == {"sub.__init__"}
    (package / "sub" / "c.py").write_text("")
    assert circles(module_graph(package)) == []


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 + the highest floor it imports (1: imports nothing of the package)."""
    found: dict[str, int] = {}

    def floor(module: str) -> int:
        if module not in found:
            found[module] = 1 + max((floor(m) for m in graph.get(module, ()) if m != module), default=0)
        return found[module]

    for module in graph:
        floor(module)
    return found


def test_the_drafting_path_needs_no_registry_and_the_engine_stands_low() -> None:
    """Decoding a step runs the drafters a request chose (drafters/method_list.py); only the engine and the request
    checks ask the registry which. The engine tops the data path at most 11 floors up (it stood 12 up while decoding
    reached the drafters through the registry), so a longer line of imports added on the way shows here."""
    graph = module_graph(PACKAGE)
    assert "methods" not in graph["decoding.request"] | graph["decoding.steps"] | graph["drafters.method_list"]
    assert floors(graph)["engine"] <= 11


def test_floors_count_the_longest_line_of_imports() -> None:
    assert floors({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": set()}) == {"a": 3, "b": 2, "c": 1, "d": 1}
