"""The package's shape, read with ast (nothing is imported): no import cycle, nothing under kvpot/
imports the command line, and no module outside kernels/ grows past MAX_LINES."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "kvpot"
MAX_LINES = 450  # the developers' guide says ~400; kernels/ is exempt (one Triton kernel per function)


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of nodes under `if TYPE_CHECKING:` (annotations only: not imports at run time)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skip.update(id(n) for n in ast.walk(sub))
    return skip


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The kvpot module an imported name lives in (its longest known prefix), or None outside kvpot."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the kvpot modules it imports (anywhere in the file, functions included)."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                out.update(t for a in node.names if (t := _resolve(a.name, mods)))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1])
                    full = base + ("." + node.module if node.module else "")
                else:
                    full = node.module or ""
                for alias in node.names:
                    sub = f"{full}.{alias.name}"
                    target = sub if sub in mods else _resolve(full, mods)
                    if target:
                        out.add(target)
        out.discard(mod)
        graph[mod] = out
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_graph_sees_imports_of_every_kind():
    graph = import_graph()
    assert "kvpot.cli.generate" in graph["kvpot.cli"]  # from kvpot.cli import generate (a submodule)
    assert "kvpot.methods.infinitehip.reference" in graph["kvpot.methods.infinitehip"]  # from X import names
    assert "kvpot.engine" in graph["kvpot.cli.generate"]  # an import inside a function counts
    assert "kvpot.cache" not in graph["kvpot.positions"]  # under `if TYPE_CHECKING:` it does not


def test_find_cycles_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert find_cycles(import_graph()) == []


def test_the_library_never_imports_the_command_line():
    offenders = {mod: sorted(t for t in targets if t.startswith("kvpot.cli"))
                 for mod, targets in import_graph().items()
                 if not mod.startswith("kvpot.cli") and mod != "kvpot.__main__"}
    assert {mod: t for mod, t in offenders.items() if t} == {}


def test_modules_stay_small():
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in _modules().items()
             if not name.startswith("kvpot.kernels")}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def test_the_top_level_holds_only_the_core():
    top = sorted(p.stem for p in ROOT.glob("*.py"))
    # host_memory: the cache's page-locked storage when offloaded (cache.py's buffers, split from it);
    # defaults: values the library, the server and the benchmarks share, importable without torch
    assert top == ["__init__", "__main__", "attention", "cache", "compat", "defaults", "errors", "host_memory", "positions",
                   "reporting", "rope", "scoring"]


# Objects whose private members belong to the engine package (issue 43: the server and offline jobs use the
# scheduler's and engine's public face only: submit / cancel / step / outputs, generate...).
ENGINE_OBJECTS = {"engine", "scheduler", "decoder", "pool", "sched"}


def private_uses(tree: ast.AST) -> list[str]:
    """`name._member` reads of an engine object's private member (not dunders) in a module's syntax tree."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, (ast.Name, ast.Attribute))):
            owner = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            if owner in ENGINE_OBJECTS:
                found.append(f"{owner}.{node.attr}")
    return found


def test_private_use_is_found():
    assert private_uses(ast.parse("scheduler._fail(r)\nself.engine._resumed(s)\nengine.generate()")) == \
        ["scheduler._fail", "engine._resumed"]


def test_nothing_outside_the_engine_package_touches_the_engines_private_members():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] == "engine":
            continue
        offenders += [f"{path.relative_to(ROOT)}: {use}" for use in private_uses(ast.parse(path.read_text()))]
    assert offenders == []
