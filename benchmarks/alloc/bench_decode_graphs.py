"""A serving worker's two halves in one process: the seed's chunked indexer prefill (the logits
workspace of a 254,000-token prompt, 512 MiB budget) and a transformers Llama-style model (random
weights, static KV cache) whose decode step is captured as a CUDA graph and replayed, under
PyTorch's default allocator, expandable segments and the arena (process scope), each in a fresh
process, the allocators alternated round after round (A B C A B C).

    python benchmarks/alloc/bench_decode_graphs.py [--layers 8] [--batch 8] [--prompt 512] [--new 256]
                                             [--rounds 2] [--json FILE]
"""

import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository root

from alloc.units import MiB, fmt_mib  # noqa: E402
from arena_tools import allocators  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.alloc.llama import llama_config, llama_model, model_flags  # noqa: E402

ALLOCATORS = ("default", "expandable", "arena")  # of arena_tools.allocators


def static_cache(config, batch: int, length: int):
    import torch
    from transformers import StaticCache
    try:
        return StaticCache(config=config, max_batch_size=batch, max_cache_len=length, device="cuda",
                           dtype=torch.bfloat16)
    except TypeError:  # releases that size the cache from its first update
        return StaticCache(config=config, max_cache_len=length)


def seed_prefill(args, workspace) -> int:
    """The seed workload's workspaces; returns the device bytes taken at its end."""
    import torch
    sys.path.insert(0, str(ROOT / "examples"))
    from seed_workload import TOPK, workload
    free0 = torch.cuda.mem_get_info()[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for plan in workload(args):
        for rows in plan.pieces:
            with workspace():
                logits = torch.empty(rows, plan.width, dtype=torch.float32, device="cuda")
            logits.uniform_(generator=gen)
            torch.topk(logits, min(TOPK, plan.width), dim=1, sorted=False)
            del logits
    torch.cuda.synchronize()
    return free0 - torch.cuda.mem_get_info()[0]


def worker(args) -> dict:
    import torch

    import alloc
    arena = allocators.install(args.worker, alloc.Config(budget_mb=args.budget_mb)) is not None
    torch.cuda.init()
    free0 = torch.cuda.mem_get_info()[0]
    torch.manual_seed(0)
    config = llama_config(args.layers)
    model = llama_model(config)
    workspace_taken = seed_prefill(args, alloc.workspace if arena else contextlib.nullcontext)
    # Room beyond the last step: releases that take the position from the cache itself (not from
    # cache_position) advance it on the warm-up steps too.
    cache = static_cache(config, args.batch, args.prompt + args.new + 16)
    ids = torch.randint(3, config.vocab_size, (args.batch, args.prompt), device="cuda")
    token = torch.zeros(args.batch, 1, dtype=torch.long, device="cuda")
    position = torch.zeros(1, dtype=torch.long, device="cuda")

    def step():
        return model(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True).logits

    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(args.prompt, device="cuda"),
                    use_cache=True)
        token.copy_(out.logits[:, -1:].argmax(-1))
        position.fill_(args.prompt)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                eager = step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
        del eager
        generated = []
        torch.cuda.synchronize()
        start = time.perf_counter()
        for t in range(args.new):
            token.copy_(logits[:, -1:].argmax(-1))
            position.fill_(args.prompt + 1 + t)
            graph.replay()
            generated.append(token.clone())
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    used = free0 - torch.cuda.mem_get_info()[0]
    import transformers
    out = {"allocator": args.worker, "tokens_per_s": args.batch * args.new / seconds, "seconds": seconds,
           "transformers": transformers.__version__, "device_used_end": used, "workspace_taken": workspace_taken,
           "peak_reserved": torch.cuda.max_memory_reserved(),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if arena:
        stats = alloc.memory_stats()
        out["workspace_capacity"] = stats["arena.workspace.capacity"]
        out["workspace_reserves"] = stats["arena.workspace.backend_reserves"]
        out["graph_pool_bytes"] = stats["arena.graphs.capacity"]
    return out


def main() -> None:
    parser = harness.parser(__doc__, workers=ALLOCATORS, rounds=2)
    model_flags(parser, layers=8)
    parser.add_argument("--prompt-tokens", type=int, default=254_000, help="the seed prefill's prompt")
    parser.add_argument("--chunk-tokens", type=int, default=3_200)
    parser.add_argument("--compress-ratio", type=int, default=4)
    parser.add_argument("--budget-mb", type=int, default=512)
    args = parser.parse_args()
    if harness.child(args, worker):
        return
    runs = harness.each_allocator(ALLOCATORS, __file__, harness.forwarded(), rounds=args.rounds,
                                  stop_on_error=True)
    first = runs[0]
    harness.table(f"Decode as a CUDA graph beside the seed prefill: Llama-style, {args.layers} layers, "
                  f"batch {args.batch}, prompt {args.prompt}, {args.new} steps ({first['device']}, "
                  f"torch {first['torch']}, transformers {first['transformers']}; rounds alternate)",
                  ("allocator", "round", "tokens/s", "device used MiB", "peak reserved MiB",
                   "seed prefill took MiB"),
                  [(r["allocator"], str(i // len(ALLOCATORS) + 1), f"{r['tokens_per_s']:,.0f}",
                    fmt_mib(r['device_used_end']), fmt_mib(r['peak_reserved']),
                    fmt_mib(r['workspace_taken'])) for i, r in enumerate(runs)])
    print_goal(args, runs, harness.best(runs, ALLOCATORS, "tokens_per_s", most=True))
    harness.write_json(args.json, runs)


def print_goal(args, runs: list[dict], best: dict[str, dict]) -> None:
    a, d, e = best["arena"], best["default"], best["expandable"]
    for r in runs:
        if "workspace_capacity" in r:
            print(f"arena: workspace {r['workspace_capacity'] / MiB:.0f} MiB in {r['workspace_reserves']} "
                  f"reservation(s); graph pool {r['graph_pool_bytes'] / MiB:.0f} MiB")
    speed, memory = a["tokens_per_s"] / d["tokens_per_s"], a["device_used_end"] / e["device_used_end"]
    # The others gave the seed prefill's memory back when the capture emptied their caches; the
    # arena keeps its workspace budget reserved for the next prefill.
    general = (a["device_used_end"] - a["workspace_capacity"]) / e["device_used_end"]
    flat = all(r["workspace_capacity"] == args.budget_mb * MiB and r["workspace_reserves"] == 1
               for r in runs if "workspace_capacity" in r)
    print(f"arena / default tokens/s (best rounds) {speed:.3f}; arena / expandable device memory {memory:.3f} "
          f"({general:.3f} leaving out the arena's {args.budget_mb} MiB workspace budget)")
    harness.goal("tokens/s within 2% of the default allocator or better, device memory at or below "
                 "expandable segments, and the workspace one reservation of the budget",
                 speed >= 0.98 and memory <= 1.0 and flat)


if __name__ == "__main__":
    main()
