"""Compares C cores on the arena microbenchmark (bench_arena.c): each core is built from its own
tree and every case runs as a process of its own, the cores alternated (A B A B, the order rotated
every round), so that clocks, neighbours and order decide nothing; the table gives each core's
median ns per pair and its median ratio to the first core over the rounds (each ratio taken
within one round).

    python benchmarks/alloc/compare_cores.py LABEL=SOURCE [LABEL=SOURCE ...] [--rounds N]
                                             [--pairs N] [--json FILE]

SOURCE is a git revision of this repository (its csrc/ and benchmarks/alloc/bench_arena.c are
taken with `git archive`) or a directory holding those two, for a machine with no git checkout.
Cases: the arena with 16 MiB thread caches at one and four threads, with 64 MiB caches at one
thread (nearly every request served by the cache: the fast path alone), without caches at one
thread (the locked path), and glibc malloc at one and four threads, built with the first core.
The goals are bench_arena.py's, judged for each core on its medians.

Then the one-thread cases with 16 and 64 MiB caches again, every core in one process
(bench_cores.c: each core a shared library, the cores alternated every --pairs / 8 pairs, --rounds
times 8): where a host runs each process at one of two speeds, the processes' medians can move by
more than a change is worth, while ratios taken within one process see the same speed on both
sides. glibc runs in that process too, each of its slices beside the cores': the first core's
share of glibc's time slice by slice shows whether a slow stretch of the machine slows both alike.
Those figures compare cores; bench_arena.c's are the ones the goals are judged on.
"""

import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import NoReturn

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root

from benchmarks import harness  # noqa: E402
from benchmarks.alloc.bench_arena import build, compiler, goals, machine  # noqa: E402

# (case, allocator, threads, pairs divisor, thread cache MiB)
CASES = (("1 thread", "arena", 1, 1, 16), ("4 threads", "arena", 4, 2, 16), ("1 thread, 64 MiB", "arena", 1, 1, 64),
         ("1 thread, no caches", "locked", 1, 2, 16))
GLIBC = (("glibc, 1 thread", "malloc", 1, 1, 16), ("glibc, 4 threads", "malloc", 4, 2, 16))
FILES = ("csrc", "benchmarks/alloc/bench_arena.c")
# (case, thread cache MiB) run in one process; every core's library is built with initial-exec
# thread-local storage, as near as a shared library comes to bench_arena's static link, which
# needs room in the static TLS block for all of them.
IN_ONE_PROCESS = (("1 thread, one process", 16), ("1 thread, 64 MiB, one process", 64))
SLICES = 8
TUNABLE = "glibc.rtld.optional_static_tls=1048576"
BENCH_CORES = ROOT / "benchmarks" / "alloc" / "bench_cores.c"


def fail(message: str) -> NoReturn:
    print(f"compare_cores: {message}", file=sys.stderr)
    sys.exit(2)


def parse_core(text: str) -> tuple[str, str]:
    label, sep, source = text.partition("=")
    if not sep or not label or not source:
        fail(f"a core is LABEL=SOURCE (a git revision or a directory), got {text!r}")
    return label, source


def tree(source: str, into: pathlib.Path) -> pathlib.Path:
    """The directory holding the core's csrc/ and bench_arena.c: SOURCE itself, or its git archive."""
    path = pathlib.Path(source)
    if path.is_dir():
        missing = [f for f in FILES if not (path / f).exists()]
        if missing:
            fail(f"{source} is a directory without {' and '.join(missing)}: give a tree holding both")
        return path
    into.mkdir(parents=True)
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", source, *FILES], capture_output=True)
    except OSError as e:
        fail(f"{source} is not a directory, and git cannot run here to archive it as a revision ({e})")
    if archive.returncode != 0:
        why = (archive.stderr.decode(errors="replace").strip().splitlines() or ["no reason given"])[-1]
        fail(f"{source} is neither a directory nor a revision git can archive here ({why})")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run(label: str, exe: pathlib.Path, allocator: str, threads: int, pairs: int, cache_mib: int) -> float:
    done = subprocess.run([str(exe), allocator, str(threads), str(pairs), "1", str(cache_mib)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"{label}'s bench_arena {allocator} {threads} failed (exit {done.returncode}): "
             f"{' '.join(done.stderr.split())[-300:]}")
    return float(done.stdout.split()[2])


def build_in_one_process(out: pathlib.Path, trees: list[pathlib.Path]) -> list[pathlib.Path]:
    """bench_cores.c's driver into ``out``, then one shared library for each tree, in order."""
    flags = ["-O2", "-std=gnu11", "-pthread"]
    subprocess.run([*compiler(), *flags, f"-I{ROOT / 'csrc'}", str(BENCH_CORES), "-ldl", "-o",
                    str(out / "bench_cores")], check=True)
    libraries = []
    for k, tree in enumerate(trees):
        library = out / f"core-{k}.so"
        subprocess.run([*compiler(), *flags, "-fPIC", "-shared", "-fvisibility=hidden", "-ftls-model=initial-exec",
                        "-DBENCH_CORES_LIBRARY", f"-I{tree / 'csrc'}", str(BENCH_CORES),
                        *map(str, sorted((tree / "csrc").glob("*.c"))), "-ldl", "-o", str(library)], check=True)
        libraries.append(library)
    return [out / "bench_cores", *libraries]


def run_in_one_process(programs: list[pathlib.Path], rounds: int, pairs: int, cache_mib: int) -> list[list[float]]:
    """Each round's ns per pair, one list per core and a last one for glibc."""
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(filter(None, (env.get("GLIBC_TUNABLES"), TUNABLE)))
    exe, *libraries = programs
    done = subprocess.run([str(exe), str(rounds), str(pairs), str(cache_mib), *map(str, libraries), "malloc"],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        fail(f"bench_cores failed (exit {done.returncode}): {' '.join(done.stderr.split())[-300:]}")
    per_round = [[float(x) for x in line.split()[2:]] for line in done.stdout.splitlines()]
    return [list(core) for core in zip(*per_round)]


def main() -> None:
    parser = harness.parser(__doc__, rounds=8, rounds_help="passes over every case and core, alternated")
    parser.add_argument("cores", nargs="+", metavar="LABEL=SOURCE")
    parser.add_argument("--pairs", type=int, default=1_000_000,
                        help="pairs per thread at one thread (half that at four, and without caches)")
    args = parser.parse_args()
    if args.pairs < 2:
        parser.error(f"--pairs must be at least 2, got {args.pairs}")
    cores = [parse_core(c) for c in args.cores]
    labels = [label for label, _ in cores]
    if len(set(labels)) != len(labels):
        fail(f"every core needs a label of its own, got {', '.join(labels)}")
    if "glibc" in labels:
        fail("the label glibc names glibc's own rows: give the core another")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        exes, trees = {}, []
        for label, source in cores:
            out = tmp / f"build-{len(exes)}"
            out.mkdir()
            trees.append(tree(source, tmp / f"tree-{len(exes)}"))
            try:
                exes[label] = build(out, trees[-1])
            except subprocess.CalledProcessError:
                fail(f"{label} ({source}): bench_arena.c did not build against its csrc/ (the compiler's "
                     "errors are above)")
        try:
            in_one = build_in_one_process(tmp, trees)
        except subprocess.CalledProcessError:
            fail("a core did not build as bench_cores.c's shared library (the compiler's errors are above)")
        jobs = [(name, label, alloc, threads, pairs, mib) for name, alloc, threads, pairs, mib in CASES
                for label in labels]
        jobs += [(name, labels[0], alloc, threads, pairs, mib) for name, alloc, threads, pairs, mib in GLIBC]
        times: dict[tuple[str, str], list[float]] = {(name, label): [] for name, label, *_ in jobs}
        for r in range(args.rounds):
            for k in range(len(jobs)):
                name, label, alloc, threads, pairs, mib = jobs[(r + k) % len(jobs)]
                times[name, label].append(run(label, exes[label], alloc, threads, args.pairs // pairs, mib))
        for name, mib in IN_ONE_PROCESS:
            *runs, times[name, "glibc"] = run_in_one_process(in_one, args.rounds * SLICES,
                                                             max(1, args.pairs // SLICES), mib)
            for label, t in zip(labels, runs):
                times[name, label] = t
    first = labels[0]
    rows, results = [], []
    for name, *_ in (*CASES, *IN_ONE_PROCESS):
        base = times[name, first]
        for label in labels:
            t = times[name, label]
            ratio = statistics.median(x / b for x, b in zip(t, base))
            results.append({"case": name, "core": label, "median_ns": statistics.median(t), "runs": t,
                            "median_ratio_to_first": ratio})
            rows.append((name, label, f"{statistics.median(t):.1f}", f"{min(t):.1f}-{max(t):.1f}",
                         "1" if label == first else f"{ratio:.2f}"))
    for name, *_ in GLIBC:
        t = times[name, first]
        results.append({"case": name, "core": "glibc", "median_ns": statistics.median(t), "runs": t})
        rows.append((name, "glibc", f"{statistics.median(t):.1f}", f"{min(t):.1f}-{max(t):.1f}", ""))
    for name, _ in IN_ONE_PROCESS:
        t, base = times[name, "glibc"], times[name, first]
        shares = [b / x for x, b in zip(t, base)]
        results.append({"case": name, "core": "glibc", "median_ns": statistics.median(t), "runs": t,
                        "first_core_share": shares})
        rows.append((name, "glibc", f"{statistics.median(t):.1f}", f"{min(t):.1f}-{max(t):.1f}",
                     f"{first}'s share {statistics.median(shares):.2f} ({min(shares):.2f}-{max(shares):.2f})"))
    harness.table(f"alloc+free pair, {args.rounds} rounds, cores alternated (in one process: "
                  f"{args.rounds * SLICES} slices of {max(1, args.pairs // SLICES):,} pairs)",
                  ("case", "core", "median ns/pair", "range", f"median ratio to {first}"), rows)
    glibc4 = statistics.median(times["glibc, 4 threads", first])
    judged = []
    for label in labels:  # bench_arena.py's goals, judged on this core's medians
        core = goals([{"threads": 1, "arena_ns": statistics.median(times["1 thread", label])},
                      {"threads": 4, "arena_ns": statistics.median(times["4 threads", label]), "malloc_ns": glibc4}])
        for g in core:
            harness.goal(f"{label}: {g['goal']}", g["met"], g["shown"])
        judged.append({"core": label, "one_thread_met": core[0]["met"], "four_threads_met": core[1]["met"]})
    m = machine()
    print(f"machine: {m['cpu']}, {m['cores']} cores; compiler: {m['compiler']}")
    harness.write_json(args.json, {"machine": m, "cores": dict(cores), "results": results, "goals": judged},
                       indent=2)


if __name__ == "__main__":
    main()
