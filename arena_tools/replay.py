"""Replaying a recorded allocation trace under several allocators, side by side.

    python -m alloc replay TRACE [--allocators default,expandable,cuda-async,arena,host]
                                 [--device N] [--budget-mb N] [--json OUT]

TRACE is a CSV trace (ours, or RMM's logging_resource_adaptor log) or a snapshot pickle
(``alloc.export``). Every allocation, free and recorded failure is replayed in the recorded order,
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
  small, large, or unknown as in RMM logs: routed by size, <= 1 MiB small) on growable arenas with
  the plugin's region sizes (2 MiB small regions; 20 MiB under 10 MiB, 2 MiB multiples above)
  and its per-thread caches of freed blocks (a trace recorded on several threads replays as one).

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
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from .export import TraceFile, TraceFormatError, load_trace
from .units import MiB, fmt_bytes, output_width

ALLOCATORS: dict[str, str | None] = {  # name -> PYTORCH_CUDA_ALLOC_CONF (None: not PyTorch's)
    "default": "",
    "expandable": "expandable_segments:True",
    "cuda-async": "backend:cudaMallocAsync",
    "arena": None,
    "host": None,
}
GPU_ALLOCATORS = ("default", "expandable", "cuda-async", "arena")
ALLOC, FREE, FAIL = 0, 1, 2
WORKSPACE, SMALL, LARGE = 0, 1, 2
POOL_NAMES = ("workspace", "small", "large")
SMALL_REQUEST = 1 << 20  # csrc/plugin.c: requests up to 1 MiB go to the small pool


# -- the trace as operations ---------------------------------------------------------------------------
@dataclass
class Plan:
    """The trace as a flat list of operations: (kind, slot, size, device, pool, stream). An
    allocation fills ``slot`` (a dense index), its free empties it."""
    ops: list[tuple[int, int, int, int, int, int]]
    slots: int
    devices: list[int]
    streams: list[int]
    trace_failures: int
    peak_live: int           # most bytes the trace's own live allocations asked for at once
    peak_op: int             # index of the op after which that peak holds
    workspace_ops: int
    events: int = 0
    pools: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        out = asdict(self)
        del out["ops"]
        out["ops"] = len(self.ops)
        out["allocations"] = sum(1 for op in self.ops if op[0] == ALLOC)
        out["frees"] = sum(1 for op in self.ops if op[0] == FREE)
        return out


def _pool_index(pool: str, size: int, workspace_all: bool) -> int:
    if workspace_all or pool == "workspace":
        return WORKSPACE
    if pool in ("small", "large"):
        return POOL_NAMES.index(pool)
    return SMALL if size <= SMALL_REQUEST else LARGE  # general / unknown: the plugin's routing


def compile_trace(trace: TraceFile, *, workspace_all: bool = False) -> Plan:
    """The operations to replay (reservations are the allocator's business, not replayed)."""
    ops, live, slot_pool = [], {}, []
    live_bytes = peak = peak_op = failures = 0
    devices, streams, pools = set(), {}, {}
    for e in trace.events:
        key = (e.device, e.address)
        if e.action == "alloc":
            if e.size == 0:
                continue
            pool = _pool_index(e.pool, e.size, workspace_all)
            slot = len(slot_pool)
            slot_pool.append((pool, e.size))
            live[key] = slot
            ops.append((ALLOC, slot, e.size, e.device, pool, e.stream))
            live_bytes += e.size
            if live_bytes > peak:
                peak, peak_op = live_bytes, len(ops) - 1
        elif e.action == "free":
            slot = live.pop(key, None)
            if slot is None:
                continue  # free(NULL), or an allocation the trace does not hold (check() decided)
            pool, size = slot_pool[slot]
            ops.append((FREE, slot, size, e.device, pool, e.stream))
            live_bytes -= size
        elif e.action == "fail":
            failures += 1
            ops.append((FAIL, -1, e.size, e.device, _pool_index(e.pool, e.size, workspace_all), e.stream))
        else:
            continue
        devices.add(e.device)
        streams.setdefault(e.stream, None)
        name = POOL_NAMES[ops[-1][4]]
        pools[name] = pools.get(name, 0) + 1
    return Plan(ops, len(slot_pool), sorted(devices), list(streams), failures, peak, peak_op,
                sum(1 for op in ops if op[4] == WORKSPACE and op[0] != FREE), len(trace.events), pools)


def workspace_budget(trace: TraceFile, budget: int | None = None) -> tuple[int, str]:
    """(bytes, where it came from): ``budget`` when given, else the trace's, else the
    configuration's."""
    if budget:
        return budget, "given"
    if trace.budget:
        return trace.budget, "recorded in the trace"
    from .config import ENV_VAR, from_env
    return from_env().budget_bytes, f"the configuration's: {ENV_VAR} or its default"


# -- the loop, shared by every allocator -------------------------------------------------------------------
@dataclass
class LoopResult:
    ops: int = 0
    seconds: float = 0.0
    failures: int = 0
    unexpected_successes: int = 0
    first_failure: str = ""


def run_ops(plan: Plan, allocate: Callable[[int, int, int, int], int], free: Callable[[int, int], None],
            *, set_pool: Callable[[int], None] | None = None, sample: Callable[[], None] | None = None,
            sample_every: int = 64, sample_bytes: int = 2 * MiB, progress: Callable[[int], None] | None = None,
            failure_types: tuple[type[BaseException], ...] = (MemoryError,)) -> LoopResult:
    """Replays ``plan``: ``allocate(size, device, pool, stream) -> handle`` raising one of
    ``failure_types`` when the allocator refuses, ``free(handle, stream)``. ``set_pool(pool)`` is
    called before an allocation whose pool differs from the previous one's. ``sample()`` (memory
    sampling) and ``progress(done)`` are timed apart from the replay."""
    handles: list = [None] * plan.slots
    res = LoopResult()
    current_pool = -1
    overhead = 0.0
    step = max(1, len(plan.ops) // 200)
    peak_op = plan.peak_op
    clock = time.perf_counter
    start = clock()
    for i, (kind, slot, size, device, pool, stream) in enumerate(plan.ops):
        if kind == FREE:
            handle = handles[slot]
            if handle is not None:
                free(handle, stream)
                handles[slot] = None
                res.ops += 1
        else:
            if set_pool is not None and pool != current_pool:
                set_pool(pool)
                current_pool = pool
            res.ops += 1
            try:
                handle = allocate(size, device, pool, stream)
            except failure_types as e:
                res.failures += 1
                if not res.first_failure:
                    res.first_failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
                handle = None
            if kind == FAIL and handle is not None:
                res.unexpected_successes += 1
                free(handle, stream)
                res.ops += 1
            elif handle is not None:
                handles[slot] = handle
        if sample is not None and (i == peak_op or i % sample_every == 0
                                   or (kind != FREE and size >= sample_bytes)):
            t = clock()
            sample()
            overhead += clock() - t
        if progress is not None and i % step == 0:
            t = clock()
            progress(i)
            overhead += clock() - t
    if set_pool is not None and current_pool != -1:
        set_pool(-1)
    if sample is not None:
        t = clock()
        sample()
        overhead += clock() - t
    res.seconds = clock() - start - overhead
    if progress is not None:
        progress(len(plan.ops))
    return res


def _result(name: str, loop: LoopResult, plan: Plan, **extra) -> dict:
    return {"allocator": name, "ops": loop.ops, "seconds": loop.seconds,
            "ops_per_s": loop.ops / loop.seconds if loop.seconds > 0 else None,
            "failures": loop.failures, "trace_failures": plan.trace_failures,
            "unexpected_successes": loop.unexpected_successes, "first_failure": loop.first_failure,
            **extra}


# -- the CPU: host-backed arenas ------------------------------------------------------------------------
def host_arena(pool: int, budget: int, alignment: int, device: int):
    from .arena import Arena
    name = f"host {device} {POOL_NAMES[pool]}"
    if pool == WORKSPACE:
        return Arena(budget, alignment, "host", growable=False, name=name)
    # As csrc/plugin.c makes the general pools, thread caches included: a replay runs on one
    # thread, as a trace of a process that allocated on one thread ran.
    return Arena(0, 512, "host", growable=True, region_min=(2 if pool == SMALL else 20) * MiB,
                 region_round=2 * MiB, region_exact_above=None if pool == SMALL else 10 * MiB, name=name,
                 thread_cache=(16 if pool == SMALL else 32) * MiB,
                 thread_cache_block=(1 if pool == SMALL else 8) * MiB)


def replay_host(trace: TraceFile, *, budget: int | None = None, alignment: int = 256,
                workspace_all: bool = False, keep_report: bool = False, progress=None,
                sample_every: int = 64, plan: Plan | None = None) -> dict:
    """Replays the trace on host-backed arenas (see the module's docstring). ``progress`` is a
    callable(done, total), True for a progress bar, or False/None."""
    from .errors import ArenaOutOfMemory
    plan = plan or compile_trace(trace, workspace_all=workspace_all)
    budget, why = workspace_budget(trace, budget)
    arenas: dict[tuple[int, int], object] = {}

    def arena(device: int, pool: int):
        a = arenas.get((device, pool))
        if a is None:
            a = arenas[(device, pool)] = host_arena(pool, budget, alignment, device)
        return a

    def allocate(size, device, pool, stream):
        a = arena(device, pool)
        return a, a.allocate(size, stream)

    def free(handle, stream):
        handle[0].free(handle[1], stream)

    peak_sum = 0

    def sample():
        nonlocal peak_sum
        peak_sum = max(peak_sum, sum(a.stats()["capacity"] for a in arenas.values()))

    try:
        with _progress_bar(progress, len(plan.ops), "host") as tick:
            loop = run_ops(plan, allocate, free, sample=sample, sample_every=sample_every, progress=tick,
                           failure_types=(ArenaOutOfMemory,))
        stats = {(d, POOL_NAMES[p]): a.stats() for (d, p), a in arenas.items()}
        ws = [s for (d, p), s in stats.items() if p == "workspace"]
        result = _result(
            "host", loop, plan, where="cpu", budget=budget, budget_source=why,
            peak_reserved_bytes=max([peak_sum, *(s["capacity_peak"] for s in stats.values())]),
            peak_in_use_bytes=sum(s["in_use_peak"] for s in stats.values()),
            peak_device_bytes=None,
            workspace_in_use_peak=ws[0]["in_use_peak"] if ws else None,
            fragmentation=ws[0]["fragmentation"] if ws else None,
            largest_free=ws[0]["largest_free"] if ws else None,
            arenas={f"{d}/{p}": s for (d, p), s in stats.items()})
        if keep_report:
            from .report import collect
            result["report"] = collect({(d, POOL_NAMES[p]): a for (d, p), a in arenas.items()},
                                       budget=budget)
        return result
    finally:
        for a in arenas.values():
            a.close()


class _progress_bar:
    """A rich progress bar as a context manager yielding tick(done), or None when switched off."""

    def __init__(self, progress, total: int, label: str):
        self.progress, self.total, self.label, self.bar = progress, total, label, None

    def __enter__(self):
        if callable(self.progress):
            return lambda done: self.progress(done, self.total)
        if not self.progress:
            return None
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeRemainingColumn)
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(), transient=True)
        self.bar.start()
        task = self.bar.add_task(f"replaying on {self.label}", total=self.total)
        return lambda done: self.bar.update(task, completed=done)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False


# -- the GPU: one allocator per fresh process ---------------------------------------------------------------
def worker_command(name: str, trace_path: str, result_path: str, *, device: int, budget_mb: int,
                   sample_every: int, sample_bytes: int, allow_unknown_frees: bool,
                   workspace_all: bool) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of the worker that replays under ``name``."""
    if name not in GPU_ALLOCATORS:
        raise ValueError(f"{name!r} is not a GPU allocator; accepted: {', '.join(GPU_ALLOCATORS)}")
    env = dict(os.environ)
    conf = ALLOCATORS[name]
    if conf is None:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    else:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "alloc", "replay", trace_path, "--worker", name, "--result", result_path,
           "--device", str(device), "--budget-mb", str(budget_mb), "--sample-every", str(sample_every),
           "--sample-bytes", str(sample_bytes)]
    if allow_unknown_frees:
        cmd.append("--allow-unknown-frees")
    if workspace_all:
        cmd.append("--workspace-all")
    return cmd, env


def gpu_worker(args) -> int:
    """Runs in the fresh process: replays under one allocator and writes the result as JSON."""
    name = args.worker
    expected = ALLOCATORS[name]
    if expected is not None and os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") != expected:
        raise SystemExit(f"worker {name}: PYTORCH_CUDA_ALLOC_CONF must be {expected!r} before torch loads")
    trace = load_trace(args.trace, allow_unknown_frees=args.allow_unknown_frees)
    plan = compile_trace(trace, workspace_all=args.workspace_all)
    import torch
    ours = name == "arena"
    if ours:
        import alloc
        from .config import from_env
        alloc.install(from_env().replace(budget_mb=args.budget_mb))
    torch.cuda.init()
    count = torch.cuda.device_count()
    if len(plan.devices) <= 1:
        device_of = {d: args.device for d in plan.devices}
    else:
        missing = [d for d in plan.devices if d >= count]
        if missing:
            raise SystemExit(f"the trace uses devices {plan.devices}; this machine has {count}")
        device_of = {d: d for d in plan.devices}
    main_device = device_of.get(plan.devices[0], args.device) if plan.devices else args.device
    torch.cuda.set_device(main_device)
    used_devices = sorted(set(device_of.values())) or [main_device]
    cudart = torch.cuda.cudart()

    def used(d: int) -> int:
        free_b, total_b = cudart.cudaMemGetInfo(d)
        return total_b - free_b

    baseline = {d: used(d) for d in used_devices}
    peak = dict.fromkeys(used_devices, 0)

    def sample():
        for d in used_devices:
            peak[d] = max(peak[d], used(d) - baseline[d])

    keep_streams = []  # each recorded stream but 0 (the default stream) gets a stream of its own

    def stream_handle(recorded: int, device: int) -> int:
        if recorded == 0:
            return 0
        s = torch.cuda.Stream(device=device)
        keep_streams.append(s)
        return s.cuda_stream

    streams = {(device_of.get(op[3], main_device), op[5]): None for op in plan.ops}
    for d, s in streams:
        streams[(d, s)] = stream_handle(s, d)
    raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
    raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
    if raw_alloc is None or raw_delete is None:  # the public wrappers, one device switch slower
        def raw_alloc(size, stream):
            return torch.cuda.caching_allocator_alloc(size, torch.cuda.current_device(), stream)
        raw_delete = torch.cuda.caching_allocator_delete
    single = len(used_devices) == 1

    def allocate(size, device, pool, stream):
        d = device_of[device]
        handle = streams[(d, stream)]
        if single:
            return raw_alloc(size, handle)
        with torch.cuda.device(d):
            return raw_alloc(size, handle)

    def free(ptr, stream):
        raw_delete(ptr)

    scope = None

    def set_pool(pool):
        nonlocal scope
        if pool == WORKSPACE and scope is None:
            scope = alloc.workspace()
            scope.__enter__()
        elif pool != WORKSPACE and scope is not None:
            scope.__exit__(None, None, None)
            scope = None

    def progress(done):
        print(f"@progress {done} {len(plan.ops)}", flush=True)

    torch.cuda.synchronize()
    loop = run_ops(plan, allocate, free, set_pool=set_pool if ours else None, sample=sample,
                   sample_every=args.sample_every, sample_bytes=args.sample_bytes, progress=progress,
                   failure_types=(RuntimeError, MemoryError))  # torch.OutOfMemoryError is a RuntimeError
    torch.cuda.synchronize()
    sample()
    try:
        if ours:
            own_reserved = sum(alloc.max_memory_reserved(d) for d in used_devices)
            own_allocated = sum(alloc.max_memory_allocated(d) for d in used_devices)
        else:
            own_reserved = sum(torch.cuda.max_memory_reserved(d) for d in used_devices)
            own_allocated = sum(torch.cuda.max_memory_allocated(d) for d in used_devices)
    except Exception as e:  # noqa: BLE001 - an allocator without statistics: report without them
        own_reserved = own_allocated = None
        print(f"no allocator statistics: {e}", file=sys.stderr)
    device_peak = sum(peak.values())
    result = _result(name, loop, plan, where="gpu", conf=ALLOCATORS[name],
                     peak_device_bytes=device_peak, peak_reserved_bytes=own_reserved,
                     peak_in_use_bytes=own_allocated,
                     peak_bytes=max(v for v in (device_peak, own_reserved) if v is not None),
                     budget=args.budget_mb << 20 if ours else None,
                     device=torch.cuda.get_device_name(main_device), torch=torch.__version__)
    with open(args.result, "w") as f:
        json.dump(result, f)
    return 0


def run_worker(name: str, trace_path: str, args, tick: Callable[[int, int], None] | None,
               budget_mb: int) -> dict:
    """Starts the worker for ``name`` and waits for its result; a failure becomes an error row."""
    with tempfile.TemporaryDirectory(prefix="alloc-replay-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        cmd, env = worker_command(name, trace_path, result_path, device=args.device, budget_mb=budget_mb,
                                  sample_every=args.sample_every, sample_bytes=args.sample_bytes,
                                  allow_unknown_frees=args.allow_unknown_frees,
                                  workspace_all=args.workspace_all)
        with open(os.path.join(tmp, "stderr"), "w+") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            timer = threading.Timer(args.timeout, proc.kill)
            timer.start()
            try:
                for line in proc.stdout:
                    parts = line.split()
                    if len(parts) == 3 and parts[0] == "@progress" and tick is not None:
                        tick(int(parts[1]), int(parts[2]))
                rc = proc.wait()
            finally:
                timer.cancel()
            err.seek(0)
            stderr = err.read()
        if rc == 0 and os.path.exists(result_path):
            with open(result_path) as f:
                return json.load(f)
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-3:]
        why = "timed out" if rc in (-9, 137) else f"exit status {rc}"
        return {"allocator": name, "where": "gpu", "conf": ALLOCATORS[name],
                "error": f"{why}: {' | '.join(tail) or 'no output'}"}


# -- the table -------------------------------------------------------------------------------------------
def _mib(v) -> str:
    return "-" if v is None else f"{v / MiB:,.0f}"


def render_table(results: list[dict], plan: Plan, trace: TraceFile, budget: int, budget_why: str,
                 width: int = 150) -> str:
    import io

    from rich.console import Console
    from rich.table import Table
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
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ALLOCATORS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown allocator(s) {', '.join(unknown) or '(none)'}; "
                                         f"accepted: {', '.join(ALLOCATORS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m alloc replay", description=(
        "Replay an allocation trace under several allocators (each GPU one in a fresh process, and the "
        "host-backed arena on the CPU) and compare peak memory, failures and operations per second. "
        "Exit status: 0 every allocator replayed it with no more failures than were recorded, 1 one "
        "did not, 2 bad arguments or a malformed trace."))
    p.add_argument("trace", help="a CSV trace (ours or RMM's) or a snapshot pickle")
    p.add_argument("--allocators", type=_allocator_list, default=None,
                   help=f"comma-separated, from {', '.join(ALLOCATORS)} (default: all where CUDA is, "
                        "else host)")
    p.add_argument("--device", type=int, default=0, help="CUDA device of a single-device trace")
    p.add_argument("--budget-mb", type=int,
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return gpu_worker(args)
    for flag in ("sample_every", "sample_bytes", "budget_mb"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            print(f"error: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    from .errors import ConfigError
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
    results = []
    show = not args.no_progress and args.json != "-"
    progress = None
    if show:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
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
