"""The floor plan (``mcore_rl/layers.py``, ``docs/design.md`` "Floor plan"): every import of
``mcore_rl`` goes to its own floor or below, and no import closes a cycle, between files or
between packages. Imports are read with :mod:`ast` (module-level, function-level and
``TYPE_CHECKING`` ones alike, and ``importlib.import_module("...")`` of a literal name; a
``"module:attribute"`` plugin string counts as an import of its module outside the plugin
tables), so the check needs neither torch nor an import of the package."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import pytest

from mcore_rl import layers

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_STRING = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+):[A-Za-z_]\w*$")


class Edge(NamedTuple):
    src: str  # importing module, dotted
    dst: str  # imported module, dotted (the deepest module of the package that exists)
    where: str  # "path:line"
    kind: str  # "import", "function" (inside a def) or "plugin" (a "module:attribute" string)


def _modules(package_dir: Path, package: str) -> Dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``package_dir``."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: Dict[str, Path]) -> Optional[str]:
    """The deepest existing module that ``name`` (a module or a module's attribute) is in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: Dict[str, Path], package: str,
             rel: Path) -> List[Edge]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_init = path.name == "__init__.py"
    edges: List[Edge] = []

    def add(target: str, node: ast.AST, kind: str) -> None:
        dst = _resolve(target, modules)
        if dst is not None and dst != module:
            edges.append(Edge(module, dst, f"{rel}:{node.lineno}", kind))

    def visit(node: ast.AST, in_function: bool) -> None:
        kind = "function" if in_function else "import"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == package or alias.name.startswith(package + "."):
                    add(alias.name, node, kind)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_init]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == package or target.startswith(package + "."):
                for alias in node.names:  # "from pkg import submodule" imports the submodule
                    add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules
                        else target, node, kind)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            name = node.args[0].value  # importlib.import_module("pkg.module"): an import
            if name == package or name.startswith(package + "."):
                add(name, node, kind)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = PLUGIN_STRING.match(node.value)
            if match and match.group(1).startswith(package + ".") and match.group(1) in modules:
                add(match.group(1), node, "plugin")
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                         ast.Lambda)))

    visit(tree, False)
    return edges


def import_graph(package_dir: Path, package: str) -> Tuple[Dict[str, Path], List[Edge]]:
    """Every module of the package at ``package_dir`` and every import between them."""
    modules = _modules(package_dir, package)
    edges = []
    for module, path in modules.items():
        edges += _imports(module, path, modules, package, path.relative_to(package_dir.parent))
    return modules, edges


def _package(module: str, package: str) -> str:
    """The floor plan's unit of ``module``: its subpackage or top-level module, else the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else package


def _cycles(nodes: Iterable[str], succ: Dict[str, List[str]]) -> List[List[str]]:
    """One cycle (as a node path, first node repeated last) per strongly connected component
    with more than one node (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack = set()
    components = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ.get(v, []):
            if w not in index:
                strong(w)
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
                components.append(set(component))

    for v in sorted(nodes):
        if v not in index:
            strong(v)
    out = []
    for component in components:  # a shortest cycle through the component's first node
        start = min(component)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nxt = [w for w in succ.get(path[-1], []) if w in component]
            if start in nxt:
                out.append(path + [start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return out


def floor_violations(package_dir: Path, package: str, floors: Sequence[layers.Floor],
                     planned: Iterable[str] = (), plugin_tables: Iterable[str] = ()) -> List[str]:
    """Every breach of ``floors`` by the package at ``package_dir``, one message each: a
    package on no floor, an import of a higher floor (a plugin string outside
    ``plugin_tables`` counts), a cycle between files or between packages (plugin strings are
    resolved lazily and close no cycle). Each message names the edges and their file:line."""
    modules, edges = import_graph(package_dir, package)
    floor = {p: i for i, f in enumerate(floors) for p in f.packages}
    name = {i: f.name for i, f in enumerate(floors)}
    problems = []
    units = sorted({_package(m, package) for m in modules})
    for unit in units:
        if unit not in floor:
            problems.append(f"{package}/{unit} is on no floor: add it to {package}/layers.py")
    missing = sorted(p for f in floors for p in f.packages if p not in units and p not in planned)
    problems += [f"{package}/layers.py names {p}, which does not exist" for p in missing]

    def show(e: Edge) -> str:
        return f"{e.src} -> {e.dst} ({e.where}{', in a function' if e.kind == 'function' else ''}" \
               f"{', a plugin string' if e.kind == 'plugin' else ''})"

    for e in edges:
        a, b = _package(e.src, package), _package(e.dst, package)
        if a in floor and b in floor and floor[b] > floor[a]:
            if e.kind == "plugin" and e.src in plugin_tables:
                continue
            problems.append(f"upward import: {show(e)}: {a} is on floor {floor[a]} "
                            f"({name[floor[a]]}), {b} on floor {floor[b]} ({name[floor[b]]})")
    static = [e for e in edges if e.kind != "plugin"]
    first: Dict[Tuple[str, str], Edge] = {}
    for e in static:
        first.setdefault((e.src, e.dst), e)
    succ: Dict[str, List[str]] = {}
    for a, b in first:
        succ.setdefault(a, []).append(b)
    for cycle in _cycles(modules, succ):
        problems.append("file-level import cycle: " + "; ".join(
            show(first[(a, b)]) for a, b in zip(cycle, cycle[1:])))
    pfirst: Dict[Tuple[str, str], Edge] = {}
    for e in static:
        a, b = _package(e.src, package), _package(e.dst, package)
        if a != b:
            pfirst.setdefault((a, b), e)
    psucc: Dict[str, List[str]] = {}
    for a, b in pfirst:
        psucc.setdefault(a, []).append(b)
    for cycle in _cycles(units, psucc):
        problems.append(f"package-level import cycle {' -> '.join(cycle)}: " + "; ".join(
            show(pfirst[(a, b)]) for a, b in zip(cycle, cycle[1:])))
    return problems


def test_mcore_rl_obeys_the_floor_plan():
    problems = floor_violations(ROOT / "mcore_rl", "mcore_rl", layers.FLOORS, layers.PLANNED,
                                layers.PLUGIN_TABLES)
    assert not problems, "\n".join(problems)


def test_docs_draw_the_floor_plan():
    plan = layers.floor_plan()
    for doc in ("docs/design.md",):  # the README links it (issue 38: a short README)
        assert plan in (ROOT / doc).read_text(), (
            f"{doc} does not show the floor plan of mcore_rl/layers.py; paste "
            f"layers.floor_plan():\n{plan}")


FLOORS = (layers.Floor("bottom", ("pkg", "low", "low2"), ""), layers.Floor("middle", ("mid",), ""),
          layers.Floor("top", ("top",), ""))


def _tree(tmp_path: Path, files: Dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", "low/__init__.py": "", "low2/__init__.py": "",
                      "mid/__init__.py": "", "top/__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_checker_passes_a_clean_tree(tmp_path):
    root = _tree(tmp_path, {
        "low/a.py": "import os\n",
        "low2/b.py": "from pkg.low import a\n",
        "mid/c.py": "from pkg.low2.b import x\nfrom ..low import a\n",
        "top/d.py": "import pkg.mid.c\nTABLE = {'c': 'pkg.mid.c:C'}\n",
        "low/table.py": "TABLE = {'d': 'pkg.top.d:D'}\n",
    })
    assert floor_violations(root, "pkg", FLOORS, plugin_tables={"pkg.low.table"}) == []


@pytest.mark.parametrize("files, expected", [
    # a function-level import of a higher floor, with its file and line
    ({"low/a.py": "def f():\n    from pkg.mid import c\n", "mid/c.py": ""},
     ["upward import: pkg.low.a -> pkg.mid.c (pkg/low/a.py:2, in a function): low is on floor "
      "0 (bottom), mid on floor 1 (middle)"]),
    # a relative import of a higher floor
    ({"mid/c.py": "from ..top import d\n", "top/d.py": ""},
     ["upward import: pkg.mid.c -> pkg.top.d (pkg/mid/c.py:1): mid is on floor 1 (middle), "
      "top on floor 2 (top)"]),
    # importlib.import_module of a higher floor
    ({"low/a.py": "import importlib\ndef f():\n    return importlib.import_module('pkg.top.d')\n",
      "top/d.py": ""},
     ["upward import: pkg.low.a -> pkg.top.d (pkg/low/a.py:3, in a function): low is on floor 0 "
      "(bottom), top on floor 2 (top)"]),
    # a plugin string of a higher floor outside the plugin tables
    ({"low/a.py": "X = 'pkg.top.d:D'\n", "top/d.py": ""},
     ["upward import: pkg.low.a -> pkg.top.d (pkg/low/a.py:1, a plugin string): low is on "
      "floor 0 (bottom), top on floor 2 (top)"]),
    # two files of one package importing each other (one of them inside a function)
    ({"mid/c.py": "from pkg.mid import e\n", "mid/e.py": "def g():\n    import pkg.mid.c\n"},
     ["file-level import cycle: pkg.mid.c -> pkg.mid.e (pkg/mid/c.py:1); "
      "pkg.mid.e -> pkg.mid.c (pkg/mid/e.py:2, in a function)"]),
    # two packages of one floor importing each other through different files
    ({"low/a.py": "from pkg.low2 import b\n", "low2/b.py": "", "low2/f.py": "import pkg.low.g\n",
      "low/g.py": ""},
     ["package-level import cycle low -> low2 -> low: pkg.low.a -> pkg.low2.b (pkg/low/a.py:1); "
      "pkg.low2.f -> pkg.low.g (pkg/low2/f.py:1)"]),
    # a package on no floor, and a floor's package that does not exist
    ({"extra/__init__.py": ""}, ["pkg/extra is on no floor: add it to pkg/layers.py"]),
])
def test_checker_catches_a_planted_breach(tmp_path, files, expected):
    assert floor_violations(_tree(tmp_path, files), "pkg", FLOORS) == expected


def test_checker_names_a_missing_package(tmp_path):
    root = _tree(tmp_path, {})
    (root / "top" / "__init__.py").unlink()
    (root / "top").rmdir()
    assert floor_violations(root, "pkg", FLOORS) == ["pkg/layers.py names top, which does not exist"]
    assert floor_violations(root, "pkg", FLOORS, planned={"top"}) == []


def _plugin_paths(entry) -> List[str]:
    """The "module:attribute" strings of a plugin table entry (a string or a NamedTuple)."""
    values = entry if isinstance(entry, tuple) else (entry,)
    return [v for v in values if isinstance(v, str)]


def test_plugin_tables_name_what_exists():
    """Every entry of the plugin tables (mcore_rl/config/registry.py) names a module of the
    package that defines the attribute at its top level (read with ast: nothing imported), and
    the schema offers exactly the tables' names as the choices of their keys."""
    import dataclasses

    from mcore_rl.config import registry, schema
    from mcore_rl.config.fields import CHOICES

    modules = _modules(ROOT / "mcore_rl", "mcore_rl")
    tables = {"generation.backend": registry.BACKENDS, "loss.name": registry.POLICY_LOSSES,
              "grpo.advantage_estimator": registry.ADVANTAGE_ESTIMATORS,
              "data.task": registry.TASKS,
              "reward.name": {**registry.VERIFIERS, **registry.LEARNED_REWARDS},
              "reward.verifier": registry.VERIFIERS, "env.name": registry.ENVIRONMENTS}
    missing = []
    for key, table in tables.items():
        for name, entry in table.items():
            for path in _plugin_paths(entry):
                module, _, attribute = path.partition(":")
                tree = ast.parse(modules[module].read_text()) if module in modules else None
                defined = tree is not None and any(
                    getattr(node, "name", None) == attribute
                    or isinstance(node, ast.Assign) and any(getattr(t, "id", None) == attribute
                                                            for t in node.targets)
                    for node in tree.body)
                if not defined:
                    missing.append(f"{key}={name}: {path}")
        section, _, leaf = key.partition(".")
        cls = type(getattr(schema.TrainConfig(), section))
        field = next(f for f in dataclasses.fields(cls) if f.name == leaf)
        assert field.metadata[CHOICES] == tuple(table), key
    assert not missing, "plugin table entries naming nothing: " + ", ".join(missing)
