"""A real model not written here: a Llama-style model from transformers, built from a config with
random weights, running batched prefill and a few hundred decode steps, under PyTorch's default
allocator, expandable segments, the arena in process scope (every tensor through its general
path; "arena" maps pages where the driver can, "arena-regions" is expandable:off) and the arena in
workspace scope (PyTorch serves the model; the pool waits beside it), each in a fresh process, the
allocators alternated round after round (A B C D E A B C D E).

    python benchmarks/alloc/bench_llama.py [--layers 12] [--batch 8] [--prompt 512] [--new 256]
                                     [--rounds 2] [--json FILE]
"""

import argparse
import json
import statistics
import sys
import time

from rich.console import Console
from rich.table import Table

from arena_tools import allocators


def worker(args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import alloc
    scope = allocators.install(args.worker, alloc.Config(trace=1 << 23) if args.trace else None)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5504, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=4096)
    torch.cuda.init()
    free0 = torch.cuda.mem_get_info()[0]
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(3, config.vocab_size, (args.batch, args.prompt), device="cuda")
    gen = dict(do_sample=False, use_cache=True, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, **gen)  # warm-up
        times, out = [], None
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, **gen)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    used = free0 - torch.cuda.mem_get_info()[0]
    memory = alloc if scope else torch.cuda  # alloc's figures are PyTorch's in workspace scope
    peak_reserved, peak_allocated = memory.max_memory_reserved(), memory.max_memory_allocated()
    if args.trace and scope == "process":
        from alloc import trace
        from arena_tools import export
        events, dropped = trace.plugin_trace().events()
        if dropped:
            raise SystemExit(f"the trace dropped {dropped} events: raise its capacity")
        export.write_csv(events, args.trace)
    return {"allocator": args.label, "seconds": statistics.median(times), "runs": times,
            "peak_reserved": peak_reserved, "peak_allocated": peak_allocated, "device_used_end": used,
            "reserved_end": memory.memory_reserved(), "pools": pool_breakdown(scope),
            "tokens": int(out.shape[1]), "generated": out[:, args.prompt:].tolist()}


def pool_breakdown(scope) -> dict:
    """Per pool at the end: bytes held (reserved), in live blocks, and their peaks, with the
    regions or segments that hold them: where an allocator's memory goes."""
    import torch

    import alloc
    if scope == "process":
        s = alloc.memory_stats()
        return {pool: {"reserved": s[f"arena.{pool}.capacity"], "reserved_peak": s[f"arena.{pool}.capacity_peak"],
                       "in_use": s[f"arena.{pool}.in_use"], "in_use_peak": s[f"arena.{pool}.in_use_peak"],
                       "segments": s[f"arena.{pool}.regions"], "largest_free": s[f"arena.{pool}.largest_free"]}
                for pool in ("small", "large", "workspace") if f"arena.{pool}.capacity" in s}
    s = torch.cuda.memory_stats()
    return {pool: {"reserved": s[f"reserved_bytes.{pool}_pool.current"],
                   "reserved_peak": s[f"reserved_bytes.{pool}_pool.peak"],
                   "in_use": s[f"allocated_bytes.{pool}_pool.current"],
                   "in_use_peak": s[f"allocated_bytes.{pool}_pool.peak"],
                   "segments": s[f"segment.{pool}_pool.current"]}
            for pool in ("small", "large")}


ALLOCATORS = ("default", "expandable", "arena", "arena-regions", "arena-workspace")  # of arena_tools.allocators


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="passes over every allocator")
    parser.add_argument("--json")
    parser.add_argument("--worker", choices=list(ALLOCATORS), help=argparse.SUPPRESS)
    parser.add_argument("--label", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--trace", help="the process scope's run writes its allocation trace (CSV) "
                        "there, for python -m arena_tools replay (tracing slows the arena's runs)")
    args = parser.parse_args()
    if args.worker:
        allocators.write_result(args.result, worker(args))
        return
    forwarded = allocators.without_option(sys.argv[1:], "--json")
    runs = allocators.run_each(ALLOCATORS, lambda name, result: [
        sys.executable, __file__, "--worker", name, "--label", name, "--result", result, *forwarded],
        rounds=args.rounds)
    allocators.stop_on_error(runs)
    MiB = 1 << 20
    d = runs[0]

    def agreement(r) -> str:
        # Greedy decoding of a random model flips near-tied tokens when kernels differ in
        # rounding: the default allocator's own second round shows how much agreement to expect.
        same = sum(x == y for rx, ry in zip(r["generated"], d["generated"]) for x, y in zip(rx, ry))
        return f"{same / sum(len(row) for row in d['generated']):.1%}"

    table = Table(title=f"Llama-style, {args.layers} layers, batch {args.batch}, prompt {args.prompt}, "
                        f"{args.new} new tokens (median of {args.repeats}; rounds alternate)")
    for col in ("allocator", "round", "seconds", "peak reserved MiB", "peak allocated MiB",
                "device used MiB", "tokens as default"):
        table.add_column(col, justify="right")
    for i, r in enumerate(runs):
        table.add_row(r["allocator"], str(i // len(ALLOCATORS) + 1), f"{r['seconds']:.3f}",
                      f"{r['peak_reserved'] / MiB:,.0f}", f"{r['peak_allocated'] / MiB:,.0f}",
                      f"{r['device_used_end'] / MiB:,.0f}", agreement(r))
    Console().print(table)
    pools = Table(title="where the memory is at the end (each allocator's first round), MiB")
    for col in ("allocator", "pool", "reserved", "reserved peak", "in use", "in use peak", "segments"):
        pools.add_column(col, justify="right")
    for r in runs[:len(ALLOCATORS)]:
        for pool, p in r["pools"].items():
            pools.add_row(r["allocator"], pool, *(f"{p[k] / MiB:,.1f}" for k in
                                                  ("reserved", "reserved_peak", "in_use", "in_use_peak")),
                          str(p["segments"]))
        pools.add_row(r["allocator"], "outside the allocator", f"{(r['device_used_end'] - r['reserved_end']) / MiB:,.1f}",
                      "", "", "", "")
    Console().print(pools)
    best = {name: min((r for r in runs if r["allocator"] == name), key=lambda r: r["seconds"])
            for name in ALLOCATORS}
    base = best["default"]
    for name, r in best.items():
        print(f"{name} / default (best rounds): time {r['seconds'] / base['seconds']:.3f}, device "
              f"used {r['device_used_end'] / base['device_used_end']:.3f}")
    theirs = best["expandable"]
    for name in ("arena", "arena-regions"):
        r = best[name]
        print(f"{name} against expandable segments: device used at the end {r['device_used_end'] / MiB:,.0f} / "
              f"{theirs['device_used_end'] / MiB:,.0f} MiB, peak reserved {r['peak_reserved'] / MiB:,.0f} / "
              f"{theirs['peak_reserved'] / MiB:,.0f} MiB")
    theirs = best["expandable"]
    for name in ("arena", "arena-regions"):
        r = best[name]
        print(f"{name} against expandable segments: device used at the end {r['device_used_end'] / MiB:,.0f} / "
              f"{theirs['device_used_end'] / MiB:,.0f} MiB, peak reserved {r['peak_reserved'] / MiB:,.0f} / "
              f"{theirs['peak_reserved'] / MiB:,.0f} MiB")
    scoped = best["arena-workspace"]
    met = scoped["seconds"] <= base["seconds"] * 1.02 and scoped["device_used_end"] <= base["device_used_end"]
    print(f"goal: workspace scope costs nothing outside the workspace (time within 2% of default, "
          f"device memory at or below it): {'met' if met else 'NOT met'}")
    arena = best["arena"]
    met = arena["device_used_end"] <= theirs["device_used_end"] and arena["seconds"] <= base["seconds"] * 1.02
    print(f"goal: process scope at or below expandable segments' device memory, time within 2% of "
          f"default: {'met' if met else 'NOT met'}")
    results = runs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
