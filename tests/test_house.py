"""The house's size rules for the C core, held by a test: no function over 80 lines and no file
over 600 lines in csrc/."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "csrc"
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600

_C_SIGNATURE = re.compile(r"^[A-Za-z_][\w\s\*]*\b(\w+)\s*\(")


def _c_functions(path):
    """A definition starts at a column-0 line naming `name(` and ends at the next line that is
    `}` alone; struct and array initialisers end in `};` and are not counted."""
    lines = path.read_text().splitlines()
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


def _core_sources(suffixes):
    return sorted(p for p in CORE.iterdir() if p.suffix in suffixes)


def test_the_c_scanner_finds_functions_and_their_length(tmp_path):
    source = tmp_path / "x.c"
    source.write_text(
        "static const int table[] = {\n  1,\n};\n"
        "static int add(int a,\n                int b) {\n  return a + b;\n}\n"
        "int main(void) {\n  if (1) {\n  }\n  return 0;\n}\n")
    assert list(_c_functions(source)) == [("add", 4, 4), ("main", 8, 5)]


def test_the_scan_sees_the_core():
    names = {name for path in _core_sources({".c", ".cpp"}) for name, *_ in _c_functions(path)}
    assert {"ia_arena_alloc", "ia_arena_free", "ia_torch_alloc", "ia_plugin_configure"} <= names


def test_no_core_function_is_over_80_lines():
    long = [f"{path.name}:{line} {name} ({length} lines)" for path in _core_sources({".c", ".cpp"})
            for name, line, length in _c_functions(path) if length > MAX_FUNCTION_LINES]
    assert not long, "functions over 80 lines: " + ", ".join(long)


def test_no_core_file_is_over_600_lines():
    long = [f"{path.name} ({n} lines)" for path in _core_sources({".c", ".h", ".cpp"})
            if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, "files over 600 lines: " + ", ".join(long)
