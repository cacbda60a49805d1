"""Builds and runs the arena microbenchmark (bench_arena.c): median nanoseconds per alloc+free pair
on one thread and on four threads sharing one arena, beside glibc malloc/free in the same run.

    python benchmarks/bench_arena.py [--pairs N] [--repeats R] [--json FILE]
"""

import argparse
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sysconfig
import tempfile

from rich.console import Console
from rich.table import Table

ROOT = pathlib.Path(__file__).resolve().parent.parent


def build(out: pathlib.Path) -> pathlib.Path:
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    exe = out / "bench_arena"
    subprocess.run([*cc, "-O2", "-std=gnu11", "-pthread", f"-I{ROOT / 'csrc'}",
                    str(ROOT / "benchmarks" / "bench_arena.c"),
                    *map(str, sorted((ROOT / "csrc").glob("*.c"))), "-ldl", "-o", str(exe)], check=True)
    return exe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2_000_000, help="pairs per thread per run")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(pathlib.Path(tmp))
        for threads in (1, 4):
            runs = subprocess.run([str(exe), str(threads), str(args.pairs), str(args.repeats)],
                                  check=True, capture_output=True, text=True).stdout.split("\n")
            by = {"arena": [], "malloc": []}
            for line in filter(None, runs):
                name, _, ns = line.split()
                by[name].append(float(ns))
            results.append({"threads": threads, **{f"{k}_ns": statistics.median(v) for k, v in by.items()}})
    table = Table(title=f"alloc+free pair, median of {args.repeats} runs of {args.pairs:,} pairs per thread")
    for col in ("threads", "arena ns/pair", "glibc malloc ns/pair", "arena / malloc"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["threads"]), f"{r['arena_ns']:.1f}", f"{r['malloc_ns']:.1f}",
                      f"{r['arena_ns'] / r['malloc_ns']:.2f}")
    Console().print(table)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
