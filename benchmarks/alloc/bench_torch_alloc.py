"""torch.empty + del of mixed sizes (4 KiB to 16 MiB), steady state, under each allocator in a
fresh process: the cost every tensor of a serving process pays.

    python benchmarks/alloc/bench_torch_alloc.py [--iters N] [--repeats R] [--json FILE]
"""

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from arena_tools import allocators  # noqa: E402
from benchmarks import harness  # noqa: E402

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
    parser = harness.parser(__doc__, workers=ALLOCATORS)
    parser.add_argument("--iters", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if harness.child(args, lambda a: worker(a.worker, a.iters, a.repeats)):
        return
    results = harness.each_allocator(ALLOCATORS, __file__, ["--iters", str(args.iters),
                                                           "--repeats", str(args.repeats)])
    base = next(r["us_per_pair"] for r in results if r["allocator"] == "default" and "error" not in r)
    harness.table(f"torch.empty + del, mixed 4 KiB-16 MiB, median of {args.repeats} x {args.iters:,}",
                  ("allocator", "us / pair", "vs default"),
                  [(r["allocator"], "failed", r["error"][-80:]) if "error" in r else
                   (r["allocator"], f"{r['us_per_pair']:.2f}", f"{r['us_per_pair'] / base:.2f}")
                   for r in results])
    harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
