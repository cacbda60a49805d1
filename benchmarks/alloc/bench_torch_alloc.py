"""What every tensor of a serving process pays: ``torch.empty`` + ``del`` from Python, steady state,
under PyTorch's allocator and under the process scope, each round in a fresh process, the
allocators alternated (A B A B), and ``torch.cuda.memory_stats()`` timed the same way.

Rows: one size at a time (4 KiB, 1 MiB, 16 MiB), mixed sizes (log-uniform 4 KiB-16 MiB), and a mixed
working set (64 tensors kept live, one replaced at a time), each from the main thread and from 4
Python threads at once (each having launched a kernel, as a worker's threads have), with 256 tensors
of mixed sizes live throughout (what memory_stats walks); times per pair (per call for
memory_stats), the fastest of five blocks in each process (the rows' blocks taken in turn), then the
median of each allocator's rounds. Every process runs on the same CPUs (``--cpus``), so that where
the host places a process does not decide its row. The C++ rows time the allocator's allocate() and
free alone, for each size list, from a loop in C++ (``torch_pairs.cpp``, built on first use as
PyTorch builds extensions): what the allocator adds to every tensor, without the Python and tensor
work both allocators share; from one thread and from 4 C++ threads at once, which meet inside the
allocator with no interpreter lock to take turns on. The getDeviceStats row is the allocator's share
of memory_stats, timed from C++ the same way. Beside the goal (every row's median at or below
PyTorch's), the rows where the process scope was behind in more paired rounds than tying
allocators would leave any row 19 times in 20 (one-sided sign tests, the rows taken together).

    python benchmarks/alloc/bench_torch_alloc.py [--iters N] [--rounds R] [--allocators a,b] [--cpus LIST] [--json FILE]
"""

import math
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from alloc.units import KiB, MiB  # noqa: E402
from arena_tools import allocators  # noqa: E402
from benchmarks import harness  # noqa: E402

ALLOCATORS = ("default", "arena")  # of arena_tools.allocators
THREADS = (1, 4)
# Each row's pairs are timed in this many blocks and the fastest kept, the rows' blocks taken in
# turn over the whole process: a slow spell of a shared host then costs a block of a few rows,
# which the fastest block sheds, rather than every block of one row.
BLOCKS = 5
CXX_PAIRS = 8  # the C++ rows' pairs a block over the Python rows'
CXX_SOURCE = Path(__file__).with_name("torch_pairs.cpp")


def size_lists() -> dict[str, list[int]]:
    rng = random.Random(0)
    mixed = [int(4 * KiB * 2 ** rng.uniform(0, 12)) for _ in range(4096)]
    return {"4 KiB": [4 * KiB], "1 MiB": [MiB], "16 MiB": [16 * MiB], "mixed": mixed}


def pairs(torch, sizes: list[int], iters: int, live: int) -> float:
    """Seconds for iters torch.empty + del of sizes in turn; with live > 0 a ring of that many
    tensors stays alive and each new one replaces the oldest."""
    n = len(sizes)
    ring = [None] * live
    start = time.perf_counter()
    for i in range(iters):
        t = torch.empty(sizes[i % n], dtype=torch.uint8, device="cuda")
        if live:
            ring[i % live] = t
        del t
    elapsed = time.perf_counter() - start
    ring.clear()
    return elapsed


def timed(call, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return time.perf_counter() - start


def threaded(work, threads: int, enter=None) -> float:
    """Wall seconds of work() run by threads Python threads started together (one: this thread,
    as a worker's own allocations run); each started thread calls enter() first, untimed."""
    if threads == 1:
        start = time.perf_counter()
        work()
        return time.perf_counter() - start
    barrier = threading.Barrier(threads + 1)

    def body():
        if enter:
            enter()
        barrier.wait()
        work()

    ts = [threading.Thread(target=body) for _ in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - start


def cpu_list(text: str) -> set[int]:
    """'12-15' or '3,5,7-9' as a set of CPU numbers; ValueError with the reason otherwise."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{part.strip()!r} is not a CPU number or range")
        if last and int(last) < int(first):
            raise ValueError(f"{part.strip()!r} runs backwards")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def default_cpus() -> str:
    """The last 4 CPUs this process may run on where it may run on 8 or more (the first ones take
    the host's interrupts and daemons more often), else 'none': too few to set any apart."""
    mine = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, mine[-4:])) if len(mine) >= 8 else "none"


def cxx_pairs():
    """The compiled loop of torch_pairs.cpp (PyTorch's extension cache keeps it between processes)."""
    from torch.utils import cpp_extension
    try:
        return cpp_extension.load("bench_torch_alloc_pairs", [str(CXX_SOURCE)], with_cuda=True,
                                  extra_cflags=["-O2"])
    except Exception as e:  # noqa: BLE001 - the build's own output is long; its last line says why
        why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise SystemExit(f"bench_torch_alloc: building the C++ rows ({CXX_SOURCE.name}) failed: {why}; they need a "
                         "C++ compiler and the CUDA headers, as the process scope's allocator does") from None


def launch(torch) -> None:
    """One kernel from this thread, as a serving worker's threads have launched before they
    allocate: until a thread launches work the CUDA runtime may hold no context current for it,
    and every device lookup both allocators make then takes a slower path."""
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()


def worker(name: str, iters: int, cpus: str) -> dict:
    if cpus != "none":
        os.sched_setaffinity(0, cpu_list(cpus))  # before torch starts its threads, which inherit it
    import torch

    allocators.install(name)
    cxx = cxx_pairs()
    lists = size_lists()
    runs = {}  # row -> (work, threads, pairs a block); memory_stats' "pairs" are calls
    for label, sizes in lists.items():
        for live in ((0, 64) if label == "mixed" else (0,)):
            row = f"{label}{', 64 live' if live else ''}"
            for threads in THREADS:
                per = iters // (threads * BLOCKS)
                work = (lambda sizes=sizes, per=per, live=live: pairs(torch, sizes, per, live))
                runs[f"{row}, {threads} thread{'s' if threads > 1 else ''}"] = (work, threads, per * threads)
                pairs(torch, sizes * 2, len(sizes) * 2, live)  # steady state: every size seen
    for label, sizes in lists.items():  # about 8x faster a pair than from Python: more pairs
        for threads in THREADS:  # the C++ loop starts its own threads, no interpreter lock between them
            per = CXX_PAIRS * iters // BLOCKS // threads * threads
            row = f"{label}, C++ allocate + free{f', {threads} threads' if threads > 1 else ''}"
            runs[row] = (lambda sizes=sizes, per=per, threads=threads: cxx.pairs(sizes, per, threads), 1, per)
    keep = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in lists["mixed"][:256]]
    calls = max(200, iters // 200) // BLOCKS
    runs["torch.cuda.memory_stats()"] = (lambda: timed(torch.cuda.memory_stats, calls), 1, calls)
    runs["getDeviceStats, C++"] = (lambda: cxx.stats(CXX_PAIRS * calls), 1, CXX_PAIRS * calls)
    torch.cuda.memory_stats()
    torch.cuda.synchronize()
    best = {row: float("inf") for row in runs}
    for _ in range(BLOCKS):
        for row, (work, threads, n) in runs.items():
            best[row] = min(best[row], threaded(work, threads, enter=lambda: launch(torch)) / n)
    del keep
    return {"allocator": name, "us": {row: t * 1e6 for row, t in best.items()}, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(), "cpus": cpus}


def paired(results: list[dict], base: str, name: str) -> dict[str, tuple[float, int]]:
    """Each row's median, over the rounds, of name's time over base's in the same round, and the
    number of rounds where name was the faster: A B alternated in fresh processes, each round's two
    ran side by side in time, so a host's slow hour weighs on both of a pair."""
    a = [r for r in results if r["allocator"] == base]
    b = [r for r in results if r["allocator"] == name]
    return {row: (statistics.median(y["us"][row] / x["us"][row] for x, y in zip(a, b)),
                  sum(y["us"][row] < x["us"][row] for x, y in zip(a, b))) for row in a[0]["us"]}


def behind_by_chance(behind: int, rounds: int) -> float:
    """One-sided sign test: how often two allocators that tie leave one behind in ``behind`` or
    more of ``rounds`` paired rounds."""
    return sum(math.comb(rounds, k) for k in range(behind, rounds + 1)) / 2 ** rounds


def main() -> None:
    parser = harness.parser(__doc__, workers=ALLOCATORS, rounds=2)
    parser.add_argument("--iters", type=int, default=100_000, help="pairs per row (default 100,000)")
    parser.add_argument("--allocators", default=",".join(ALLOCATORS))
    parser.add_argument("--cpus", help="run every process on these CPUs, e.g. 12-15 or 3,5 ('none': where the "
                                       "host places it; default: the last 4 of 8 or more, else none)")
    args = parser.parse_args()
    if harness.child(args, lambda a: worker(a.worker, a.iters, a.cpus)):
        return
    cpus = default_cpus() if args.cpus is None else args.cpus.strip()
    if cpus != "none":
        try:
            outside = sorted(cpu_list(cpus) - os.sched_getaffinity(0))
        except ValueError as e:
            parser.error(f"--cpus: {e}; give CPU numbers and ranges such as 12-15 or 3,5, or none")
        if outside:
            parser.error(f"--cpus: CPU {outside[0]} is not one this process may run on "
                         f"(it may run on {len(os.sched_getaffinity(0))}); choose among those, or none")
    names = [n.strip() for n in args.allocators.split(",") if n.strip()]
    bad = [n for n in names if n not in ALLOCATORS]
    if bad or not names:
        parser.error(f"--allocators: unknown allocator {bad[0] if bad else '(none)'}; choose from "
                     f"{', '.join(ALLOCATORS)}")
    if args.iters < 100:
        parser.error(f"--iters must be at least 100, got {args.iters}")
    results = harness.each_allocator(names, __file__, ["--iters", str(args.iters), "--cpus", cpus],
                                     rounds=args.rounds, stop_on_error=True)
    median = {n: {row: statistics.median(r["us"][row] for r in results if r["allocator"] == n)
                  for row in results[0]["us"]} for n in names}
    base = names[0]
    pairs_of = {n: paired(results, base, n) for n in names[1:]}
    harness.table(f"us per torch.empty + del (C++ rows: per allocate + free; memory_stats: per call), fastest "
                  f"of {BLOCKS} blocks, median of {args.rounds} fresh processes each, A B alternated, "
                  f"{args.iters:,} pairs a row, CPUs {cpus}; "
                  f"paired: the median over the rounds of each process over {base}'s of the same round, and in "
                  f"how many rounds it was faster",
                  ("row", *names, *(f"{n} / {base}" for n in names[1:]), *(f"{n} paired" for n in names[1:])),
                  [(row, *(f"{median[n][row]:.3f}" for n in names),
                    *(f"{median[n][row] / median[base][row]:.2f}" for n in names[1:]),
                    *(f"{pairs_of[n][row][0]:.2f}, {pairs_of[n][row][1]} of {args.rounds}" for n in names[1:]))
                   for row in median[base]])
    if "arena" in names and "default" in names:
        # The goal below takes medians, which a tie puts on either side; this line names the rows
        # that fell behind in more rounds than ties would leave any row 19 times in 20, the rows
        # taken together (Bonferroni: each row's chance under 0.05 over the number of rows).
        arena_paired = paired(results, "default", "arena")
        lean = [f"{row} ({args.rounds - ahead} of {args.rounds})" for row, (_, ahead) in arena_paired.items()
                if behind_by_chance(args.rounds - ahead, args.rounds) < 0.05 / len(arena_paired)]
        print(f"behind in more rounds than chance (one-sided sign test, p < 0.05 over the {len(arena_paired)} rows "
              "together): " + ("; ".join(lean) or "no row"))
        slower = [row for row in median["default"] if median["arena"][row] > median["default"][row]]
        harness.goal("the process scope at or below PyTorch's allocator's time in every row", not slower,
                     "slower: " + "; ".join(f"{r} {median['arena'][r] / median['default'][r]:.2f}x" for r in slower)
                     if slower else "every row")
    harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
