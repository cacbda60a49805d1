"""The house's size rules, held by a test: no function over 80 lines in library code and no
source file over 600 lines outside the kernel files (whose kernels are long by nature)."""
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("alloc", "arena_tools", "indexer", "tp")
KERNEL_FILES = {"indexer/logits.py", "indexer/logits_hopper.py", "indexer/topk.py"}
SOURCE_SUFFIXES = {".py", ".c", ".h", ".cpp", ".sh"}
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600


def _sources():
    skip = {".venv", "build", ".git", "scratch", "__pycache__", ".hypothesis", ".whl", "gpu-out",
            ".torch-tests"}
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if path.is_file() and path.suffix in SOURCE_SUFFIXES and not skip & set(rel.parts) \
                and not rel.name.startswith("_core."):
            yield rel


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


def test_no_source_file_is_over_600_lines_outside_the_kernel_files():
    long = []
    for rel in _sources():
        count = len((ROOT / rel).read_text().splitlines())
        if count > MAX_FILE_LINES and str(rel) not in KERNEL_FILES:
            long.append(f"{rel} ({count} lines)")
    assert not long, "files over 600 lines: " + ", ".join(long)
