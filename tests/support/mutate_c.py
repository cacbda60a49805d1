"""Mutation testing of the C core: realistic one-line changes to csrc/, one at a time, each built and
put to the tests that should notice it. A mutant the tests fail on is killed; one they pass
survives, and either a test is missing or the change is equivalent (it cannot change behaviour).

Every mutant is applied to a copy of the tree (the working tree is never touched): the copy is
made once (with the built core, so that a rebuild compiles the mutated file alone), then for each
mutant the file is changed, the core's test build rebuilt (``tests/support/testing_core.py``), the mutant's tests run with
``pytest -x``, and the file restored.

    nice -n 10 python tests/support/mutate_c.py [--python] [--tree DIR] [--only N,M] [--timeout S]

``--python`` runs the list of Python mutants instead (the readers, the planner, the engine wrapper,
the replay plan: PY_MUTANTS), in the same way without the rebuild; FUZZ_EXAMPLES=10 in the
environment keeps the readers' property tests to seconds.

``--tree`` takes the tests from another checkout (e.g. an older commit, unpacked with
``git archive``), to compare kill rates before and after new tests; the mutants must still apply
there (a line a mutant names that is not found is reported, not counted). It prints one line per
mutant and the kill rate; exit status 0 when every applicable mutant was killed, 1 otherwise.
It is a development tool, not run by the test suite (each mutant takes a rebuild: minutes in all).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARENA = ("tests/alloc/arena/test_basic.py", "tests/alloc/arena/test_stats.py", "tests/alloc/arena/test_property.py")
LIMITS = ("tests/alloc/arena/test_basic.py",)
OOM = ("tests/alloc/plugin/test_cpu.py",)


@dataclass(frozen=True)
class Mutant:
    path: str       # in the tree: a C file is rebuilt, a Python one is read as it is
    before: str     # the text replaced: must occur exactly once in the file
    after: str
    tests: tuple[str, ...]
    why: str        # what the mutant models

    def label(self) -> str:
        return f"{self.path}: {self.why}"


MUTANTS = (
    Mutant("csrc/arena/arena_regions.c", "capacity.current + want > a->opts.limit", "capacity.current + want > a->opts.limit + 1",
           LIMITS, "an arena's limit allows one byte over"),
    Mutant("csrc/arena/arena_regions.c", "capacity.current + want > a->opts.limit", "capacity.current + want >= a->opts.limit",
           LIMITS, "an arena's limit refuses growth that lands on it"),
    Mutant("csrc/arena/arena_regions.c", "capacity.current + want > group;", "capacity.current + want > group + 1;",
           LIMITS, "the device totals' limit allows one byte over"),
    Mutant("csrc/arena/arena_regions.c", "capacity.current + want > group;", "capacity.current + want >= group;",
           LIMITS, "the device totals' limit refuses growth that lands on it"),
    Mutant("csrc/arena/arena_regions.c", "if (!group) return false;", "if (group) return false;",
           LIMITS, "the device totals' limit is never checked"),
    Mutant("csrc/arena/arena_regions.c", "if (_ia_release_free_regions(a)) a->stats.retries++;",
           "_ia_release_free_regions(a);", LIMITS, "a retry after releasing free regions is not counted"),
    Mutant("csrc/arena/arena_regions.c", "return rounded > o->region_min ? rounded : o->region_min;", "return rounded;",
           ARENA, "regions below region_min"),
    Mutant("csrc/arena/arena_stats.c", "if (b->size > largest) largest = b->size;", "largest = b->size;",
           ARENA, "largest free block: the last of its class, not the largest"),
    Mutant("csrc/arena/arena_stats.c", "for (block_t *b = a->bins[fl][sl]; b; b = b->free_next)",
           "for (block_t *b = a->bins[fl][sl]; b && b == a->bins[fl][sl]; b = b->free_next)",
           ARENA, "largest free block: the first of its class only"),
    Mutant("csrc/arena/arena_stats.c", "unsigned sl = _ia_log2_floor(a->sl_bitmap[fl]);",
           "unsigned sl = (unsigned)__builtin_ctz(a->sl_bitmap[fl]);", ARENA,
           "largest free block: looked for in the lowest class of the level"),
    Mutant("csrc/arena/arena_stats.c", "1.0 - (double)out->largest_free / (double)out->free_bytes",
           "(double)out->largest_free / (double)out->free_bytes", ARENA, "fragmentation inverted"),
    Mutant("csrc/arena/arena.c", "b->size - rsize >= a->opts.alignment ?", "b->size - rsize > a->opts.alignment ?",
           ARENA, "a tail of exactly the alignment is not split off"),
    Mutant("csrc/arena/arena.c", "  b->requested = size;\n", "  b->requested = rsize;\n", ARENA,
           "a live block's requested bytes are its rounded size"),
    Mutant("csrc/arena/arena.c", "  if (b->requested > b->size) b->requested = b->size;\n", "", ARENA,
           "a free block may claim more requested bytes than it holds"),
    Mutant("csrc/arena/arena.c", "    tail->requested = b->requested;\n", "    tail->requested = 0;\n", ARENA,
           "a split's free tail forgets the requested bytes"),
    Mutant("csrc/arena/arena.c", "prev->requested = b->requested;", "(void)0;", ARENA,
           "a merge keeps the earlier block's requested bytes"),
    Mutant("csrc/arena/arena.c", "_ia_count_live(a, 1, (int64_t)b->size, (int64_t)size);",
           "_ia_count_live(a, 1, (int64_t)b->size, (int64_t)b->size);", ARENA,
           "requested counted as the block's size"),
    Mutant("csrc/arena/arena.c", "  a->stats.free_blocks++;\n", "", ARENA, "free blocks not counted"),
    Mutant("csrc/torch/plugin_oom.c", "_ia_format_bytes(s.largest_free, largest, sizeof largest));",
           "_ia_format_bytes(s.free_bytes, largest, sizeof largest));", OOM,
           "the OOM message's largest free block is the free bytes"),
    Mutant("csrc/torch/plugin_oom.c", "_ia_format_bytes((uint64_t)s.in_use.current, used, sizeof used),",
           "_ia_format_bytes((uint64_t)s.requested.current, used, sizeof used),", OOM,
           "the OOM message's in-use figure is the requested bytes"),
    Mutant("csrc/torch/plugin_oom.c", "opening, req, size, device, _ia_format_bytes(_ia_plugin.config.budget, budget",
           "opening, req, size + 1, device, _ia_format_bytes(_ia_plugin.config.budget, budget", OOM,
           "the OOM message's byte count is off by one"),
    Mutant("csrc/torch/plugin_oom.c", "_ia_format_bytes((uint64_t)s.capacity.current, cap, sizeof cap), pages,",
           "_ia_format_bytes((uint64_t)s.capacity.peak, cap, sizeof cap), pages,", OOM,
           "the OOM message gives the peak capacity"),
    Mutant("csrc/torch/plugin_oom.c", "if (size <= 1024) snprintf", "if (size < 1024) snprintf", OOM,
           "PyTorch's words: 1024 bytes written as 1.00 KiB"),
)

READERS = ("tests/arena_tools/test_export.py", "tests/arena_tools/test_reader_bounds.py")
REPLAY = ("tests/arena_tools/test_replay.py",)
PLANNER = ("tests/indexer/test_planner.py",)
ENGINES = ("tests/alloc/test_engines.py",)
PY_MUTANTS = (
    Mutant("indexer/planner.py", "if workspace_size < 0 or max_logits_bytes < 0:",
           "if workspace_size < 0 and max_logits_bytes < 0:", PLANNER, "a negative budget alone passes"),
    Mutant("indexer/planner.py", "width = sum(seqs[requests.start - request_offset:requests.stop - request_offset])",
           "width = sum(seqs[requests.start:requests.stop])", PLANNER, "footprints ignore the request offset"),
    Mutant("indexer/planner.py", "out.append((queries.stop - queries.start, width))",
           "out.append((queries.stop, width))", PLANNER, "a footprint's rows from the query slice's end"),
    Mutant("indexer/planner.py", "step = max(1, max_elems // width) if width > 0 else max(1, rows)",
           "step = max(1, max_elems // width + 1) if width > 0 else max(1, rows)", PLANNER,
           "a split piece one row over the budget"),
    Mutant("alloc/engines.py", "if _capturing() or _arena_refusals(plugin, device) == refused:",
           "if _arena_refusals(plugin, device) == refused:", ENGINES, "a refusal in a capture is served outside"),
    Mutant("alloc/engines.py", "if _capturing() or _arena_refusals(plugin, device) == refused:",
           "if _capturing() and _arena_refusals(plugin, device) == refused:", ENGINES,
           "a refusal that is not the arena's is served outside"),
    Mutant("alloc/engines.py", "if nbytes > plugin.installed_config().budget_bytes:",
           "if nbytes >= plugin.installed_config().budget_bytes:", ENGINES, "a request of exactly the budget goes outside"),
    Mutant("alloc/engines.py", "plugin.count_outside(device, nbytes)", "pass", ENGINES, "requests served outside not counted"),
    Mutant("arena_tools/export.py", "                if lenient:\n                    continue\n", "", READERS + REPLAY,
           "a free of an unknown address refused even when allowed"),
    Mutant("arena_tools/export.py", "            if key not in live:\n", "            if False:\n", READERS + REPLAY,
           "a free of an unknown address accepted"),
    Mutant("arena_tools/export.py", "    lenient = allow_unknown_frees or trace.dropped > 0",
           "    lenient = allow_unknown_frees", READERS + REPLAY, "a ring that dropped events is not lenient"),
    Mutant("arena_tools/export.py", "key = (e.device, e.address)\n        if e.action == \"alloc\":\n            if e.size and",
           "key = e.address\n        if e.action == \"alloc\":\n            if e.size and", READERS + REPLAY,
           "frees matched across devices"),
    Mutant("arena_tools/export.py", "if self.size is not None and self.seen > self.size * ITEMS_PER_BYTE:",
           "if self.size is not None and self.seen > 2 * self.size * ITEMS_PER_BYTE:", READERS,
           "the snapshot's item limit doubled"),
    Mutant("arena_tools/export.py", "        walk.take(seg.get(\"blocks\"), f\"{where}.blocks\")\n", "", READERS,
           "a segment's blocks not counted"),
    Mutant("arena_tools/export.py", "        walk.take(entries, f\"device_traces[{d}]\")\n", "", READERS,
           "a device's trace entries not counted"),
    Mutant("arena_tools/export.py", "    check_snapshot(snapshot, path, len(data))", "    check_snapshot(snapshot, path)",
           READERS, "the file's size not passed: no limit"),
    Mutant("arena_tools/export.py", "{excerpt(fields[col[name]])}", "{fields[col[name]]!r}", READERS,
           "a CSV field quoted whole"),
    Mutant("arena_tools/export.py", "found {excerpt(item.get(key))}", "found {item.get(key)!r}", READERS,
           "a snapshot field quoted whole"),
    Mutant("arena_tools/export.py", "MAX_STREAM)\n", "U64_MAX)\n", READERS, "the no-stream value read as a stream"),
    Mutant("alloc/errors.py", "    return text[:limit] + \"...\" + whole", "    return text + whole", READERS,
           "an excerpt not cut"),
    Mutant("alloc/errors.py", "return str(x) if x.bit_length() <= 128 else", "return str(x) if True else", READERS,
           "an integer of many digits written whole"),
    Mutant("arena_tools/report.py", "found {excerpt(block)}", "found {block!r}", READERS, "a report's block quoted whole"),
    Mutant("arena_tools/report.py", "        except ValueError as e:  # JSONDecodeError",
           "        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # JSONDecodeError", READERS,
           "an integer of over 4,300 digits is a traceback"),
    Mutant("arena_tools/plan.py", "            if slot is None:\n                continue", "            if slot is None:\n                pass",
           REPLAY, "a free the trace does not hold replayed"),
    Mutant("arena_tools/plan.py", "            if live_bytes > peak:", "            if live_bytes >= peak:", REPLAY,
           "the live peak's op is the last to reach it"),
)


def copy_tree(source: Path, tests_from: Path | None, into: Path) -> Path:
    """A copy of the working tree (the built core included, not .git); its tests from another
    checkout when given."""
    tree = into / "tree"
    shutil.copytree(source, tree, ignore=shutil.ignore_patterns(".git", "__pycache__", ".hypothesis",
                                                                 ".pytest_cache", "mutants"), symlinks=True)
    if tests_from is not None:
        shutil.rmtree(tree / "tests")
        shutil.copytree(tests_from / "tests", tree / "tests", symlinks=True)
        (tree / "tests" / "support" / "stress").mkdir(parents=True, exist_ok=True)
    return tree


def build(tree: Path) -> bool:
    """The test build of the core (the one the tests load), stamped so that they need not rebuild it."""
    done = subprocess.run([sys.executable, "-c", "from tests.support.testing_core import ensure_built; ensure_built()"],
                          cwd=tree, capture_output=True, text=True)
    return done.returncode == 0


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> bool:
    """True when the tests pass (the mutant survives)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=tree, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return False  # a mutant that hangs the tests is noticed too
    return done.returncode == 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=Path, help="take the tests from this checkout")
    p.add_argument("--only", help="comma-separated mutant numbers (1-based)")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed to one mutant's tests")
    p.add_argument("--python", action="store_true", help="the Python mutants (PY_MUTANTS) instead")
    args = p.parse_args(argv)
    mutants = PY_MUTANTS if args.python else MUTANTS
    chosen = [int(n) for n in args.only.split(",")] if args.only else range(1, len(mutants) + 1)
    with tempfile.TemporaryDirectory(prefix="mutate-c-") as tmp:
        tree = copy_tree(ROOT, args.tree, Path(tmp))
        if not build(tree) or not run_tests(tree, tuple(sorted({t for m in mutants for t in m.tests})),
                                            args.timeout * 3):
            print("the unmutated tree does not build or pass its tests: nothing to measure")
            return 1
        killed = survived = 0
        for n in chosen:
            m = mutants[n - 1]
            path = tree / m.path
            original = path.read_text()
            if original.count(m.before) != 1:
                print(f"{n:2} not applicable ({m.before!r} is not in {m.path} once): {m.label()}")
                continue
            start = time.monotonic()
            path.write_text(original.replace(m.before, m.after))
            try:
                built = build(tree) if m.path.endswith(".c") else True
                alive = built and run_tests(tree, m.tests, args.timeout)
            finally:
                path.write_text(original)
                os.utime(path)  # newer than its object file: the next build compiles it again
                if m.path.endswith(".c"):
                    build(tree)
            if not built:
                print(f"{n:2} not applicable (does not compile): {m.label()}")
                continue
            killed += not alive
            survived += alive
            print(f"{n:2} {'SURVIVED' if alive else 'killed  '} {time.monotonic() - start:5.0f} s  {m.label()}",
                  flush=True)
        total = killed + survived
        print(f"killed {killed} of {total} mutants ({100 * killed / max(total, 1):.0f}%)")
        return 0 if survived == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
