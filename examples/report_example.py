"""The memory report of the seed workload's allocation pattern, with its trace.

The indexer's logits pieces of a chunked prefill (254,000-token prompt, 3,200-token chunks,
compress ratio 4, 512 MiB budget): chunk i sees ``seen`` tokens, width = cdiv(cdiv(seen, 4), 64) * 64,
rows per piece = budget // (width * 4); each piece is a float32 [rows, width] tensor allocated
inside ``alloc.workspace()``, filled with torch.rand and freed.

With CUDA, the pattern runs under the installed allocator with tracing on (the ``trace`` key, so
that the workspace arena's reservation is recorded too). Without CUDA (or with --cpu) it runs on a
host-backed workspace arena of the same budget whose events go to a host trace; the pieces are
then filled through torch.frombuffer over the arena's memory (--no-fill skips that).

Writes into DIR: report.txt, report.json, report.png (the report) and trace.csv (RMM's format plus
Device,Pool) and snapshot.pickle (PyTorch's memory snapshot), then prints the report.

    python examples/report_example.py DIR [--prompt-tokens N] [--chunk-tokens N] [--budget-mb N]
                                            [--cpu] [--no-fill]

Then, e.g.:  python -m arena_tools replay DIR/trace.csv --json DIR/replay.json
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Iterator

from alloc.units import MiB


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pieces(prompt_tokens: int, chunk_tokens: int, compress_ratio: int, budget: int
           ) -> Iterator[tuple[int, int, int]]:
    """(tokens seen, rows, width) of every logits piece, in order."""
    seen = 0
    while seen < prompt_tokens:
        rows_left = min(chunk_tokens, prompt_tokens - seen)
        seen += rows_left
        width = cdiv(cdiv(seen, compress_ratio), 64) * 64
        per_piece = budget // (width * 4)
        if per_piece == 0:
            raise SystemExit(f"one row of {width} float32 logits does not fit a {budget >> 20} MiB budget")
        while rows_left:
            rows = min(per_piece, rows_left)
            yield seen, rows, width
            rows_left -= rows


def run_gpu(args, out: str) -> dict:
    import torch

    import alloc
    from alloc.config import from_env
    from arena_tools.arena_report import live_report
    from arena_tools.report import write_outputs
    from alloc.trace import plugin_trace
    config = alloc.install(from_env().replace(budget_mb=args.budget_mb, trace=args.trace_capacity))
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = time.perf_counter()
    count = 0
    for _seen, rows, width in pieces(args.prompt_tokens, args.chunk_tokens, args.compress_ratio,
                                     args.budget_mb * MiB):
        with alloc.workspace():
            logits = torch.rand(rows, width, dtype=torch.float32, device="cuda", generator=gen)
        del logits
        count += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    trace = plugin_trace()
    trace.enable(False)
    events, dropped = trace.events()
    report = live_report()
    notes = [f"{count} pieces on {torch.cuda.get_device_name()} under the installed allocator "
             f"({config.to_env() or 'defaults'}), {wall:.2f} s; {len(events)} trace events"
             + (f", {dropped} dropped by the ring" if dropped else "")]
    return write_outputs(out, report, events, dropped=dropped, top=args.top,
                         title="seed workload (cuda)", notes=notes)


def run_host(args, out: str) -> dict:
    from alloc import Arena
    from arena_tools.arena_report import collect
    from arena_tools.report import write_outputs
    from alloc.trace import Trace
    torch = None
    if not args.no_fill:
        try:
            import torch
        except ImportError:
            print("torch is not installed: the pieces are not filled", file=sys.stderr)
    budget = args.budget_mb * MiB
    trace = Trace(args.trace_capacity)
    gen = torch.Generator().manual_seed(0) if torch is not None else None
    start = time.perf_counter()
    count = 0
    with Arena(budget, 256, "host", name="workspace arena (host)") as arena:
        trace.attach(arena, device=0, pool="workspace")
        for _seen, rows, width in pieces(args.prompt_tokens, args.chunk_tokens, args.compress_ratio, budget):
            size = rows * width * 4
            p = arena.allocate(size)
            if torch is not None:
                memory = (ctypes.c_char * size).from_address(p)
                torch.frombuffer(memory, dtype=torch.float32).view(rows, width).uniform_(generator=gen)
                del memory
            arena.free(p)
            count += 1
        wall = time.perf_counter() - start
        trace.enable(False)
        events, dropped = trace.events()
        arena.check()
        report = collect({(0, "workspace"): arena}, budget=budget)
    notes = [f"{count} pieces on a host-backed workspace arena (no CUDA here), {wall:.2f} s"
             + ("" if torch is not None else ", not filled") + f"; {len(events)} trace events"
             + (f", {dropped} dropped by the ring" if dropped else "")]
    return write_outputs(out, report, events, dropped=dropped, top=args.top,
                         title="seed workload (host simulation)", notes=notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write the report and the trace into")
    parser.add_argument("--prompt-tokens", type=int, default=254_000)
    parser.add_argument("--chunk-tokens", type=int, default=3_200)
    parser.add_argument("--compress-ratio", type=int, default=4)
    parser.add_argument("--budget-mb", type=int, default=512)
    parser.add_argument("--trace-capacity", type=int, default=1 << 16, help="events the trace ring holds")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="the host-backed arena even where CUDA is")
    parser.add_argument("--no-fill", action="store_true", help="host run: do not fill the pieces")
    args = parser.parse_args(argv)
    for name in ("prompt_tokens", "chunk_tokens", "compress_ratio", "budget_mb", "trace_capacity"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    cuda = False
    if not args.cpu:
        try:
            import torch
            cuda = torch.cuda.is_available()
        except ImportError:
            pass
    paths = run_gpu(args, args.out) if cuda else run_host(args, args.out)
    with open(paths["text"]) as f:
        print(f.read(), end="")
    for kind, path in paths.items():
        print(f"{kind:>8}: {os.path.abspath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
