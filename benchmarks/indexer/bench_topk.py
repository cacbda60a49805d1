#!/usr/bin/env python
"""Top-k configs side by side against ``torch.topk``: the sampled pass 1 (one read for most rows)
against two reads, and the sample's size.

    python benchmarks/indexer/bench_topk.py [--rounds 5] [--json FILE]
    python benchmarks/indexer/bench_topk.py --smoke      # toy sizes on the CPU (Triton interpreter)

Per row kind (full rows, and causal rows with ``-inf`` past each row's end for ``torch.topk``):
each config's median ms over ``--rounds`` interleaved ``do_bench`` rounds on the same normal
logits ([4096, 65536], k = 2048), its speed-up over ``torch.topk(sorted=False)`` timed in the
same rounds, whether its sets are torch's, and the rows per path (``topk.path_counts``). This
is the measurement behind ``TopkConfig``'s defaults.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402


def parse_args(argv=None):
    p = harness.parser(__doc__, rounds=5, rounds_help="interleaved do_bench rounds")
    p.add_argument("--smoke", action="store_true",
                   help="toy sizes on the CPU (Triton interpreter); checks the program only")
    return p.parse_args(argv)


def configs(topk, k: int, device: str) -> dict:
    base = topk.default_config(k, device)
    smaller = dataclasses.replace(base, runs=base.runs // 2)
    return {"default": base,
            "two reads": dataclasses.replace(base, sampled=False),
            f"two reads, pass 2 blocks of {2 * base.collect_block}":
                dataclasses.replace(base, sampled=False, collect_block=2 * base.collect_block),
            f"sampled, {smaller.runs * smaller.run}-entry sample": smaller}


def main():
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported
    import torch
    import triton
    from benchmarks.indexer.cases import topk_rows, torch_topk_sets
    from indexer import topk

    if args.smoke:
        device, m, n, k = "cpu", 4, 1000, 32
    elif torch.cuda.is_available():
        device, m, n, k = "cuda", 4096, 65536, 2048
    else:
        sys.exit("bench_topk needs a CUDA GPU (or --smoke, which runs toy sizes on the CPU)")

    def ms(fn):
        if args.smoke:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")

    gen = torch.Generator(device=device).manual_seed(7)
    cfgs = configs(topk, k, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU, interpreted"
    table, results = [], []
    for causal in (False, True):
        x, ks, ke = topk_rows(torch.randn(m, n, generator=gen, device=device), causal)
        out = torch.empty((m, k), dtype=torch.int32, device=device)
        theirs = torch_topk_sets(x, ke, k)
        fns, facts = {}, {}
        for label, cfg in cfgs.items():
            fns[label] = lambda cfg=cfg: topk.top_k_per_row(x, ks, ke, k, out, config=cfg,
                                                            return_path=True)
            _, path = fns[label]()
            facts[label] = (torch.equal(out.long().sort(1).values, theirs),
                            topk.path_counts(path))
        fns["torch.topk(sorted=False)"] = lambda: torch.topk(x, k, dim=1, sorted=False)
        times = {label: [] for label in fns}
        for _ in range(args.rounds):   # interleaved, so drifts of the clock hit all alike
            for label, fn in fns.items():
                times[label].append(ms(fn))
        t_torch = statistics.median(times["torch.topk(sorted=False)"])
        rows = "causal" if causal else "full"
        table.append((rows, "torch.topk(sorted=False)", f"{t_torch:.3f}", "1.00", "", ""))
        for label in cfgs:
            t = statistics.median(times[label])
            same, paths = facts[label]
            table.append(("", label, f"{t:.3f}", f"{t_torch / t:.2f}", str(same),
                          " ".join(f"{p} {c}" for p, c in paths.items() if c)))
            results.append(dict(rows=rows, config=label, spec=repr(cfgs[label]), ms=t,
                                torch_ms=t_torch, speedup=t_torch / t, same_sets=same,
                                paths=paths))
    harness.table(f"top-{k} over [{m}, {n}] ({name}, torch {torch.__version__}, "
                  f"Triton {triton.__version__})",
                  ("rows", "config", "ms", "vs torch.topk", "same sets", "rows per path"), table,
                  justify="left", width=150)
    harness.write_json(args.json, results)
    if not all(r["same_sets"] for r in results):
        sys.exit("some config's sets differ from torch.topk's")


if __name__ == "__main__":
    main()
