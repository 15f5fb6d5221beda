"""How fp8mon installs and how its modules depend on each other: one `fp8mon` namespace in site-packages, every
package folder in the distribution, no import circles, and a server that does not import the trainer."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]  # {"fp8mon.agent": "agent", ...}


def _source_packages() -> dict[str, Path]:
    """Every importable package of the source tree, by its installed name."""
    found = {}
    for name, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(base).parts
            found[".".join((name, *rel))] = init.parent
    return found


def test_every_package_folder_is_in_the_distribution():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    missing = sorted(set(_source_packages()) - listed)
    assert not missing, f"add to pyproject.toml's [tool.setuptools] packages: {missing}"


def test_the_wheel_installs_only_the_fp8mon_namespace(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("fp8mon-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"fp8mon"}
    for needed in ("fp8mon/agent/__init__.py", "fp8mon/monitor/static/index.html", "fp8mon/migrations/env.py",
                   "fp8mon/migrations/script.py.mako", "fp8mon/trainer/corpus/shakespeare.txt", "fp8mon/cli.py"):
        assert needed in names, f"{needed} missing from the wheel"
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "fp8mon = fp8mon.cli:main" in entry_points


def _module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in _source_packages().items():
        for path in folder.glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The fp8mon modules `module` imports anywhere (functions included; `if TYPE_CHECKING:` blocks excepted), each
    as the deepest known module of its dotted name."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.stem == "__init__" else module.rpartition(".")[0]

    def walk(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            yield from walk(child)

    def deepest(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    targets = set()
    for node in walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            target = deepest(name)
            if target and target != module:
                targets.add(target)
    return targets


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def test_no_import_circles():
    files = _module_files()
    known = set(files)
    # Imports inside functions count: deferring one hides a circle, it does not remove it. A package's __init__ is
    # imported before any of its modules, so a module's import of its own package is not a circle.
    graph = {m: {t for t in _imports(m, p, known) if not m.startswith(t + ".")}
             for m, p in files.items()}
    assert _cycles(graph) == []


@pytest.mark.parametrize("server", ["fp8mon.monitor", "fp8mon.migrations"])
def test_the_server_never_imports_the_trainer(server):
    files = _module_files()
    known = set(files)
    offenders = {m: sorted(t for t in _imports(m, p, known) if t.startswith("fp8mon.trainer"))
                 for m, p in files.items() if m == server or m.startswith(server + ".")}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_the_import_graph_check_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _is_triton_kernel(node: ast.FunctionDef) -> bool:
    def name(d):
        d = d.func if isinstance(d, ast.Call) else d
        return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")

    return any(name(d) == "jit" for d in node.decorator_list)


def test_modules_and_functions_stay_readable():
    """No module of the package over 800 lines, no function over 120 (a Triton kernel's body excepted)."""
    too_long = []
    for module, path in _module_files().items():
        lines = path.read_text().splitlines()
        if len(lines) > 800:
            too_long.append(f"{module}: {len(lines)} lines")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                length = node.end_lineno - node.lineno + 1
                if length > 120:
                    too_long.append(f"{module}.{node.name}: {length} lines")
    assert too_long == []


def test_a_command_whose_extra_is_missing_names_the_extra(monkeypatch, capsys, tmp_path):
    from fp8mon.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as in an install of fp8mon[agent] only
    assert main(["serve", "--database-url", f"sqlite:///{tmp_path / 'x.db'}"]) == 2
    assert "pip install 'fp8mon[monitor]'" in capsys.readouterr().err


def test_version_needs_no_server_package(monkeypatch, capsys):
    from fp8mon import __version__

    for name in ("fastapi", "sqlalchemy", "pydantic_settings", "torch"):
        monkeypatch.setitem(sys.modules, name, None)  # importing any of them now fails
    monkeypatch.delitem(sys.modules, "fp8mon.cli", raising=False)  # imported afresh, without them
    from fp8mon.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"fp8mon {__version__}"
