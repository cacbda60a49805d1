"""Replaying a trace on the GPU: each allocator in a fresh process (arena_tools.allocators), the
raw allocations through ``torch.cuda.caching_allocator_alloc``'s entry points; see
arena_tools.replay."""

from __future__ import annotations

import sys
from collections.abc import Callable

from . import allocators
from .allocators import ALLOCATORS
from .export import load_trace
from .plan import WORKSPACE, Plan, compile_trace, result_row, run_ops

# The workspace scope's pool serves the tensors made inside alloc.workspace(), not raw
# allocations, so the replay compares the allocators that serve every request.
GPU_ALLOCATORS = tuple(n for n, a in ALLOCATORS.items() if a.scope != "workspace")


def worker_command(name: str, trace_path: str, result_path: str, *, device: int, budget_mb: int,
                   sample_every: int, sample_bytes: int, allow_unknown_frees: bool,
                   workspace_all: bool) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of the worker that replays under ``name``."""
    if name not in GPU_ALLOCATORS:
        raise ValueError(f"{name!r} is not a GPU allocator; accepted: {', '.join(GPU_ALLOCATORS)}")
    cmd = allocators.python("-m", "arena_tools", "replay", trace_path, "--worker", name, "--result",
                            result_path, "--device", str(device), "--budget-mb", str(budget_mb),
                            "--sample-every", str(sample_every), "--sample-bytes", str(sample_bytes))
    if allow_unknown_frees:
        cmd.append("--allow-unknown-frees")
    if workspace_all:
        cmd.append("--workspace-all")
    return cmd, allocators.child_environ(name)


def _device_map(plan: Plan, device: int, count: int) -> dict[int, int]:
    """Recorded device -> device here: a single-device trace on ``device``, others as recorded."""
    if len(plan.devices) <= 1:
        return {d: device for d in plan.devices}
    missing = [d for d in plan.devices if d >= count]
    if missing:
        raise SystemExit(f"the trace uses devices {plan.devices}; this machine has {count}")
    return {d: d for d in plan.devices}


def _streams(torch, plan: Plan, device_of: dict[int, int], main_device: int) -> tuple[dict, list]:
    """(device, recorded stream) -> a stream handle here: each recorded stream but 0 (the default
    stream) gets a stream of its own; the list keeps those streams alive."""
    keep, streams = [], {}
    for op in plan.ops:
        d, s = device_of.get(op[3], main_device), op[5]
        if (d, s) not in streams:
            if s == 0:
                streams[(d, s)] = 0
            else:
                keep.append(torch.cuda.Stream(device=d))
                streams[(d, s)] = keep[-1].cuda_stream
    return streams, keep


def _raw_entry_points(torch):
    raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
    raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
    if raw_alloc is None or raw_delete is None:  # the public wrappers, one device switch slower
        def raw_alloc(size, stream):
            return torch.cuda.caching_allocator_alloc(size, torch.cuda.current_device(), stream)
        raw_delete = torch.cuda.caching_allocator_delete
    return raw_alloc, raw_delete


def _pool_switch(alloc) -> Callable[[int], None]:
    """set_pool for the arena: workspace events inside alloc.workspace(), the others outside."""
    scope = None

    def set_pool(pool):
        nonlocal scope
        if pool == WORKSPACE and scope is None:
            scope = alloc.workspace()
            scope.__enter__()
        elif pool != WORKSPACE and scope is not None:
            scope.__exit__(None, None, None)
            scope = None
    return set_pool


def _own_peaks(torch, ours: bool, devices: list[int]) -> tuple[int | None, int | None]:
    """The allocator's own peak reserved and allocated bytes, summed over ``devices``."""
    import alloc
    source = alloc if ours else torch.cuda
    try:
        return (sum(source.max_memory_reserved(d) for d in devices),
                sum(source.max_memory_allocated(d) for d in devices))
    except Exception as e:  # noqa: BLE001 - an allocator without statistics: report without them
        print(f"no allocator statistics: {e}", file=sys.stderr)
        return None, None


def gpu_worker(args) -> int:
    """Runs in the fresh process: replays under one allocator and writes the result as JSON."""
    name = args.worker
    allocators.check_environ(name)
    trace = load_trace(args.trace, allow_unknown_frees=args.allow_unknown_frees)
    plan = compile_trace(trace, workspace_all=args.workspace_all)
    import torch
    ours = ALLOCATORS[name].scope is not None
    if ours:
        import alloc
        allocators.install(name, alloc.from_env().replace(budget_mb=args.budget_mb))
    torch.cuda.init()
    device_of = _device_map(plan, args.device, torch.cuda.device_count())
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

    streams, _keep = _streams(torch, plan, device_of, main_device)
    raw_alloc, raw_delete = _raw_entry_points(torch)
    single = len(used_devices) == 1

    def allocate(size, device, pool, stream):
        d = device_of[device]
        if single:
            return raw_alloc(size, streams[(d, stream)])
        with torch.cuda.device(d):
            return raw_alloc(size, streams[(d, stream)])

    def progress(done):
        print(f"@progress {done} {len(plan.ops)}", flush=True)

    torch.cuda.synchronize()
    loop = run_ops(plan, allocate, lambda ptr, stream: raw_delete(ptr),
                   set_pool=_pool_switch(alloc) if ours else None, sample=sample,
                   sample_every=args.sample_every, sample_bytes=args.sample_bytes, progress=progress,
                   failure_types=(RuntimeError, MemoryError))  # torch.OutOfMemoryError is a RuntimeError
    torch.cuda.synchronize()
    sample()
    own_reserved, own_allocated = _own_peaks(torch, ours, used_devices)
    device_peak = sum(peak.values())
    result = result_row(name, loop, plan, where="gpu", conf=ALLOCATORS[name].alloc_conf,
                        peak_device_bytes=device_peak, peak_reserved_bytes=own_reserved,
                        peak_in_use_bytes=own_allocated,
                        peak_bytes=max(v for v in (device_peak, own_reserved) if v is not None),
                        budget=args.budget_mb << 20 if ours else None,
                        device=torch.cuda.get_device_name(main_device), torch=torch.__version__)
    allocators.write_result(args.result, result)
    return 0


def run_worker(name: str, trace_path: str, args, tick: Callable[[int, int], None] | None,
               budget_mb: int) -> dict:
    """Starts the worker for ``name`` and waits for its result; a failure becomes an error row."""
    def on_line(line: str) -> None:
        parts = line.split()
        if len(parts) == 3 and parts[0] == "@progress" and tick is not None:
            tick(int(parts[1]), int(parts[2]))

    def argv(result_path: str) -> list[str]:
        return worker_command(name, trace_path, result_path, device=args.device, budget_mb=budget_mb,
                              sample_every=args.sample_every, sample_bytes=args.sample_bytes,
                              allow_unknown_frees=args.allow_unknown_frees,
                              workspace_all=args.workspace_all)[0]

    out = allocators.run_child(argv, allocators.child_environ(name), timeout=args.timeout, on_line=on_line)
    if "error" in out:
        return {"allocator": name, "where": "gpu", "conf": ALLOCATORS[name].alloc_conf, "error": out["error"]}
    return out
