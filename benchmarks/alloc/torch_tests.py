"""PyTorch's own CUDA tests under PyTorch's allocator and under the process scope, each test in a
fresh process under each allocator, and a table of which tests pass under each.

The test file is PyTorch's (``test/test_cuda.py`` of pytorch/pytorch at a commit the caller names;
it stays outside this tree). Its tests are collected once, the graph and memory-tooling groups
selected by name, and every selected test run as ``pytest FILE::CLASS::TEST`` in a child that, for
``arena``, calls ``alloc.install()`` before anything starts CUDA. Children run --jobs at a time;
every test whose outcome differs between the allocators is run again alone under both, since some
take half the device or read its free memory, and that run's outcome is the one reported. The goal: every
selected test that passes under PyTorch's allocator passes under the arena.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import harness  # noqa: E402

ALLOCATORS = ("default", "arena")
# Test names by group: what captures CUDA graphs, and what exercises PyTorch's memory tools.
GROUPS = {
    "graphs": re.compile(r"graph|capture"),
    "memory": re.compile(r"memory|snapshot|history|viz|fraction|oom|mem_?pool|caching_allocator|"
                         r"empty_cache|allocat|reserved|stats"),
}
PRELUDE = {
    "default": "",
    "arena": "import alloc\nalloc.install()\n",
}
# Names a newer test file imports from PyTorch's testing helpers that an older torch lacks, with
# the value they have under both allocators compared here; set only where missing.
COMPAT = {"TEST_CUDAMALLOCASYNC": False}
RUN = f"""
import sys
import pytest
import torch.testing._internal.common_utils as common_utils
for name, value in {COMPAT!r}.items():
    if not hasattr(common_utils, name):
        setattr(common_utils, name, value)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""
# PyTorch's file runs under a configuration of its own, not this repository's pytest settings.
CONFIG = "[pytest]\n"
OUTCOMES = ("failed", "error", "passed", "skipped", "xfailed", "xpassed")


def pytest_args(tests: Path) -> list[str]:
    """What every child's pytest gets first: the file's own folder as its root and an empty
    configuration there, written once (node ids are then relative to that folder)."""
    config = tests.parent / ".torch_tests.ini"
    if not config.exists():
        config.write_text(CONFIG)
    return ["-c", str(config), "--rootdir", str(tests.parent)]


def collect(tests: Path, timeout: float) -> list[str]:
    """The node ids of every test in the file, as pytest collects them."""
    done = subprocess.run([sys.executable, "-c", RUN, *pytest_args(tests), "--collect-only", tests.name],
                          capture_output=True, text=True, timeout=timeout, cwd=tests.parent)
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"torch_tests: collecting {tests} found no tests:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return ids


def select(ids: list[str], groups: list[str], pattern: str | None) -> dict[str, list[str]]:
    """The ids of each group, by the test's own name (the part after the last '::')."""
    extra = re.compile(pattern) if pattern else None
    out = {}
    for g in groups:
        out[g] = [i for i in ids if GROUPS[g].search(i.rsplit("::", 1)[-1]) and (not extra or extra.search(i))]
    return out


def run_one(tests: Path, node: str, allocator: str, timeout: float) -> dict:
    """One test under one allocator in a fresh process: its outcome and the tail of its output."""
    t0 = time.monotonic()
    # Tests that build C++ extensions build them under one name: children side by side would load
    # each other's half-written or other-variant builds, so each builds in a folder of its own.
    extensions = tempfile.mkdtemp(prefix="torch_tests_ext_")
    try:
        done = subprocess.run([sys.executable, "-c", PRELUDE[allocator] + RUN, *pytest_args(tests), "-rA", "-x", node],
                              capture_output=True, text=True, timeout=timeout, cwd=tests.parent,
                              env={**os.environ, "TORCH_EXTENSIONS_DIR": extensions})
        out = done.stdout + done.stderr
        outcome = outcome_of(out, done.returncode)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        outcome = "timeout"
    finally:
        shutil.rmtree(extensions, ignore_errors=True)
    return {"test": node, "allocator": allocator, "outcome": outcome, "seconds": round(time.monotonic() - t0, 1),
            "tail": "" if outcome in ("passed", "skipped") else out[-4000:]}


def outcome_of(output: str, returncode: int) -> str:
    """pytest's verdict from its last summary line; 'crashed' when the process died without one."""
    for line in reversed(output.strip().splitlines()):
        if re.search(r"\b(passed|failed|error|skipped|xfailed|xpassed)\b.* in [0-9.]+s", line):
            found = [o for o in OUTCOMES if re.search(rf"\b\d+ {o}", line)]
            return found[0] if found else "unknown"
    return "crashed" if returncode < 0 or returncode not in (0, 1, 5) else "error"


def first_error(tail: str) -> str:
    for line in tail.splitlines():
        if re.match(r"^E\s+\w*(Error|Exception|assert)", line) or "Error:" in line[:120]:
            return line.strip()[:200]
    return tail.strip().splitlines()[-1][:200] if tail.strip() else ""


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--tests", required=True, help="PyTorch's test/test_cuda.py")
    p.add_argument("--groups", default="graphs,memory", help="of: " + ", ".join(GROUPS))
    p.add_argument("-k", dest="pattern", help="only node ids matching this regular expression too")
    p.add_argument("--jobs", type=int, default=8, help="children at a time (default 8)")
    p.add_argument("--timeout", type=float, default=180, help="seconds a test may take (default 180)")
    p.add_argument("--log", help="append each result here as a JSON line as soon as it is known")
    p.add_argument("--alone", type=int, default=None,
                   help="run at most this many differing tests again alone (default: all of them)")
    args = p.parse_args()
    tests = Path(args.tests).resolve()
    if not tests.is_file():
        p.error(f"--tests: no file at {args.tests}")
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    bad = [g for g in groups if g not in GROUPS]
    if bad or not groups:
        p.error(f"--groups: unknown group {bad[0] if bad else '(none)'}; choose from {', '.join(GROUPS)}")
    if args.jobs < 1:
        p.error(f"--jobs must be a positive integer, got {args.jobs}")

    selected = select(collect(tests, args.timeout), groups, args.pattern)
    nodes = sorted({n for ids in selected.values() for n in ids})
    print(f"torch_tests: {len(nodes)} tests ({', '.join(f'{g} {len(v)}' for g, v in selected.items())})",
          file=sys.stderr, flush=True)
    log = open(args.log, "a") if args.log else None

    def one(node: str, allocator: str) -> dict:
        r = run_one(tests, node, allocator, args.timeout)
        if log:
            log.write(json.dumps(r) + "\n")
            log.flush()
        return r

    work = [(n, a) for n in nodes for a in ALLOCATORS]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = {(r["test"], r["allocator"]): r for r in pool.map(lambda w: one(*w), work)}
    again = sorted({n for n in nodes if results[(n, "default")]["outcome"] != results[(n, "arena")]["outcome"]})
    again = again[:args.alone] if args.alone is not None else again
    print(f"torch_tests: {len(again)} tests again, one at a time", file=sys.stderr, flush=True)
    for n in again:
        for a in ALLOCATORS:
            r = one(n, a)
            r["parallel_outcome"] = results[(n, a)]["outcome"]
            results[(n, a)] = r

    rows, summary, differ = [], {}, []
    for g, ids in selected.items():
        native = [n for n in ids if results[(n, "default")]["outcome"] == "passed"]
        ours = [n for n in native if results[(n, "arena")]["outcome"] == "passed"]
        summary[g] = {"selected": len(ids), "pass_default": len(native), "pass_both": len(ours)}
        rows.append([g, len(ids), len(native), len(ours)])
        differ += [n for n in native if n not in ours and n not in differ]
    harness.table("PyTorch's tests, each in a fresh process", ["group", "selected", "pass (PyTorch's allocator)",
                                                               "of those, pass (arena)"], rows)
    if differ:
        harness.table("passing under PyTorch's allocator only", ["test", "arena", "first error"],
                      [[n.rsplit("::", 2)[-2] + "::" + n.rsplit("::", 1)[-1], results[(n, "arena")]["outcome"],
                        first_error(results[(n, "arena")]["tail"])] for n in differ], justify="left")
    harness.goal("every selected test that passes under PyTorch's allocator passes under the arena", not differ,
                 ", ".join(f"{g} {s['pass_both']}/{s['pass_default']}" for g, s in summary.items()))
    harness.write_json(args.json, {"tests": str(tests), "summary": summary, "differ": differ,
                                   "results": sorted(results.values(), key=lambda r: (r["test"], r["allocator"]))})
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
