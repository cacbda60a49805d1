"""The installed command as a new user meets it: its name in help, --version, a reader that goes
away after one line, every subcommand without the optional rich and matplotlib, convert between
CSV and memory_viz snapshot, tables that wrap instead of cutting, and errors that name the right
format."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import ROOT

SEED_TRACE = os.path.join(ROOT, "examples", "seed_report", "trace.csv")
SEED_REPORT = os.path.join(ROOT, "examples", "seed_report", "report.json")


def python(code: str, *args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, **kw)


def as_installed(*argv: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """The command as the installed script runs it (argv[0] 'indexer-arena'), with the modules
    of ``block`` made unimportable as if their extra were not installed."""
    code = ("import sys\n"
            f"for name in {list(block)!r}: sys.modules[name] = None\n"
            "sys.argv[0] = '/usr/local/bin/indexer-arena'\n"
            "from arena_tools.__main__ import main\nsys.exit(main(sys.argv[1:]))")
    return python(code, *argv)


def test_help_names_the_command_as_typed():
    done = as_installed("fit", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: indexer-arena fit"), done.stdout[:200]
    done = as_installed("--help")
    assert done.stdout.startswith("indexer-arena COMMAND") and "indexer-arena --version" in done.stdout
    for command in ("report", "replay", "convert", "keys"):
        assert as_installed(command, "--help").stdout.startswith(f"usage: indexer-arena {command}")
    module = subprocess.run([sys.executable, "-m", "arena_tools", "fit", "--help"], capture_output=True,
                            text=True, cwd=ROOT, timeout=300)
    assert module.stdout.startswith("usage: python -m arena_tools fit")


def test_version():
    from importlib.metadata import PackageNotFoundError, version
    try:
        expected = version("indexer-arena")
    except PackageNotFoundError:
        expected = "unknown (not installed)"
    done = as_installed("--version")
    assert done.returncode == 0 and done.stdout == f"indexer-arena {expected}\n", done.stdout + done.stderr


@pytest.mark.parametrize("argv", [["--help"], ["fit", "--help"], ["keys"], ["--version"]])
def test_a_reader_that_went_away_after_the_first_line_is_no_error(argv):
    # `indexer-arena --help | head -1`: the reading end closes; the write or the final flush meets it.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "arena_tools", *argv], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=300)
    finally:
        os.close(write_end)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, \
        done.stderr


@pytest.mark.parametrize("argv, codes, expect", [
    (["fit", "--available-mb", "8192"], (1,), "verdict for the arena allocator: FITS"),
    (["fit", "--available-mb", "8192", "--summary"], (1,), "verdict for the default allocator"),
    (["report", SEED_REPORT], (0,), "free blocks by size"),
    (["report", SEED_TRACE], (0,), "arenas"),
    (["replay", SEED_TRACE, "--allocators", "host"], (0,), "peak memory"),
    (["keys"], (0,), "budget_mb"),
])
def test_every_command_works_without_rich_or_matplotlib(argv, codes, expect):
    done = as_installed(*argv, block=("rich", "matplotlib"))
    assert done.returncode in codes and expect in done.stdout, done.stdout[-800:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "ModuleNotFoundError" not in done.stderr


def test_what_needs_matplotlib_says_so_in_one_line(tmp_path):
    done = as_installed("fit", "--available-mb", "8192", "--plot", str(tmp_path / "fit.png"),
                        block=("matplotlib",))
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert "--plot needs matplotlib" in line and "pip install matplotlib" in line


def test_convert_csv_to_a_snapshot_and_back(tmp_path):
    snapshot, back = tmp_path / "seed.pickle", tmp_path / "back.csv"
    done = as_installed("convert", SEED_TRACE, str(snapshot))
    assert done.returncode == 0 and "memory_viz snapshot of 214 events" in done.stdout, done.stderr
    from arena_tools import export
    loaded = export.load_snapshot(snapshot)
    assert sum(len(t) for t in loaded["device_traces"]) >= 214
    done = as_installed("convert", str(snapshot), str(back))
    assert done.returncode == 0 and "CSV trace" in done.stdout, done.stderr
    with open(SEED_TRACE) as f:
        assert back.read_text() == f.read()


@pytest.mark.parametrize("content", [b"", b"garbage\0\1", b"\x80\x04truncated"])
def test_convert_and_report_name_the_pickle_they_could_not_read(tmp_path, content):
    bad = tmp_path / "snapshot.pickle"
    bad.write_bytes(content)
    for argv in (["report", str(bad)], ["convert", str(bad), str(tmp_path / "out.csv")]):
        done = as_installed(*argv)
        assert done.returncode == 2 and done.stdout == ""
        [line] = done.stderr.splitlines()
        assert "not a readable memory snapshot pickle" in line and "header" not in line, line


@pytest.mark.parametrize("rich", [True, False])
def test_tables_wrap_numbers_instead_of_cutting_them(rich):
    code = ("import sys, io\n"
            + ("" if rich else "sys.modules['rich'] = None\n")
            + "from arena_tools.textout import Console, Table\n"
            "buf = io.StringIO()\nt = Table(title='t')\n"
            "for c in ('a', 'b', 'c'): t.add_column(c, justify='right', no_wrap=True)\n"
            "t.add_row('12,345,678,901.5 MiB', '98,765,432.1 MiB', '1,234,567,890,123')\n"
            "Console(file=buf, width=30).print(t)\nprint(buf.getvalue())")
    done = python(code)
    out = done.stdout
    assert done.returncode == 0, done.stderr
    assert max(map(len, out.splitlines())) <= 30 and "…" not in out, out
    digits = sum(ch.isdigit() for ch in "12,345,678,901.5 98,765,432.1 1,234,567,890,123")
    assert sum(ch.isdigit() for ch in out) == digits, out  # every digit is there: folded, not cut


def _in_use(argv) -> int:
    import json
    done = as_installed("report", *argv, "--json", "-")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    return sum(s["in_use"] for s in data["summary"])


def test_report_at_the_peak_as_well_as_at_the_end(tmp_path):
    with open(SEED_TRACE) as f:
        largest = max(int(line.split(",")[4]) for line in f.read().splitlines()[1:])
    assert largest == 536_870_400  # one piece at a time: the peak is the largest, near the budget
    assert _in_use([SEED_TRACE]) == 0  # every piece freed at the end
    assert _in_use([SEED_TRACE, "--at", "peak"]) == largest
    snapshot = tmp_path / "seed.pickle"
    assert as_installed("convert", SEED_TRACE, str(snapshot)).returncode == 0
    assert _in_use([str(snapshot), "--at", "peak"]) == largest
    done = as_installed("report", SEED_REPORT, "--at", "peak")
    assert done.returncode == 2 and "--at peak takes a CSV trace or a snapshot pickle" in done.stderr


def test_the_peak_prefix_ends_at_the_first_highest_moment():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from alloc.records import Event
    from arena_tools.report import peak_prefix

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 1 << 20)), max_size=60))
    def check(ops):
        events, live, held, history = [], {}, 0, [0]
        for is_alloc, slot, size in ops:
            if is_alloc and slot not in live:
                live[slot] = size
                held += size
                events.append(Event(0, 0, "alloc", 4096 * (slot + 1), size, 0, 0, "workspace"))
            elif not is_alloc and slot in live:
                held -= live.pop(slot)
                events.append(Event(0, 0, "free", 4096 * (slot + 1), size, 0, 0, "workspace"))
            else:
                continue
            history.append(held)
        cut, best = peak_prefix(events)
        assert best == max(history) and history[cut] == best and best not in history[:cut]
    check()


def _main_job(*argv):
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("INDEXER_ARENA_CONF", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", "seed_workload.py"), *argv],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_the_main_job_without_a_gpu_tells_the_story_first():
    pytest.importorskip("torch")
    done = _main_job()
    if "No CUDA device here" not in done.stdout:
        pytest.skip("this machine has CUDA: the main job compares the allocators on it")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert done.stdout.startswith("The seed workload: the sparse-attention indexer's logits")
    assert "PyTorch's default allocator would hold 14,034 MiB by the end of the prefill" in text
    assert "27 times the 512 MiB the arena is given; the arena holds 514 MiB" in text
    assert "crosses it at chunk 50 (160,000 tokens)" in text
    assert "verdict for the default allocator: DOES NOT FIT" in text and "verdict for the arena allocator: FITS" in text
    assert "rows/piece" not in text  # the per-chunk table only with --chunks
    chunks = _main_job("--chunks")
    assert chunks.returncode == 0 and "rows/piece" in chunks.stdout
    assert chunks.stdout.index("verdict for the default") < chunks.stdout.index("rows/piece")
    other = _main_job("--allocators", "default,arena")
    assert other.returncode == 0 and other.stdout.startswith("The seed workload")
    assert "(--allocators default,arena: each allocator runs on a GPU only)" in other.stdout
