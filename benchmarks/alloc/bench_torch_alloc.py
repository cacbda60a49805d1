"""torch.empty + del of mixed sizes (4 KiB to 16 MiB), steady state, under each allocator in a
fresh process: the cost every tensor of a serving process pays.

    python benchmarks/alloc/bench_torch_alloc.py [--iters N] [--repeats R] [--json FILE]
"""

import argparse
import json
import random
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

from arena_tools import allocators

ALLOCATORS = ("default", "expandable", "cuda-async", "arena")  # of arena_tools.allocators


def worker(name: str, iters: int, repeats: int) -> dict:
    import torch

    allocators.install(name)
    rng = random.Random(0)
    sizes = [int(4096 * 2 ** rng.uniform(0, 12)) for _ in range(4096)]  # log-uniform 4 KiB..16 MiB
    for s in sizes:  # steady state: every size class has been seen once
        t = torch.empty(s, dtype=torch.uint8, device="cuda")
        del t
    torch.cuda.synchronize()
    per_pair = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(iters):
            t = torch.empty(sizes[i & 4095], dtype=torch.uint8, device="cuda")
            del t
        per_pair.append((time.perf_counter() - start) / iters * 1e6)
    return {"allocator": name, "us_per_pair": statistics.median(per_pair), "runs": per_pair,
            "torch": torch.__version__, "device": torch.cuda.get_device_name()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=list(ALLOCATORS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        allocators.write_result(args.result, worker(args.worker, args.iters, args.repeats))
        return
    results = allocators.run_each(ALLOCATORS, lambda name, result: [
        sys.executable, __file__, "--worker", name, "--result", result, "--iters", str(args.iters),
        "--repeats", str(args.repeats)])
    base = next(r["us_per_pair"] for r in results if r["allocator"] == "default" and "error" not in r)
    table = Table(title=f"torch.empty + del, mixed 4 KiB-16 MiB, median of {args.repeats} x {args.iters:,}")
    for col in ("allocator", "us / pair", "vs default"):
        table.add_column(col, justify="right")
    for r in results:
        if "error" in r:
            table.add_row(r["allocator"], "failed", r["error"][-80:])
        else:
            table.add_row(r["allocator"], f"{r['us_per_pair']:.2f}", f"{r['us_per_pair'] / base:.2f}")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
