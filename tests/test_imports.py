"""The package's shape: imports go one way (arena_tools -> alloc, never back) with no circle
anywhere, and what a worker or a reader of saved files imports needs no more than it should:
``import alloc`` needs neither rich nor the compiled core, and a CSV trace or a JSON report is
read with neither."""

import ast
import os
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("alloc", "arena_tools", "indexer", "tp")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The project modules ``name`` imports anywhere in its body (function-level imports too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_graph_sees_known_edges():
    g = graph()  # a parser that saw nothing would pass the tests below
    assert "alloc.plugin" in g["arena_tools.host_replay"] and "arena_tools.plan" in g["arena_tools.replay"]
    assert "alloc.config" in g["alloc"] and "arena_tools.allocators" in g["tp.launch"]


def test_the_runtime_never_imports_the_tools():
    g = graph()
    back = {(m, t) for m, targets in g.items() if m.split(".")[0] == "alloc"
            for t in targets if t.split(".")[0] == "arena_tools"}
    assert not back


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


BLOCKED = "import sys\nfor name in ('alloc._core', 'alloc._core_testing', 'rich', 'matplotlib'):\n    sys.modules[name] = None\n"


def run_blocked(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED + code, *args], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)


def test_import_alloc_needs_neither_rich_nor_the_compiled_core():
    done = run_blocked("import alloc\nprint(alloc.Config().budget_mb)\n"
                       "try:\n    alloc.Arena\nexcept ImportError:\n    print('no core')\n")
    assert done.returncode == 0 and done.stdout.splitlines() == ["512", "no core"], done.stderr


def test_a_csv_trace_and_a_json_report_are_read_without_the_compiled_core(tmp_path):
    csv = tmp_path / "trace.csv"
    csv.write_text("Thread,Time,Action,Pointer,Size,Stream,Device,Pool\n"
                   "1,00:00:00.000001,allocate,0x1000,4096,0x0,0,workspace\n"
                   "1,00:00:00.000002,free,0x1000,4096,0x0,0,workspace\n")
    stats = {"capacity": 8192, "in_use": 4096, "in_use_peak": 4096, "capacity_peak": 8192,
             "fragmentation": 0.0}
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"format": "indexer-arena-report-1", "budget": 8192, "devices": [
        {"device": 0, "unified": False, "pools": [
            {"pool": "workspace", "stats": stats,
             "blocks": [[65536, 0, 4096, 4000, 1, 0], [65536, 4096, 4096, 0, 0, 0]]}]}]}))
    done = run_blocked(
        "from arena_tools import export, report\n"
        "t = export.load_trace(sys.argv[1])\n"
        "print(t.kind, [(e.action, e.size, e.pool) for e in t.events])\n"
        "r, events, notes = report.load(sys.argv[2])\n"
        "[s] = report.summarize(r)\n"
        "print(s['in_use'], s['free'], s['largest_free'])\n"
        "assert all(sys.modules.get(m) is None for m in ('alloc._core', 'alloc._core_testing'))\n",
        str(csv), str(report))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["csv [('alloc', 4096, 'workspace'), ('free', 4096, 'workspace')]",
                                        "4096 4096 4096"]


def test_the_tests_import_this_trees_packages():
    """The test folders carry the packages' names (tests/alloc, tests/indexer...): none may stand
    in for the package it tests, and the packages tested are this tree's."""
    import alloc
    import arena_tools
    import indexer
    import tp
    from tests import support
    for module in (alloc, arena_tools, indexer, tp):
        assert module.__file__ is not None, f"{module.__name__} is a namespace package: {module.__path__}"
        assert pathlib.Path(module.__file__).resolve() == ROOT / module.__name__ / "__init__.py", module.__file__
    assert support.ROOT == ROOT


@pytest.mark.parametrize("value, says", [("bogus", "INDEXER_ARENA_CORE='bogus' is not a build of the C core"),
                                         ("x" * 5000, "(5000 characters) is not a build")])
def test_an_unknown_core_build_is_refused_in_one_bounded_line(value, says):
    done = subprocess.run([sys.executable, "-c", "import alloc._lib"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "INDEXER_ARENA_CORE": value}, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and "InstallError" in last and says in last and len(last) < 400, last
