"""Builds and runs the arena microbenchmark (bench_arena.c) and reports the C core beside glibc
malloc/free in the same run: what an alloc+free pair costs as a multiple of glibc's, on one thread
and on four threads sharing one allocator, for one arena and for the plugin's process-scope general
pools on host memory (what PyTorch's calls reach, minus PyTorch).

    python benchmarks/alloc/bench_arena.py [--pairs N] [--repeats R] [--json FILE] [--require-goals]

Only ratios are reported: an absolute time on a shared host measures the host as much as the
allocator, and glibc slows with it. Each repeat runs the three allocators, each in a process of its
own (glibc's heap adapts to whatever ran before it in a process), in an order rotated every repeat,
so that running first or last favours none; a ratio is taken within a repeat, and the table gives
the median over the repeats with their range.

Goals, on one thread (what a serving worker's Python threads, which hold the GIL while they
allocate, see): an alloc+free pair in the arena costs at most 1.5x glibc's, and through the
plugin's entry points at most 2x glibc's. Four threads are reported without a goal: all four queue
on one lock per arena, as they would on PyTorch's one mutex per device; on a machine with fewer
than four cores every figure also includes time spent waiting for a core, glibc's too.
"""

import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import sysconfig
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root

from benchmarks import harness  # noqa: E402

ALLOCATORS = ("arena", "plugin", "malloc")
# At most this many times glibc's pair, on one thread, in the same run.
GOALS = {"arena": 1.5, "plugin": 2.0}
WHAT = {"arena": "an alloc+free pair in the arena",
        "plugin": "an alloc+free pair through the plugin's entry points"}


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def build(out: pathlib.Path) -> pathlib.Path:
    """The C program built into ``out`` from the production extension's sources (the arena, and
    PyTorch's allocator for the general pools' row) and bench_arena.c."""
    from alloc import _build
    exe = out / "bench_arena"
    subprocess.run([*compiler(), "-O2", "-std=gnu11", "-pthread", f"-I{_build.CSRC}",
                    str(ROOT / "benchmarks" / "alloc" / "bench_arena.c"),
                    *map(str, _build.sources(_build.PRODUCTION)), "-ldl", "-o", str(exe)], check=True)
    return exe


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cc = subprocess.run([*compiler(), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        cc = "unknown"
    return {"cpu": model, "cores": os.cpu_count(), "compiler": cc}


def measure(exe: pathlib.Path, threads: int, args) -> dict:
    """Every allocator's ns per pair in each repeat (each run a process of its own, the order
    rotated every repeat), and the core's ratios to glibc within each repeat."""
    runs = {name: [] for name in ALLOCATORS}
    for rep in range(args.repeats):
        for k in range(len(ALLOCATORS)):
            name = ALLOCATORS[(rep + k) % len(ALLOCATORS)]
            out = subprocess.run([str(exe), name, str(threads), str(args.pairs), "1"],
                                 check=True, capture_output=True, text=True).stdout
            runs[name].append(float(out.split()[2]))
    ratios = {name: [ns / glibc for ns, glibc in zip(runs[name], runs["malloc"])] for name in GOALS}
    return {"threads": threads, "runs": runs, "ratios": ratios,
            "median_ratio": {name: statistics.median(r) for name, r in ratios.items()}}


def goals(results: list[dict]) -> list[dict]:
    one = next(r for r in results if r["threads"] == 1)
    return [{"goal": f"1 thread: {WHAT[name]} costs at most {bound:g}x glibc's in the same run",
             "value": one["median_ratio"][name], "shown": f"{one['median_ratio'][name]:.2f}x",
             "met": one["median_ratio"][name] <= bound}
            for name, bound in GOALS.items()]


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--pairs", type=int, default=2_000_000, help="pairs per thread per run")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--require-goals", action="store_true", help="exit 1 when a goal is not met")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(pathlib.Path(tmp))
        results = [measure(exe, threads, args) for threads in (1, 4)]

    def cell(r, name):
        low, high = min(r["ratios"][name]), max(r["ratios"][name])
        return f"{r['median_ratio'][name]:.2f}x ({low:.2f}-{high:.2f})"
    harness.table(f"alloc+free pair as a multiple of glibc's in the same repeat, median (range) of "
                  f"{args.repeats} repeats of {args.pairs:,} pairs per thread",
                  ("threads", "arena / glibc", "plugin general pools / glibc"),
                  [(str(r["threads"]), cell(r, "arena"), cell(r, "plugin")) for r in results])
    checked = goals(results)
    for g in checked:
        harness.goal(g["goal"], g["met"], g["shown"])
    print("4 threads: no goal (one lock per arena, as PyTorch's one mutex per device)")
    m = machine()
    print(f"machine: {m['cpu']}, {m['cores']} cores; compiler: {m['compiler']}")
    if m["cores"] and m["cores"] < 4:
        print(f"note: {m['cores']} cores, so 4 threads oversubscribe the machine (every allocator waits for a core)")
    harness.write_json(args.json, {"machine": m, "results": results, "goals": checked}, indent=2)
    if args.require_goals and not all(g["met"] for g in checked):
        sys.exit(1)


if __name__ == "__main__":
    main()
