"""The layering as a checked contract (issue 24): the import-linter contracts in pyproject.toml hold
(layers benchmarks / experiments / scripts -> serve, train -> preft_jax -> pallas_kernels; serve and
train independent; no cycles between sibling modules; private modules stay private), no two
modules import each other directly or through others (strongly connected components of grimp's
module graph, package __init__ modules included), and the drivers import only public names.
Each checker is also shown to fail on a small package built to break it."""
import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

importlinter_api = pytest.importorskip("importlinter.api",
                                       reason="import-linter is not installed (pip install -e '.[test]')")
grimp = pytest.importorskip("grimp", reason="grimp (installed with import-linter) is not installed")

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("pallas_kernels", "preft_jax", "serve", "train")
DRIVERS = ("experiments", "benchmarks", "scripts")


def _lint_imports(cwd: pathlib.Path, pythonpath: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
                           "--no-cache", "--no-logo"], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _config(pyproject: pathlib.Path) -> dict:
    return importlinter_api.read_configuration(str(pyproject))


def import_cycles(graph, ignore: tuple[tuple[str, str], ...] = ()) -> list[list[str]]:
    """Every set of modules that import each other (directly or through others): the strongly
    connected components of size > 1 of the module graph, plus modules importing themselves;
    `ignore`: (importer, imported) edges left out. Sorted lists of module names."""
    ignored = set(ignore)
    edges = {m: sorted(n for n in graph.find_modules_directly_imported_by(m) if (m, n) not in ignored)
             for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):                       # iterative Tarjan (no recursion limit)
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w), on_stack.add(w)
                    work.append((w, iter(edges[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in edges[v]:
                    found.append(sorted(comp))
    return sorted(found)


def _describe(graph, cycle: list[str]) -> str:
    a, b = cycle[0], cycle[1] if len(cycle) > 1 else cycle[0]
    there = graph.find_shortest_chain(importer=a, imported=b) or (a, b)
    back = graph.find_shortest_chain(importer=b, imported=a) or (b, a)
    return " -> ".join(list(there) + list(back[1:])) + f"   (component: {', '.join(cycle)})"


def _acyclic_ignores(config: dict) -> tuple[tuple[str, str], ...]:
    """The temporary exceptions declared in pyproject.toml's acyclic contract ("a -> b")."""
    out = []
    for c in config["contracts_options"]:
        if c["type"] == "acyclic_siblings":
            for expr in c.get("ignore_imports", []):
                importer, imported = (s.strip() for s in expr.split("->"))
                assert "*" not in importer + imported, f"name the exception exactly: {expr}"
                out.append((importer, imported))
    return tuple(out)


def test_import_linter_contracts_hold():
    r = _lint_imports(ROOT, ROOT)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    n = len(_config(ROOT / "pyproject.toml")["contracts_options"])
    assert f"Contracts: {n} kept, 0 broken." in r.stdout, r.stdout


def test_contracts_cover_every_top_level_package():
    config = _config(ROOT / "pyproject.toml")
    roots = config["session_options"]["root_packages"]
    assert sorted(roots) == sorted(LIBRARY + DRIVERS)
    on_disk = {p.parent.name for p in ROOT.glob("*/*.py")} - {"tests", "docs"}
    assert on_disk <= set(roots), f"top-level folders with Python files outside the contracts: {on_disk - set(roots)}"
    types = {c["type"] for c in config["contracts_options"]}
    assert {"layers", "independence", "acyclic_siblings"} <= types


def test_no_file_level_import_cycles(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    config = _config(ROOT / "pyproject.toml")
    graph = grimp.build_graph(*config["session_options"]["root_packages"], cache_dir=None)
    assert {"serve.engine", "train.trainer", "experiments.rl_study", "benchmarks.paged"} <= graph.modules
    cycles = import_cycles(graph, _acyclic_ignores(config))
    assert not cycles, "modules that import each other:\n" + "\n".join(_describe(graph, c) for c in cycles)


def _write_package(tmp_path: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


def test_cycle_finder_finds_direct_lazy_and_package_cycles(tmp_path, monkeypatch):
    _write_package(tmp_path, {
        "cycpkg/__init__.py": "",
        "cycpkg/a.py": "from cycpkg import b\n",
        "cycpkg/b.py": "def f():\n    from cycpkg.a import x\n",           # a function-level import counts
        "cycpkg/c.py": "import cycpkg.a\n",                                  # into the cycle, not part of it
        "cycpkg/sub/__init__.py": "from cycpkg.sub.x import y\n",
        "cycpkg/sub/x.py": "import cycpkg.sub\ny = 1\n",                     # a package and its child
        "cycpkg/d.py": "import cycpkg.e\n",
        "cycpkg/e.py": "import cycpkg.f\n",
        "cycpkg/f.py": "import cycpkg.d\n",                                  # through a third module
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cycpkg", cache_dir=None)
    assert import_cycles(graph) == [["cycpkg.a", "cycpkg.b"], ["cycpkg.d", "cycpkg.e", "cycpkg.f"],
                                    ["cycpkg.sub", "cycpkg.sub.x"]]
    assert import_cycles(graph, (("cycpkg.b", "cycpkg.a"), ("cycpkg.f", "cycpkg.d"))) == [["cycpkg.sub", "cycpkg.sub.x"]]
    assert _describe(graph, ["cycpkg.a", "cycpkg.b"]).startswith("cycpkg.a -> cycpkg.b -> cycpkg.a")


def test_contracts_break_on_a_layer_violation_and_a_cycle(tmp_path):
    """The same contract types, on a two-package project that breaks them, make lint-imports fail."""
    _write_package(tmp_path, {
        "hi_layer/__init__.py": "",
        "hi_layer/top.py": "import lo_layer.base\n",
        "lo_layer/__init__.py": "",
        "lo_layer/base.py": "def f():\n    import hi_layer.top\n",            # lower layer imports the upper
        "lo_layer/one.py": "import lo_layer.two\n",
        "lo_layer/two.py": "import lo_layer.one\n",
        "pyproject.toml": """
            [tool.importlinter]
            root_packages = ["hi_layer", "lo_layer"]

            [[tool.importlinter.contracts]]
            name = "layers"
            type = "layers"
            layers = ["hi_layer", "lo_layer"]

            [[tool.importlinter.contracts]]
            name = "acyclic"
            type = "acyclic_siblings"
            ancestors = ["hi_layer", "lo_layer"]
        """,
    })
    r = _lint_imports(tmp_path, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Contracts: 0 kept, 2 broken." in r.stdout
    assert "lo_layer.base -> hi_layer.top" in r.stdout
    assert "No cycles are allowed in lo_layer." in r.stdout


def _private_imports(root: pathlib.Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARY:
                bad += [f"{path.relative_to(root.parent)}:{node.lineno}: from {node.module} import {a.name}"
                        for a in node.names if a.name.startswith("_")]
    return bad


def test_drivers_import_only_public_library_names(tmp_path):
    bad = [b for d in DRIVERS for b in _private_imports(ROOT / d)]
    assert not bad, "drivers importing private library names:\n" + "\n".join(bad)
    _write_package(tmp_path, {"drv/x.py": "from serve.engine import Engine, _take_tokens\n"})
    assert _private_imports(tmp_path / "drv") == ["drv/x.py:1: from serve.engine import _take_tokens"]
