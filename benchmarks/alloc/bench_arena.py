"""Builds and runs the arena microbenchmark (bench_arena.c): median nanoseconds per alloc+free pair
on one thread and on four threads sharing one arena, for the arena with thread caches, the same
arena without them (one lock for every operation), the plugin's process-scope general pools on host
memory (what PyTorch's calls reach, minus PyTorch), and glibc malloc/free, all in the same run, and
whether the goals of issue 19 are met (they are about the arena with thread caches).

    python benchmarks/alloc/bench_arena.py [--pairs N] [--repeats R] [--thread-cache-mib M] [--json FILE]
                                     [--require-goals]

Hosts differ in clock, so the table also gives the arena's cycles per pair: its nanoseconds times
the clock that a chain of dependent additions runs at (printed with the machine). Each allocator's
range over the repeats follows, and a note when glibc's one-thread repeats spread past UNSTEADY
times their fastest: the machine's own speed moved during the run.

Goals: one thread at most 50 ns per pair; four threads at most 2.0x glibc's time per pair. Each
repeat runs the four allocators, each in a process of its own (glibc's heap adapts to whatever
ran before it in a process), in an order rotated every repeat, so that running first or last
favours none. On a machine with fewer than four cores, four threads oversubscribe it: every figure
then includes time spent waiting for a core, glibc's too.
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

ONE_THREAD_NS = 50.0
FOUR_THREADS_RATIO = 2.0
ALLOCATORS = ("arena", "locked", "plugin", "malloc")
# glibc's slowest one-thread repeat past this many times its fastest: the machine's own speed moved
# during the run (benchmarks/RESULTS.md, "Two speeds of process on one host").
UNSTEADY = 1.25


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def build(out: pathlib.Path, tree: pathlib.Path = ROOT) -> pathlib.Path:
    """The C program built into ``out`` from ``tree``'s csrc/ and bench_arena.c (this repository's
    by default; compare_cores.py builds other trees' with the same flags)."""
    exe = out / "bench_arena"
    subprocess.run([*compiler(), "-O2", "-std=gnu11", "-pthread", f"-I{tree / 'csrc'}",
                    str(tree / "benchmarks" / "alloc" / "bench_arena.c"),
                    *map(str, sorted((tree / "csrc").glob("*.c"))), "-ldl", "-o", str(exe)], check=True)
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


def goals(results: list[dict]) -> list[dict]:
    by = {r["threads"]: r for r in results}
    out = []
    if 1 in by:
        v = by[1]["arena_ns"]
        out.append({"goal": f"1 thread: arena <= {ONE_THREAD_NS:.0f} ns per pair", "value": v,
                    "shown": f"{v:.1f} ns", "met": v <= ONE_THREAD_NS})
    if 4 in by:
        v = by[4]["arena_ns"] / by[4]["malloc_ns"]
        out.append({"goal": f"4 threads: arena / glibc <= {FOUR_THREADS_RATIO:.1f}", "value": v,
                    "shown": f"{v:.2f} ({by[4]['arena_ns']:.0f} / {by[4]['malloc_ns']:.0f} ns)",
                    "met": v <= FOUR_THREADS_RATIO})
    return out


def clock_ghz(exe: pathlib.Path) -> float | None:
    word = subprocess.run([str(exe), "clock"], check=True, capture_output=True, text=True).stdout.split()[1]
    return None if word == "-" else float(word)


def cache_protocol(exe: pathlib.Path) -> str:
    """How the thread caches' owners and other threads keep apart here: membarrier or exchange."""
    return subprocess.run([str(exe), "protocol"], check=True, capture_output=True, text=True).stdout.split()[1]


def measure(exe: pathlib.Path, threads: int, args) -> dict:
    """Every allocator's median over the repeats, each run a process of its own, the order
    rotated every repeat."""
    by = {name: [] for name in ALLOCATORS}
    for rep in range(args.repeats):
        for k in range(len(ALLOCATORS)):
            name = ALLOCATORS[(rep + k) % len(ALLOCATORS)]
            out = subprocess.run([str(exe), name, str(threads), str(args.pairs), "1",
                                  str(args.thread_cache_mib)],
                                 check=True, capture_output=True, text=True).stdout
            by[name].append(float(out.split()[2]))
    return {"threads": threads, **{f"{k}_ns": statistics.median(v) for k, v in by.items()}, "runs": by}


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--pairs", type=int, default=2_000_000, help="pairs per thread per run")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--thread-cache-mib", type=int, default=16,
                        help="each thread's cache in the arena (the plugin's small pool: 16)")
    parser.add_argument("--require-goals", action="store_true", help="exit 1 when a goal is not met")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(pathlib.Path(tmp))
        ghz = clock_ghz(exe)
        protocol = cache_protocol(exe)
        results = [measure(exe, threads, args) for threads in (1, 4)]
    harness.table(f"alloc+free pair, median of {args.repeats} runs of {args.pairs:,} pairs per thread",
                  ("threads", f"arena ns/pair ({args.thread_cache_mib} MiB thread caches)",
                   "arena ns/pair (no caches)", "plugin general pools ns/pair", "glibc malloc ns/pair",
                   "arena / glibc", "arena cycles/pair"),
                  [(str(r["threads"]), f"{r['arena_ns']:.1f}", f"{r['locked_ns']:.1f}", f"{r['plugin_ns']:.1f}",
                    f"{r['malloc_ns']:.1f}", f"{r['arena_ns'] / r['malloc_ns']:.2f}",
                    f"{r['arena_ns'] * ghz:.0f}" if ghz else "-")
                   for r in results])
    for r in results:
        ranges = ", ".join(f"{name} {min(r['runs'][name]):.1f}-{max(r['runs'][name]):.1f}" for name in ALLOCATORS)
        print(f"repeats at {r['threads']} thread{'s' if r['threads'] > 1 else ''}, ns/pair: {ranges}")
    glibc = results[0]["runs"]["malloc"]
    if max(glibc) > UNSTEADY * min(glibc):
        print(f"note: glibc's one-thread repeats ranged {min(glibc):.1f}-{max(glibc):.1f} ns: the machine's speed "
              f"moved during the run, and absolute figures (the one-thread goal's) with it; ratios less so")
    checked = goals(results)
    for g in checked:
        harness.goal(g["goal"], g["met"], g["shown"])
    m = {**machine(), "clock_ghz": ghz, "cache_protocol": protocol}
    clock = f"{ghz:.2f} GHz (dependent additions)" if ghz else "not measured"
    print(f"machine: {m['cpu']}, {m['cores']} cores, clock {clock}; compiler: {m['compiler']}; "
          f"thread caches: {protocol}")
    if m["cores"] and m["cores"] < 4:
        print(f"note: {m['cores']} cores, so 4 threads oversubscribe the machine (every allocator waits for a core)")
    harness.write_json(args.json, {"machine": m, "thread_cache_mib": args.thread_cache_mib,
                                   "results": results, "goals": checked}, indent=2)
    if args.require_goals and not all(g["met"] for g in checked):
        sys.exit(1)


if __name__ == "__main__":
    main()
