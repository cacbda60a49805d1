"""The seed workload, the project's main job: the indexer's logits workspace during the chunked
prefill of a 254,000-token prompt (3,200-token chunks, compress ratio 4, 512 MiB budget).

Each chunk's logits are float32 [rows, width] with width = cdiv(cdiv(tokens so far, 4), 64) * 64,
cut into pieces of at most budget // (width * 4) rows; each piece is allocated, filled, top-k'd
and freed. With a GPU, every allocator runs the workload in a fresh process and the table shows,
side by side, the device memory taken (cudaMemGetInfo delta from the first allocation on), the
allocator's device calls and the wall time. Without one, the workspace runs on the host-backed
arena (the same C core over host memory) beside the fit check's model of PyTorch's allocator.

    python examples/seed_workload.py [--allocators default,expandable,cuda-async,arena,arena-workspace]
                                       [--prompt-tokens N] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from rich.console import Console
from rich.table import Table

from alloc.units import MiB, fmt_mib
from arena_tools import allocators
from arena_tools.allocators import ALLOCATORS

TOPK = 2048


def workload(args):
    from arena_tools.fit import seed_workload
    return list(seed_workload(args.prompt_tokens, args.chunk_tokens, args.compress_ratio,
                              args.budget_mb * MiB, topk=0))


def run_on_gpu(args) -> dict:
    """One allocator, this process. The allocator is chosen before torch touches CUDA."""
    import torch

    import alloc
    scope = allocators.install(args.worker, alloc.Config(budget_mb=args.budget_mb))
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    workspace = alloc.workspace if scope else contextlib.nullcontext

    def device_calls() -> int:
        if scope == "process":
            return alloc.memory_stats()["num_device_alloc"]
        if args.worker == "cuda-async":
            return -1  # the driver's pool does not report its own growth
        calls = torch.cuda.memory_stats().get("num_device_alloc", 0)
        if scope == "workspace":  # the pool's segments come from the arena's one reservation
            stats = alloc.memory_stats()
            calls += stats["arena.workspace.backend_reserves"] - len(alloc.pool_snapshot())
        return calls

    rows, peak = [], 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for plan in workload(args):
        for piece_rows in plan.pieces:
            with workspace():
                logits = torch.empty(piece_rows, plan.width, dtype=torch.float32, device="cuda")
            logits.uniform_(generator=gen)
            values, indices = torch.topk(logits, min(TOPK, plan.width), dim=1, sorted=False)
            del logits, values, indices
        torch.cuda.synchronize()
        used = free0 - torch.cuda.mem_get_info()[0]
        peak = max(peak, used)
        rows.append({"chunk": plan.index, "tokens": plan.seen, "piece_bytes": plan.piece_bytes,
                     "device_bytes": used, "device_calls": device_calls()})
    wall = time.perf_counter() - start
    out = {"allocator": args.worker, "wall_s": wall, "peak_device_bytes": peak, "chunks": rows,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if scope:
        stats = alloc.memory_stats()
        out["workspace_device_calls"] = stats["arena.workspace.backend_reserves"]
        out["workspace_capacity"] = stats["arena.workspace.capacity"]
    return out


def compare_on_gpu(args) -> list[dict]:
    return allocators.run_each(args.allocators, lambda name, result: [
        sys.executable, __file__, "--worker", name, "--result", result, *_common(args)])


def _common(args) -> list[str]:
    return ["--prompt-tokens", str(args.prompt_tokens), "--chunk-tokens", str(args.chunk_tokens),
            "--compress-ratio", str(args.compress_ratio), "--budget-mb", str(args.budget_mb)]


def at_tokens(result: dict, tokens: int) -> dict:
    return next(r for r in result["chunks"] if r["tokens"] >= tokens)


def print_gpu_table(results: list[dict], console: Console) -> None:
    ok = [r for r in results if "error" not in r]
    table = Table(title="seed workload: device memory taken (cudaMemGetInfo delta), device calls, wall time")
    for col in ("allocator", "MiB at 3,200", "MiB at 166,400", "peak MiB", "MiB at end",
                "device calls", "wall s", "wall / default"):
        table.add_column(col, justify="right")
    base = next((r["wall_s"] for r in ok if r["allocator"] == "default"), None)
    for r in results:
        if "error" in r:
            table.add_row(r["allocator"], *["-"] * 6, f"failed: {r['error']}")
            continue
        calls = r["chunks"][-1]["device_calls"]
        table.add_row(r["allocator"], fmt_mib(at_tokens(r, 3200)['device_bytes']),
                      fmt_mib(at_tokens(r, 166_400)['device_bytes']),
                      fmt_mib(r['peak_device_bytes']), fmt_mib(r['chunks'][-1]['device_bytes']),
                      "n/a" if calls < 0 else str(calls), f"{r['wall_s']:.2f}",
                      f"{r['wall_s'] / base:.2f}" if base else "-")
    console.print(table)
    for arena in (r for r in ok if "workspace_capacity" in r):
        console.print(f"{arena['allocator']}: workspace reserved {arena['workspace_capacity'] / MiB:.0f} MiB with "
                      f"{arena['workspace_device_calls']} device call(s); device memory from the first "
                      f"chunk to the last: {min(c['device_bytes'] for c in arena['chunks']) / MiB:.0f}"
                      f"-{max(c['device_bytes'] for c in arena['chunks']) / MiB:.0f} MiB")


def simulate_on_host(args, console: Console) -> dict:
    """No GPU: the workspace on the host-backed arena, every piece checked with canaries at both
    ends, beside the modelled default allocator of the fit check."""
    import ctypes

    from alloc import Arena
    from arena_tools.fit import fit, print_table
    plans = workload(args)
    budget = args.budget_mb * MiB
    start = time.perf_counter()
    with Arena(budget, backend="host", name="workspace arena (host)") as arena:
        for plan in plans:
            for piece_rows in plan.pieces:
                size = piece_rows * plan.width * 4
                p = arena.allocate(size)
                head, tail = (p ^ size).to_bytes(8, "little"), (~(p ^ size) & (2**64 - 1)).to_bytes(8, "little")
                ctypes.memmove(p, head, 8)
                ctypes.memmove(p + size - 8, tail, 8)
                assert ctypes.string_at(p, 8) == head and ctypes.string_at(p + size - 8, 8) == tail
                arena.free(p)
        stats = arena.stats()
        arena.check()
    wall = time.perf_counter() - start
    report = fit(max_model_len=max(args.prompt_tokens, 1), chunk_tokens=args.chunk_tokens,
                 compress_ratio=args.compress_ratio, budget_mb=args.budget_mb,
                 prompt_tokens=args.prompt_tokens)
    print_table(report, file=sys.stdout)
    console.print(f"host-backed arena: {len(plans)} chunks, {stats['blocks_allocated']} pieces served from "
                  f"one {stats['capacity'] / MiB:.0f} MiB reservation ({stats['backend_reserves']} backend "
                  f"call), peak in use {stats['in_use_peak'] / MiB:.0f} MiB, {wall:.2f} s")
    return {"mode": "host simulation", "arena": stats, "fit": report.to_dict(), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocators", default=",".join(ALLOCATORS),
                        type=lambda s: [a for a in s.split(",") if a])
    parser.add_argument("--prompt-tokens", type=int, default=254_000)
    parser.add_argument("--chunk-tokens", type=int, default=3_200)
    parser.add_argument("--compress-ratio", type=int, default=4)
    parser.add_argument("--budget-mb", type=int, default=512)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", choices=list(ALLOCATORS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in args.allocators:
        if name not in ALLOCATORS:
            parser.error(f"unknown allocator {name!r}; accepted: {', '.join(ALLOCATORS)}")
    for flag in ("prompt_tokens", "chunk_tokens", "compress_ratio", "budget_mb"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    from arena_tools.paths import unwritable
    if args.json and unwritable(args.json, "--json"):
        parser.error(unwritable(args.json, "--json"))
    if args.worker:
        allocators.write_result(args.result, run_on_gpu(args))
        return
    console = Console()
    import torch
    if torch.cuda.is_available():
        results = compare_on_gpu(args)
        print_gpu_table(results, console)
    else:
        chosen = ", ".join(args.allocators)
        console.print("no CUDA device: simulating the workspace on the host-backed arena"
                      + ("" if chosen == ",".join(ALLOCATORS) else f" (--allocators {chosen} needs a GPU)"))
        results = simulate_on_host(args, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
