"""The house's rules, held by tests: no function over 80 lines in library code, and the C core's
folders built on each other one way (the budget arena on nothing else). Files are cut by concern;
about 600 lines is a guideline for when to look for a second concern, not a rule (docs/development.md)."""
import ast
import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("alloc", "arena_tools", "indexer", "tp")
SOURCE_SUFFIXES = {".py", ".c", ".h", ".cpp", ".sh"}
MAX_FUNCTION_LINES = 80


def _sources():
    # .engines: the engine conformance suite's environments (tests/engines), gigabytes of others' code;
    # .torch-tests: PyTorch's test file that benchmarks/alloc/torch_tests.py runs
    skip = {".venv", "build", ".git", "scratch", "__pycache__", ".hypothesis", ".whl", "gpu-out", ".engines",
            ".torch-tests"}
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip]  # never walked into, not only filtered out
        for name in files:
            rel = (Path(folder) / name).relative_to(ROOT)
            if rel.suffix in SOURCE_SUFFIXES and not rel.name.startswith("_core."):
                found.append(rel)
    yield from sorted(found)


def _python_functions(path):
    tree = ast.parse((ROOT / path).read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


_C_SIGNATURE = re.compile(r"^[A-Za-z_][\w\s\*]*\b(\w+)\s*\(")


def _c_functions(path):
    """A definition starts at a column-0 line naming `name(` and ends at the next line that is
    `}` alone; struct and array initialisers end in `};` and are not counted."""
    lines = (ROOT / path).read_text().splitlines()
    start = name = None
    for number, line in enumerate(lines, 1):
        match = _C_SIGNATURE.match(line)
        if match and not line.rstrip().endswith(";") and not line.startswith(("typedef", "#")):
            start, name = number, match.group(1)
        elif line.rstrip() == "}" and start is not None:
            yield name, start, number - start + 1
            start = None
        elif line.startswith("};"):
            start = None


def _library_functions():
    for rel in _sources():
        if rel.parts[0] in LIBRARY and rel.suffix == ".py":
            yield from ((rel, *f) for f in _python_functions(rel))
        elif rel.parts[0] == "csrc" and rel.suffix in {".c", ".cpp"}:
            yield from ((rel, *f) for f in _c_functions(rel))


def test_the_c_scanner_finds_functions_and_their_length(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "x.c").write_text(
        "static const int table[] = {\n  1,\n};\n"
        "static int add(int a,\n                int b) {\n  return a + b;\n}\n"
        "int main(void) {\n  if (1) {\n  }\n  return 0;\n}\n")
    assert list(_c_functions(Path("x.c"))) == [("add", 4, 4), ("main", 8, 5)]


def test_no_library_function_is_over_80_lines():
    long = [f"{path}:{line} {name} ({length} lines)" for path, name, line, length
            in _library_functions() if length > MAX_FUNCTION_LINES]
    assert not long, "functions over 80 lines: " + ", ".join(long)


def test_the_scan_sees_the_library():
    seen = {path.parts[0] for path, *_ in _library_functions()}
    assert {"alloc", "indexer", "tp", "csrc"} <= seen


# ---- the C core's folders (csrc/README.md): the budget arena stands alone --------------------------

CSRC = ROOT / "csrc"
_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
# What each folder may include of the core's: the arena nothing else, the PyTorch allocator the
# arena, the test machinery everything (csrc/indexer_arena.h, the public header, is "public").
MAY_INCLUDE = {"arena": {"arena"}, "torch": {"arena", "torch"}, "testing": {"arena", "torch", "testing", "public"},
               "public": {"arena", "torch"}}
PYTORCH_HEADERS = ("torch/", "c10/", "ATen/", "cuda_runtime", "cuda.h")


def include_graph() -> dict[str, set[str]]:
    """csrc/'s files and the core's files each includes (paths relative to csrc/); system and
    PyTorch headers under "<...>"."""
    graph = {}
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in {".c", ".h", ".cpp"}:
            continue
        found = set()
        for kind, name in _INCLUDE.findall(path.read_text()):
            if kind == "<":
                found.add(f"<{name}>")
            else:
                found.add(str((path.parent / name).resolve().relative_to(CSRC.resolve())))
        graph[str(path.relative_to(CSRC))] = found
    return graph


def _folder(path: str) -> str:
    return path.split("/")[0] if "/" in path else "public"


def test_each_folder_of_the_core_includes_only_what_it_builds_on():
    graph = include_graph()
    assert {_folder(s) for s in graph} == set(MAY_INCLUDE)
    wrong = [f"{source} includes {target}" for source, targets in graph.items() for target in targets
             if not target.startswith("<") and _folder(target) not in MAY_INCLUDE[_folder(source)]]
    assert not wrong, wrong


def test_the_budget_arena_includes_no_pytorch_header():
    graph = include_graph()
    seen = {s for s in graph if s.startswith("arena/")}
    assert {"arena/arena.c", "arena/arena.h", "arena/private.h"} <= seen
    pytorch = [f"{s} includes {t}" for s in seen for t in graph[s] if t.startswith("<") and
               t[1:].startswith(PYTORCH_HEADERS)]
    assert not pytorch, pytorch


def test_the_arenas_private_state_is_seen_by_the_arenas_files_alone():
    users = {s for s, targets in include_graph().items() if "arena/private.h" in targets}
    assert users and all(u.startswith("arena/arena") for u in users), users


def test_the_budget_arena_links_alone(tmp_path):
    """No call from csrc/arena/ into the PyTorch allocator or the test machinery: its files make a
    library with no undefined symbol beyond the C library's (the calls between folders go one way;
    the production extension, built without csrc/testing/, shows the same for csrc/torch/)."""
    from alloc import _build
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    done = subprocess.run([*cc, "-shared", "-fPIC", "-std=gnu11", "-O0", f"-I{CSRC}",
                           *map(str, _build.sources(_build.ARENA)), "-Wl,--no-undefined", "-ldl", "-lpthread",
                           "-o", str(tmp_path / "arena.so")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
