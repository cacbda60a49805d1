"""torch.empty + del of mixed sizes (4 KiB to 16 MiB), steady state, under each allocator in a
fresh process: the cost every tensor of a serving process pays.

    python benchmarks/bench_torch_alloc.py [--iters N] [--repeats R] [--json FILE]
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

ALLOCATORS = {"default": "", "expandable": "expandable_segments:True",
              "cuda-async": "backend:cudaMallocAsync", "arena": None}


def worker(name: str, iters: int, repeats: int) -> dict:
    import torch

    import alloc
    if name == "arena":
        alloc.install()
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
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.iters, args.repeats)))
        return
    results = []
    for name, conf in ALLOCATORS.items():
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf or ""}
        done = subprocess.run([sys.executable, __file__, "--worker", name, "--iters", str(args.iters),
                               "--repeats", str(args.repeats)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            results.append({"allocator": name, "error": done.stderr.strip()[-300:]})
        else:
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
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
