"""Every script of the benchmark suite (benchmarks/) still loads (issue 44): each Python script is imported
as a module (its `main` does not run), each shell script passes `bash -n`, and every name a script imports
from kvpot exists, including the imports inside functions that only a run would reach. Scripts whose kvpot
module needs Triton (absent on a CPU-only machine) are checked by that static pass and by compiling them."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.relative_to(ROOT) for p in (ROOT / "benchmarks").rglob("*.py"))
SHELL = sorted(p.relative_to(ROOT) for d in ("benchmarks", "records") for p in (ROOT / d).rglob("*.sh"))
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _kvpot_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every `from kvpot... import ...` and `import kvpot...` in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kvpot":
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "kvpot"]
    return found


def _defined_in_source(module: str) -> set[str]:
    """Top-level names a kvpot module's source defines (for modules that cannot be imported here)."""
    base = ROOT / "src" / Path(*module.split("."))
    source = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
    names = {p.stem for p in base.glob("*.py")} | {p.name for p in base.iterdir() if p.is_dir()} if base.is_dir() else set()
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _needs_missing_triton(error: BaseException) -> bool:
    return isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "triton" and not HAS_TRITON


def test_the_suite_has_scripts():
    assert len(SCRIPTS) >= 15 and len(SHELL) >= 36  # records' GPU calls: one commands.sh per session (issue 44)
    assert not list((ROOT / "benchmarks").rglob("*.png")) and not list((ROOT / "benchmarks").rglob("*.jsonl"))


def test_every_script_has_a_row_in_the_suite_index_and_its_records_exist():
    """benchmarks/README.md lists every script once, and each records folder it names exists: a newcomer finds
    what a script measures and where its runs are from the index alone."""
    import re

    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    found = re.findall(r"^\| `([^`]+)` \| .* \| (.*) \|$", text, flags=re.M)
    rows = dict(found)
    assert len(rows) == len(found)  # no script twice
    scripts = {str(p.relative_to("benchmarks")) for p in (*SCRIPTS, *SHELL) if p.parts[0] == "benchmarks"}
    assert sorted(scripts - rows.keys()) == []
    assert sorted(rows.keys() - scripts) == []
    named = {folder for cell in rows.values() for folder in re.findall(r"`(records/[^`]+)`", cell)}
    assert named and sorted(f for f in named if not (ROOT / f).is_dir()) == []


@pytest.mark.parametrize("script", SCRIPTS, ids=str)
def test_every_python_script_imports(script, monkeypatch):
    path = ROOT / script
    compile(path.read_text(encoding="utf-8"), str(path), "exec")
    # as `python benchmarks/X/script.py` runs it: its own folder first on the path (sibling modules)
    monkeypatch.syspath_prepend(str(path.parent))
    monkeypatch.setattr(sys, "argv", [str(path)])
    name = "benchmark_script_" + "_".join(script.with_suffix("").parts[1:]).replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    environment = dict(os.environ)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as error:
        if not _needs_missing_triton(error):
            raise
        return  # its kvpot imports are checked by name below
    finally:
        changed = sorted(k for k in set(environment) | set(os.environ) if environment.get(k) != os.environ.get(k))
        os.environ.clear()
        os.environ.update(environment)
    # an import changes no environment variable: this test imports every script into the test session (one
    # setting TRITON_INTERPRET at import made every later torch.compile test recompile per layer)
    assert changed == [], f"importing {script} changed the environment: {changed}"
    assert module.__name__ != "__main__"


@pytest.mark.parametrize("script", SCRIPTS, ids=str)
def test_every_name_a_script_imports_from_kvpot_exists(script):
    missing = []
    for line, module, names in _kvpot_imports(ROOT / script):
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if not _needs_missing_triton(error):
                missing.append(f"{script}:{line}: {module} ({error})")
                continue
            defined = _defined_in_source(module)
            missing += [f"{script}:{line}: {module}.{n}" for n in names if n not in defined]
            continue
        for n in names:
            if not hasattr(loaded, n):
                try:
                    importlib.import_module(f"{module}.{n}")
                except ModuleNotFoundError:
                    missing.append(f"{script}:{line}: {module}.{n}")
    assert not missing, missing


def test_every_shell_script_parses():
    bad = []
    for script in SHELL:
        done = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True, check=False)
        if done.returncode:
            bad.append(f"{script}: {done.stderr.strip()}")
    assert not bad, bad
