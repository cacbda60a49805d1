"""The seed workload, the project's main job: the indexer's logits workspace during the chunked
prefill of a 254,000-token prompt (3,200-token chunks, compress ratio 4, 512 MiB budget).

Each chunk's logits are float32 [rows, width] with width = cdiv(cdiv(tokens so far, 4), 64) * 64,
cut into pieces of at most budget // (width * 4) rows; each piece is allocated, filled, top-k'd
and freed. With a GPU, every allocator runs the workload in a fresh process and the table shows,
side by side, the device memory taken (cudaMemGetInfo delta from the first allocation on), the
allocator's device calls and the wall time. Without one, it tells the story first (what PyTorch's
allocator would hold on the seed's H200 against the arena's budget, and both verdicts for the
seed's GB10 memory, from the fit check's model), then runs the workspace on the host-backed arena
(the same C core over host memory); --chunks adds the fit check's per-chunk table.

    python examples/seed_workload.py [--allocators default,expandable,cuda-async,arena,arena-workspace]
                                       [--prompt-tokens N] [--chunks] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from alloc.units import MiB, fmt_mib
from arena_tools import allocators
from arena_tools.allocators import ALLOCATORS
from arena_tools.textout import Console, Table, terminal_columns

TOPK = 2048
GB10_AVAILABLE_MIB = 118_477
"""A GB10's (DGX Spark) available memory as reported: /proc/meminfo's MemAvailable read 115.7 GiB
(cudaMemGetInfo's free, which leaves out reclaimable page cache, 41.5 GiB)."""
MEASURED_H200 = {"reserved_end_mib": 14_034, "device_end_mib": 14_124}
"""The seed workload on one H200, torch 2.11 (benchmarks/RESULTS.md): torch.cuda.memory_reserved()
and the device memory taken (cudaMemGetInfo) at the end of the prefill."""


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


def run_on_host_arena(args) -> dict:
    """The workspace on the host-backed arena (the C core over host memory), every piece checked
    with canaries at both ends; returns the arena's statistics and the wall time."""
    import ctypes

    from alloc import Arena
    budget = args.budget_mb * MiB
    start = time.perf_counter()
    with Arena(budget, backend="host", name="workspace arena (host)") as arena:
        for plan in workload(args):
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
    return {"stats": stats, "wall_s": time.perf_counter() - start}


def story(args, report, gb10, host: dict) -> list[str]:
    """What the main job says on a machine without a GPU, before any table."""
    from arena_tools.fit import summary_lines
    seed = (args.prompt_tokens, args.chunk_tokens, args.compress_ratio, args.budget_mb) == (254_000, 3_200, 4, 512)
    held, budget = report.default_peak / MiB, args.budget_mb
    crossing = gb10.row(gb10.default_crossing) if gb10.default_crossing else None
    measured = (f" (measured on an H200, torch 2.11: {MEASURED_H200['reserved_end_mib']:,} MiB reserved, "
                f"{MEASURED_H200['device_end_mib']:,} MiB of device memory)") if seed else ""
    stats = host["stats"]
    return [
        f"The seed workload: the sparse-attention indexer's logits during the chunked prefill of a "
        f"{args.prompt_tokens:,}-token prompt ({args.chunk_tokens:,}-token chunks, compress ratio "
        f"{args.compress_ratio}), workspace budget {budget:,} MiB. No CUDA device here: PyTorch's "
        "allocator is fit's model of it, the arena is its C core over host memory.",
        "",
        f"PyTorch's default allocator would hold {held:,.0f} MiB by the end of the prefill{measured}, "
        f"{held / budget:.0f} times the {budget:,} MiB the arena is given; the arena holds "
        f"{report.arena_peak / MiB:,.0f} MiB from the first chunk to the last.",
        f"On the seed's GB10 (DGX Spark, {GB10_AVAILABLE_MIB:,} MiB available, vLLM's "
        f"--gpu-memory-utilization 0.9), the workspace has {gb10.available_bytes / MiB:,.0f} MiB: "
        + (f"PyTorch's allocator crosses it at chunk {crossing.chunk} ({crossing.tokens:,} tokens), where "
           "unified memory's cudaMalloc does not fail and the worker hangs"
           if crossing else "PyTorch's allocator stays within it") + ".",
        *[line for line in summary_lines(gb10) if line.startswith("verdict")],
        "",
        f"The host-backed arena served the {stats['blocks_allocated']} pieces of {len(report.rows)} "
        f"chunks from one {stats['capacity'] / MiB:.0f} MiB reservation ({stats['backend_reserves']} "
        f"backend call), peak in use {stats['in_use_peak'] / MiB:.0f} MiB, every piece checked, in "
        f"{host['wall_s'] * 1000:.0f} ms.",
        "The same check for any configuration: indexer-arena fit --help. Per-chunk table: --chunks.",
    ]


def simulate_on_host(args, console: Console) -> dict:
    """No GPU: the story (fit's model of PyTorch's allocator on the seed's machines) first, then
    the workspace on the host-backed arena; the per-chunk table with --chunks."""
    from arena_tools.fit import fit, print_table
    from arena_tools.serving import serving_available
    common = dict(max_model_len=args.prompt_tokens, chunk_tokens=args.chunk_tokens,
                  compress_ratio=args.compress_ratio, budget_mb=args.budget_mb,
                  prompt_tokens=args.prompt_tokens, topk=0, max_num_seqs=256)
    memory = serving_available(GB10_AVAILABLE_MIB * MiB, 0.9, 1, profiled_bytes=args.budget_mb * MiB)
    memory["device_source"] = "a GB10's MemAvailable"
    gb10 = fit(**common, available_bytes=memory["available_bytes"], memory=memory)
    report = fit(**common, available_bytes=1 << 50)
    host = run_on_host_arena(args)
    for line in story(args, report, gb10, host):
        console.print(line)
    if args.chunks:
        console.print("")
        print_table(gb10, file=sys.stdout, table=True)
    return {"mode": "host simulation", "arena": host["stats"], "fit_gb10": gb10.to_dict(),
            "wall_s": host["wall_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocators", default=",".join(ALLOCATORS),
                        type=lambda s: [a for a in s.split(",") if a])
    parser.add_argument("--prompt-tokens", type=int, default=254_000)
    parser.add_argument("--chunk-tokens", type=int, default=3_200)
    parser.add_argument("--compress-ratio", type=int, default=4)
    parser.add_argument("--budget-mb", type=int, default=512)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--chunks", action="store_true",
                        help="without a GPU: fit's per-chunk table after the story")
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
    console = Console(width=terminal_columns(120))
    import torch
    if torch.cuda.is_available():
        results = compare_on_gpu(args)
        print_gpu_table(results, console)
    else:
        results = simulate_on_host(args, console)
        if args.allocators != list(ALLOCATORS):
            console.print(f"(--allocators {','.join(args.allocators)}: each allocator runs on a GPU only)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
