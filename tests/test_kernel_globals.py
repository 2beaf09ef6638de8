"""Every Triton kernel reads only globals that Triton compiles: modules, other jit functions and
`tl.constexpr(...)` values.

Triton's interpreter (`TRITON_INTERPRET=1`, how the kernel tests run on a CPU) runs a kernel as Python
and reads any global; the compiler refuses a plain one ("Cannot access global variable ... from within
@jit'ed function"). On an H100 that stopped every steady decoding step of `kernels/replace.py` (a plain
int64 constant), which the CPU tests had passed. The check reads the sources, so it needs no Triton.
"""

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "src" / "kvpot" / "kernels"


def _is_jit(node: ast.FunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def _is_constexpr(value: ast.expr) -> bool:
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and value.func.attr == "constexpr")


def _module_globals(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(names the compiler accepts: imports, functions, constexpr values; plain assigned names)."""
    accepted, plain = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            accepted |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            accepted.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            (accepted if node.value is not None and _is_constexpr(node.value) else plain).update(names)
    return accepted, plain - accepted


def _kernels():
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                yield path.name, node, tree


def test_there_are_kernels_to_check():
    assert len(list(_kernels())) >= 10


@pytest.mark.parametrize("case", list(_kernels()), ids=lambda c: f"{c[0]}:{c[1].name}")
def test_a_kernel_reads_only_globals_the_compiler_accepts(case):
    file, kernel, tree = case
    _, plain = _module_globals(tree)
    local = {a.arg for a in kernel.args.args + kernel.args.kwonlyargs}
    local |= {t.id for n in ast.walk(kernel) if isinstance(n, (ast.Assign, ast.AugAssign, ast.For, ast.AnnAssign))
              for t in ast.walk(n.target if not isinstance(n, ast.Assign) else n.targets[0]) if isinstance(t, ast.Name)}
    read = {n.id for n in ast.walk(kernel) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    bad = sorted((read - local) & plain)
    assert not bad, f"{file}: {kernel.name} reads plain module globals {bad}; make them tl.constexpr(...)"
