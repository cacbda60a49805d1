"""Replaying a recorded allocation trace under several allocators, side by side.

    python -m arena_tools replay TRACE [--allocators default,expandable,cuda-async,arena,host]
                                 [--device N] [--budget-mb N] [--json OUT]

TRACE is a CSV trace (ours, or RMM's logging_resource_adaptor log) or a snapshot pickle
(``arena_tools.export``). Every allocation, free and recorded failure is replayed in the recorded order,
on one thread:

- on the GPU, each allocator in a fresh process: PyTorch's caching allocator (``default``),
  ``expandable_segments:True`` (``expandable``), ``backend:cudaMallocAsync`` (``cuda-async``),
  each chosen with PYTORCH_CUDA_ALLOC_CONF before torch is imported, and this project's arena
  (``arena``: ``alloc.install()`` first; events recorded in the workspace arena are replayed inside
  ``alloc.workspace()``). Requests go through ``torch.cuda.caching_allocator_alloc`` /
  ``caching_allocator_delete`` (the raw entry points behind them), which reach a pluggable
  allocator too. Each recorded stream is replayed on a stream of its own (stream 0 on the default
  stream).
- on the CPU (``host``), in this process, on host-backed ``alloc.Arena`` objects laid out as the
  plugin lays out a device: the workspace arena fixed (``growable=False``) at the workspace
  budget, so that the trace's own peak and fragmentation come back exactly; general events (pool
  small, large, or unknown as in RMM logs: routed by size as the plugin routes them,
  ``alloc.plugin.SMALL_REQUEST``) on growable arenas made with the plugin's options
  (``alloc.plugin.pool_options``: region sizes; a trace recorded on several threads replays as
  one).

Peak device memory is the largest ``cudaMemGetInfo`` used-memory delta from just before the replay,
sampled every ``--sample-every`` events, after every allocation of ``--sample-bytes`` or more and
right after the event where the trace's live bytes peak; next to it the allocator's own peak
(``torch.cuda.max_memory_reserved``, ``alloc.max_memory_reserved``). Operations per second count
allocations and frees over the replay loop, the sampling excluded.

The workspace budget is ``--budget-mb``, else the trace's (a snapshot records it, as does a trace
that saw the workspace arena's reservation), else the configuration's (INDEXER_ARENA_CONF,
default 512 MiB). A recorded failure is replayed as a request; if it succeeds, it is freed at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from alloc.config import flag_value
from alloc.units import MiB, fmt_bytes, output_width
from alloc.units import fmt_mib as _mib

from . import prog
from .allocators import parse_names
from .export import TraceFile, TraceFormatError, load_trace
from .gpu_replay import GPU_ALLOCATORS, gpu_worker, run_worker
from .host_replay import replay_host
from .plan import Plan, compile_trace, workspace_budget

ALLOCATORS = (*GPU_ALLOCATORS, "host")


# -- the table -------------------------------------------------------------------------------------------
def render_table(results: list[dict], plan: Plan, trace: TraceFile, budget: int, budget_why: str,
                 width: int = 150) -> str:
    import io

    from .textout import Console, Table
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    console.print(f"trace {trace.path} ({trace.kind}): {plan.events} events, {len(plan.ops)} operations on "
                  f"device(s) {plan.devices or [0]}, {plan.trace_failures} recorded failure(s); live "
                  f"requests peak at {fmt_bytes(plan.peak_live)}; events per pool: "
                  f"{', '.join(f'{pool} {n}' for pool, n in plan.pools.items())}; workspace budget "
                  f"{fmt_bytes(budget)} ({budget_why})")
    table = Table(title="replay: peak memory, failures, speed")
    for col in ("allocator", "where", "peak device MiB", "allocator peak reserved MiB", "peak in use MiB",
                "failures", "ops", "ops/s", "note"):
        table.add_column(col, justify="left" if col in ("allocator", "where", "note") else "right")
    for r in results:
        if "error" in r:
            table.add_row(r["allocator"], r.get("where", ""), *["-"] * 6, r["error"][:200])
            continue
        notes = []
        if r["allocator"] == "host" and r.get("fragmentation") is not None:
            notes.append(f"workspace fragmentation {100 * r['fragmentation']:.1f}%, largest free "
                         f"{fmt_bytes(r['largest_free'])}")
        if r.get("unexpected_successes"):
            notes.append(f"{r['unexpected_successes']} recorded failure(s) succeeded")
        if r.get("first_failure"):
            notes.append(f"first failure: {r['first_failure'].split(':')[0]}")
        note = "; ".join(notes)
        table.add_row(r["allocator"], r.get("where", ""),
                      _mib(r.get("peak_device_bytes")), _mib(r.get("peak_reserved_bytes")),
                      _mib(r.get("peak_in_use_bytes")), f"{r['failures']} (trace {r['trace_failures']})",
                      f"{r['ops']:,}", "-" if not r.get("ops_per_s") else f"{r['ops_per_s']:,.0f}",
                      note[:200])
    console.print(table)
    return buf.getvalue()


# -- the command line -------------------------------------------------------------------------------------
def _allocator_list(text: str) -> list[str]:
    try:
        return parse_names(text, ALLOCATORS)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog("replay"), description=(
        "Replay an allocation trace under several allocators (each GPU one in a fresh process, and the "
        "host-backed arena on the CPU) and compare peak memory, failures and operations per second. "
        "Exit status: 0 every allocator replayed it with no more failures than were recorded, 1 one "
        "did not, 2 bad arguments or a malformed trace."))
    p.add_argument("trace", help="a CSV trace (ours or RMM's) or a snapshot pickle")
    p.add_argument("--allocators", type=_allocator_list, default=None,
                   help=f"comma-separated, from {', '.join(ALLOCATORS)} (default: all where CUDA is, "
                        "else host)")
    p.add_argument("--device", type=int, default=0, help="CUDA device of a single-device trace")
    p.add_argument("--budget-mb", type=int, metavar="MIB",
                   help="workspace budget (default: the trace's when it records one, else the configuration's)")
    p.add_argument("--workspace-all", action="store_true",
                   help="serve every allocation from the workspace arena (e.g. an RMM log of workspaces)")
    p.add_argument("--allow-unknown-frees", action="store_true",
                   help="skip frees of pointers the trace never allocated (a trace that starts mid-run)")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON ('-': standard output)")
    p.add_argument("--sample-every", type=int, default=64, help="sample device memory every N events")
    p.add_argument("--sample-bytes", type=int, default=2 * MiB,
                   help="and after every allocation of at least this many bytes")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed to each GPU worker")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--worker", choices=GPU_ALLOCATORS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _replay_all(names: list[str], trace: TraceFile, plan: Plan, budget: int, args) -> list[dict]:
    """One result per allocator, in order, under a progress bar unless switched off."""
    results = []
    progress = None
    if not args.no_progress and args.json != "-":
        from .textout import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        progress = Progress(TextColumn("{task.description:>24}"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(), transient=False)
        progress.start()
    try:
        for name in names:
            task = progress.add_task(f"{name}", total=len(plan.ops)) if progress else None

            def tick(done, total, task=task):
                if progress is not None:
                    progress.update(task, completed=done, total=total)

            if name == "host":
                results.append(replay_host(trace, budget=budget, workspace_all=args.workspace_all,
                                           progress=tick, sample_every=args.sample_every, plan=plan))
            else:
                results.append(run_worker(name, os.path.abspath(args.trace), args, tick, budget >> 20))
    finally:
        if progress is not None:
            progress.stop()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # before a worker reads it too
        args.budget_mb = flag_value("budget_mb", "--budget-mb", args.budget_mb)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.worker:
        return gpu_worker(args)
    for flag in ("sample_every", "sample_bytes"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            print(f"error: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    from alloc.errors import ArenaError, ConfigError

    from .paths import unwritable
    why_not = unwritable(args.json, "--json") if args.json else None
    if why_not:
        print(f"error: {why_not}", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace, allow_unknown_frees=args.allow_unknown_frees)
        budget, why = workspace_budget(trace, args.budget_mb << 20 if args.budget_mb else None)
    except (TraceFormatError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cuda = False if args.allocators == ["host"] else _cuda_available()
    names = args.allocators or ([*GPU_ALLOCATORS, "host"] if cuda else ["host"])
    gpu_names = [n for n in names if n != "host"]
    if gpu_names and not cuda:
        print(f"error: {', '.join(gpu_names)} replay(s) on a CUDA device, and torch sees none here; "
              "use --allocators host", file=sys.stderr)
        return 2
    plan = compile_trace(trace, workspace_all=args.workspace_all)
    if "arena" in names and budget % MiB:
        print(f"error: the workspace budget {budget} bytes is not a whole number of MiB, which the "
              "installed allocator needs; pass --budget-mb", file=sys.stderr)
        return 2
    try:
        results = _replay_all(names, trace, plan, budget, args)
    except ArenaError as e:  # the host could not make an arena the replay needs (replay_host says why)
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = render_table(results, plan, trace, budget, why, width=output_width(sys.stdout.isatty(), 150))
    if args.json:
        data = json.dumps({"trace": {"path": trace.path, "kind": trace.kind, "budget": budget,
                                     "budget_source": why, **plan.summary()},
                           "results": results}, indent=1)
        if args.json == "-":
            print(data)
        else:
            with open(args.json, "w") as f:
                f.write(data)
    if args.json != "-":
        print(text, end="")
    # 1: an allocator broke down, or refused allocations the recorded run served.
    return 0 if all("error" not in r and r["failures"] <= r["trace_failures"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
