"""The seed workload under tensor parallelism: each rank its own process, torch.distributed (NCCL).

Per prefill chunk of a 254,000-token prompt (3,200-token chunks, compress ratio 4, 512 MiB logits
budget) every rank runs ``tp.step.ServingStep``: the sharded MLP over the chunk's hidden states
(DeepSeek-V3's dense MLP, 7168 -> 2 x 18432 -> 7168, bf16), closed by an NCCL all-reduce, then
the indexer prefill (64 heads x 128, bf16, top-2048) replicated on every rank, its logits pieces
from the rank's own arena. Every input comes from generators seeded by the chunk, so all ranks
(and a one-rank run) build the same hidden states, q, w and kv.

Shown per rank: device memory taken after each chunk (cudaMemGetInfo, total - free, from the
rank's CUDA context on), the arena's workspace reservation, what process-group init and the
first collectives cost (split into the PyTorch allocator's share and NCCL's own), wall time; and
checks: indices identical across ranks and across runs (SHA-256 of every chunk's indices), the
all-reduced MLP output identical across ranks and equal, within the rounding of its dtype, to the
unsharded float64 MLP over weights regenerated from the seed (sampled rows of every chunk), and
the sampled rows' indices a true top-k of the float64 indexer logits (tie-aware agreement).

One command runs everything a machine allows, each run a fresh set of processes::

    python benchmarks/tp_seed.py --json tp.json      # GPUs: arena and default on min(2, GPUs)
                                                     # ranks, plus a one-GPU reference run
    python benchmarks/tp_seed.py --allocators none --nproc-per-node 2 [small shapes]   # CPU, gloo

One run, as the orchestrator starts it (also under torchrun)::

    python -m tp.launch --nproc-per-node 2 --allocator arena benchmarks/tp_seed.py --json r.json
    torchrun --nproc-per-node 2 -m tp.launch --allocator arena benchmarks/tp_seed.py --json r.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 1 << 20
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}
MLP_DTYPES = ("bf16", "fp16", "fp32")
MLP_RTOL = {"bf16": 3 * 2.0 ** -8, "fp16": 3 * 2.0 ** -11, "fp32": 1e-5}
"""Bound on ``||out - ref|| / ||ref||`` over the sampled rows: three roundings to the dtype (the
intermediate activations, each rank's partial sum, the reduced sum), each at most one unit
roundoff (2^-8 for bf16). Measured on the CPU at the seed's shapes: 0.0039 unsharded, 0.0043 over
two shards (about one unit roundoff). A missing or wrong shard is off by O(1). fp32 sums over
at most 18,432 terms in float32: well under 1e-5."""
INDEX_AGREEMENT_MIN = 0.99
"""Least tie-aware agreement of a sampled row's indices with the float64 top-k. The kernels sum
in float32, the reference in float64: a pair of keys whose logits differ by less than float32
rounding may swap at the k-th place, one or two indices of 2048, not more."""
HEADLINE_TOKENS = 166_400
"""Where the guide reads the default allocator's growth (13.6 GiB on one H200)."""


# ------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------

def workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", type=int, default=254_000)
    p.add_argument("--chunk-tokens", type=int, default=3_200)
    p.add_argument("--compress-ratio", type=int, default=4)
    p.add_argument("--budget-mb", type=int, default=512, help="logits budget (the arena's too)")
    p.add_argument("--budget-bytes", type=int, help="logits budget in bytes (small CPU runs); "
                   "under the arena it must equal the arena's budget")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="indexer q and kv")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=18432)
    p.add_argument("--mlp-dtype", choices=MLP_DTYPES, default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-rows", type=int, default=4,
                   help="rows of every chunk checked against the float64 references")


WORKLOAD_KEYS = ("prompt_tokens", "chunk_tokens", "compress_ratio", "budget_mb", "budget_bytes",
                 "topk", "heads", "head_dim", "dtype", "hidden", "intermediate", "mlp_dtype",
                 "seed", "check_rows")


def workload_argv(args) -> list[str]:
    out = []
    for key in WORKLOAD_KEYS:
        value = getattr(args, key)
        if value is not None:
            out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def budget_bytes(args) -> int:
    return args.budget_bytes if args.budget_bytes is not None else args.budget_mb * MiB


def chunks(prompt_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``(tokens, seen)`` of every chunk: its new tokens and the tokens seen once it is in."""
    out, start = [], 0
    while start < prompt_tokens:
        tokens = min(chunk_tokens, prompt_tokens - start)
        start += tokens
        out.append((tokens, start))
    return out


# ------------------------------------------------------------------------------------------------
# one rank
# ------------------------------------------------------------------------------------------------

def _digest(t) -> str:
    import torch
    return hashlib.sha256(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
                          ).hexdigest()


def _sample_rows(tokens: int, n: int) -> list[int]:
    """``n`` rows spread over the chunk, first and last included."""
    if n <= 0:
        return []
    if n == 1 or tokens == 1:
        return [tokens - 1]
    return sorted({round(i * (tokens - 1) / (n - 1)) for i in range(n)})


def _chunk_inputs(args, index: int, tokens: int, new_kv: int, device, dtype, mlp_dtype):
    """The chunk's hidden states, q, w and new kv entries, the same on every rank."""
    import torch
    g = torch.Generator(device=device)
    g.manual_seed(args.seed * 1_000_003 + index)
    # randn has no fp8 kernel: draw in bf16 and round once more.
    draw = torch.bfloat16 if dtype.itemsize == 1 else dtype
    hidden = torch.randn(tokens, args.hidden, generator=g, device=device, dtype=mlp_dtype)
    q = torch.randn(tokens, args.heads, args.head_dim, generator=g, device=device,
                    dtype=draw).to(dtype)
    w = torch.randn(tokens, args.heads, generator=g, device=device).mul_(args.heads ** -0.5)
    kv = torch.randn(new_kv, args.head_dim, generator=g, device=device, dtype=draw).to(dtype)
    kv_scale = torch.rand(new_kv, generator=g, device=device).add_(0.5)
    return hidden, q, w, kv, kv_scale


def _workspace_stats(ctx) -> dict | None:
    if ctx.allocator != "arena":
        return None
    import alloc
    s = alloc.memory_stats(ctx.device.index)
    return {k: s[f"arena.workspace.{k}"] for k in
            ("capacity", "in_use_peak", "backend_reserves", "blocks_allocated", "requests_failed")}


def _check_workspace(rows: list[dict], budget: int) -> dict:
    """The arena's workspace held exactly the budget after every chunk, from its one
    reservation, and never refused a piece."""
    ws = [r["workspace"] for r in rows]
    caps = {w["capacity"] for w in ws}
    reserves = {w["backend_reserves"] for w in ws}
    peak = max(w["in_use_peak"] for w in ws)
    failed = ws[-1]["requests_failed"]
    return {"capacities": sorted(caps), "backend_reserves": sorted(reserves), "budget": budget,
            "in_use_peak": peak, "requests_failed": failed,
            "ok": caps == {budget} and reserves == {1} and peak <= budget and failed == 0}


def _check_mlp(args, samples, device, mlp_dtype) -> dict:
    import torch

    from tp.mlp import full_weights, reference_mlp
    gate_up, down = full_weights(args.seed, args.hidden, args.intermediate)
    # The shards were cast from these float32 values; the reference sees the same rounding.
    gate_up = gate_up.to(mlp_dtype).to(device).double()
    down = down.to(mlp_dtype).to(device).double()
    x = torch.cat([s["x"] for s in samples]).to(device)
    got = torch.cat([s["y"] for s in samples]).to(device).double()
    want = reference_mlp(x, gate_up, down)
    rel = ((got - want).norm() / want.norm()).item()
    row = ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
    tol = MLP_RTOL[args.mlp_dtype]
    return {"rows": x.shape[0], "rel_err": rel, "max_row_rel_err": row, "tolerance": tol,
            "ok": bool(rel <= tol)}


def _check_indices(args, samples, step) -> dict:
    import torch

    from indexer import reference as ref
    agreements, exact = [], 0
    for s in samples:
        n = s["seen"] // args.compress_ratio
        rows = torch.tensor(s["rows"], dtype=torch.int64)
        ke = ((s["seen"] - s["tokens"] + rows + 1) // args.compress_ratio).to(torch.int32)
        ks = torch.zeros_like(ke)
        dev = step.device
        logits = ref.logits(s["q"].to(dev), step.kv[:n], step.kv_scale[:n], s["w"].to(dev),
                            ks.to(dev), ke.to(dev), dtype=torch.float64)
        idx = s["idx"].to(dev)
        agreements += ref.topk_agreement(logits, idx, ks.to(dev), ke.to(dev), args.topk).tolist()
        exact += int(ref.topk_validity(logits, idx, ks.to(dev), ke.to(dev), args.topk).sum())
    least = min(agreements) if agreements else 1.0
    return {"rows": len(agreements), "exact_rows": exact, "min_agreement": least,
            "mean_agreement": sum(agreements) / max(1, len(agreements)),
            "threshold": INDEX_AGREEMENT_MIN, "ok": bool(least >= INDEX_AGREEMENT_MIN)}


def run_rank(args) -> int:
    import tp.launch as launch
    ctx = launch.context()
    owned = ctx is None
    if owned:
        # Started by plain torchrun on this script: become a rank here, before CUDA starts.
        if args.allocator == "arena" and args.budget_bytes is None:
            os.environ.setdefault("VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", str(args.budget_mb))
        ctx = launch.init_rank(args.allocator or "arena")
    elif args.allocator and args.allocator != ctx.allocator:
        raise launch.LaunchError(f"--allocator {args.allocator} given, but tp.launch started "
                                 f"this rank with --allocator {ctx.allocator}")
    if ctx.device.type == "cpu":
        # The indexer's kernels are Triton; on the CPU only its interpreter runs them, and it is
        # chosen when the kernels' module is imported.
        if "indexer" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("on the CPU the indexer needs TRITON_INTERPRET=1 before it is "
                               "imported")
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.distributed as dist

    import alloc
    from tp.mlp import ShardedMLP
    from tp.step import ServingStep

    budget = budget_bytes(args)
    if ctx.allocator == "arena" and alloc.installed_config().budget_bytes != budget:
        raise SystemExit(f"the arena's budget is {alloc.installed_config().budget_mb} MiB but the "
                         f"workload's is {budget / MiB:g} MiB: set "
                         f"VLLM_SPARSE_INDEXER_MAX_LOGITS_MB={budget // MiB} for the ranks")
    rank, world = ctx.env.rank, ctx.env.world_size
    device = ctx.device
    dtype = getattr(torch, DTYPES[args.dtype])
    mlp_dtype = getattr(torch, DTYPES[args.mlp_dtype])
    say = (lambda *a: print(f"[rank {rank}]", *a, flush=True))

    t_setup = time.perf_counter()
    mlp = ShardedMLP.from_seed(args.seed, args.hidden, args.intermediate, rank, world,
                               dtype=mlp_dtype, device=device)
    step = ServingStep(mlp, max_tokens=args.prompt_tokens, max_chunk_tokens=args.chunk_tokens,
                       head_dim=args.head_dim, kv_dtype=dtype, compress_ratio=args.compress_ratio,
                       topk=args.topk, max_logits_bytes=budget, device=device)
    ctx.mark("weights and kv cache")
    # The all-reduce of the real size, once before the loop: NCCL connects its channels and
    # sizes its buffers for it at the first call, and that cost belongs to NCCL, not to chunk 1.
    probe = torch.zeros(args.chunk_tokens, args.hidden, dtype=mlp_dtype, device=device)
    ctx.mark("before full-size all-reduce")
    dist.all_reduce(probe)
    ctx.mark("full-size all-reduce")
    del probe
    ctx.mark("loop start")
    setup_s = time.perf_counter() - t_setup
    say(f"{args.prompt_tokens:,} tokens in {len(chunks(args.prompt_tokens, args.chunk_tokens))} "
        f"chunks on {device}, allocator {ctx.allocator}, world size {world}")

    base = ctx.find("context").device_used
    rows, samples, previous_seen = [], [], 0
    loop_start = time.perf_counter()
    for index, (tokens, seen) in enumerate(chunks(args.prompt_tokens, args.chunk_tokens), 1):
        new_kv = step.kv_entries(seen) - step.kv_entries(previous_seen)
        hidden, q, w, kv, kv_scale = _chunk_inputs(args, index, tokens, new_kv, device, dtype,
                                                   mlp_dtype)
        if ctx.cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        result = step(hidden, q, w, kv, kv_scale)
        if ctx.cuda:
            torch.cuda.synchronize(device)
        step_s = time.perf_counter() - t0
        mark = ctx.mark(f"chunk {index}")
        pick = _sample_rows(tokens, args.check_rows)
        samples.append({"seen": seen, "tokens": tokens, "rows": pick,
                        "x": hidden[pick].cpu(), "y": result.hidden[pick].cpu(),
                        "q": q[pick].cpu(), "w": w[pick].cpu(), "idx": result.indices[pick].cpu()})
        rows.append({"chunk": index, "tokens": seen, "step_s": step_s, "mlp_s": result.mlp_s,
                     "indexer_s": result.indexer_s, "logits_s": result.prefill.logits_s,
                     "topk_s": result.prefill.topk_s, "pieces": result.prefill.pieces,
                     "max_piece_bytes": result.prefill.max_piece_bytes,
                     "device_bytes": None if base is None else mark.device_used - base,
                     "allocator_reserved": mark.allocator_reserved,
                     "workspace": _workspace_stats(ctx),
                     "indices_sha256": _digest(result.indices),
                     "hidden_sha256": _digest(result.hidden)})
        del hidden, q, w, kv, kv_scale, result
        previous_seen = seen
    loop_s = time.perf_counter() - loop_start
    say(f"loop done in {loop_s:.2f} s; checking against float64 references")

    t_check = time.perf_counter()
    workspace_check = _check_workspace(rows, budget) if ctx.allocator == "arena" else None
    mlp_check = _check_mlp(args, samples, device, mlp_dtype)
    index_check = _check_indices(args, samples, step)
    check_s = time.perf_counter() - t_check
    device_name = torch.cuda.get_device_name(device) if ctx.cuda else platform.machine() or "cpu"
    mine = {"rank": rank, "local_rank": ctx.env.local_rank, "device": str(device),
            "device_name": device_name, "context": ctx.to_dict(), "chunks": rows,
            "weights_bytes": mlp.nbytes, "step_buffers_bytes": step.nbytes,
            "setup_s": setup_s, "loop_s": loop_s, "check_s": check_s,
            "mlp_check": mlp_check, "index_check": index_check,
            "workspace_check": workspace_check,
            "full_allreduce_cost": ctx.cost("before full-size all-reduce", "full-size all-reduce")}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    code = 0
    if rank == 0:
        out = assemble(args, ctx, everyone)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        print_run(out)
        code = 0 if out["ok"] else 1
    dist.barrier()
    if owned:
        # tp.launch tears down the group it made; plain torchrun leaves it to the script.
        dist.destroy_process_group()
    return code


def assemble(args, ctx, ranks: list[dict]) -> dict:
    import torch
    first = ranks[0]
    agree_idx = all(r["chunks"][i]["indices_sha256"] == first["chunks"][i]["indices_sha256"]
                    for r in ranks for i in range(len(first["chunks"])))
    agree_hidden = all(r["chunks"][i]["hidden_sha256"] == first["chunks"][i]["hidden_sha256"]
                       for r in ranks for i in range(len(first["chunks"])))
    ok = agree_idx and agree_hidden and all(
        r["mlp_check"]["ok"] and r["index_check"]["ok"]
        and (r["workspace_check"] is None or r["workspace_check"]["ok"]) for r in ranks)
    nccl = None
    if ctx.cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a build without NCCL has already failed init_rank; keep the report
            nccl = None
    return {"workload": {k: getattr(args, k) for k in WORKLOAD_KEYS},
            "allocator": ctx.allocator, "backend": ctx.backend, "world_size": ctx.env.world_size,
            "torch": torch.__version__, "nccl": nccl, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "indices_identical_across_ranks": agree_idx,
            "hidden_identical_across_ranks": agree_hidden, "ok": ok,
            "run_indices_sha256": _run_digest(first["chunks"], "indices_sha256"),
            "ranks": ranks}


def _run_digest(chunk_rows: list[dict], key: str) -> str:
    return hashlib.sha256("".join(c[key] for c in chunk_rows).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------
# summaries and tables
# ------------------------------------------------------------------------------------------------

def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:,.0f}"


def rank_summary(run: dict, r: dict) -> dict:
    chunks_ = r["chunks"]
    dev = [c["device_bytes"] for c in chunks_]
    cuda = dev[0] is not None
    at = next((c for c in chunks_ if c["tokens"] >= HEADLINE_TOKENS), chunks_[-1])
    ws = [c["workspace"] for c in chunks_ if c["workspace"]]
    pg = r["context"].get("process_group_cost") or {}
    full = r.get("full_allreduce_cost") or {}
    steady = sum(c["step_s"] for c in chunks_[1:])
    return {
        "allocator": run["allocator"], "world_size": run["world_size"], "rank": r["rank"],
        "device_name": r["device_name"],
        "first_chunk": dev[0] if cuda else None, "at_headline": at["device_bytes"] if cuda else None,
        "headline_tokens": at["tokens"],
        "peak": max(dev) if cuda else None, "end": dev[-1] if cuda else None,
        "loop_growth": (max(dev) - dev[0]) if cuda else None,
        "workspace_min": min(w["capacity"] for w in ws) if ws else None,
        "workspace_max": max(w["capacity"] for w in ws) if ws else None,
        "workspace_peak_in_use": max(w["in_use_peak"] for w in ws) if ws else None,
        "workspace_device_calls": ws[-1]["backend_reserves"] if ws else None,
        "workspace_ok": (r["workspace_check"] or {}).get("ok"),
        "pg_outside": pg.get("outside"), "pg_allocator": pg.get("allocator"),
        "allreduce_outside": full.get("outside"), "allreduce_allocator": full.get("allocator"),
        "weights": r["weights_bytes"],
        "loop_s": r["loop_s"], "steps_s": sum(c["step_s"] for c in chunks_),
        "first_step_s": chunks_[0]["step_s"], "steady_s": steady,
        "mlp_s": sum(c["mlp_s"] for c in chunks_), "indexer_s": sum(c["indexer_s"] for c in chunks_),
        "mlp_rel_err": r["mlp_check"]["rel_err"], "mlp_ok": r["mlp_check"]["ok"],
        "index_min_agreement": r["index_check"]["min_agreement"], "index_ok": r["index_check"]["ok"],
    }


COLUMNS = ("allocator", "ranks", "rank", "MiB chunk 1", "MiB @166,400", "peak MiB", "growth MiB",
           "workspace MiB", "ws device calls", "NCCL own MiB", "PG via alloc MiB",
           "steps s (chunk 1)", "MLP s", "indexer s", "MLP rel err", "top-k agree")
"""Memory columns are device memory taken (cudaMemGetInfo) from the rank's CUDA context on;
growth is peak minus chunk 1. NCCL own: device memory that process-group init, the first
collective and the first full-size all-reduce took outside the PyTorch allocator; PG via alloc:
what they took through it. Steps: the timed chunk steps (MLP + all-reduce + kv write + indexer),
chunk 1 (kernel compilation or cache loads) in brackets; MLP and indexer: device time."""


def summary_cells(s: dict) -> list[str]:
    ws = "-" if s["workspace_min"] is None else (
        f"{s['workspace_min'] / MiB:,.0f}" if s["workspace_min"] == s["workspace_max"]
        else f"{s['workspace_min'] / MiB:,.0f}-{s['workspace_max'] / MiB:,.0f}")
    if s["workspace_ok"] is False:
        ws += " FAIL"
    nccl_own = None if s["pg_outside"] is None else s["pg_outside"] + (s["allreduce_outside"] or 0)
    via = None if s["pg_allocator"] is None else s["pg_allocator"] + (s["allreduce_allocator"] or 0)
    return [s["allocator"], str(s["world_size"]), str(s["rank"]), _mib(s["first_chunk"]),
            _mib(s["at_headline"]), _mib(s["peak"]), _mib(s["loop_growth"]), ws,
            "-" if s["workspace_device_calls"] is None else str(s["workspace_device_calls"]),
            _mib(nccl_own), _mib(via), f"{s['steps_s']:.2f} ({s['first_step_s']:.2f})",
            f"{s['mlp_s']:.2f}",
            f"{s['indexer_s']:.2f}", f"{s['mlp_rel_err']:.2e}" + ("" if s["mlp_ok"] else " FAIL"),
            f"{s['index_min_agreement']:.4f}" + ("" if s["index_ok"] else " FAIL")]


def print_run(run: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=f"tp seed workload: allocator {run['allocator']}, {run['world_size']} "
                        f"rank(s), {run['backend']}")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for r in run["ranks"]:
        table.add_row(*summary_cells(rank_summary(run, r)))
    console = Console(width=max(200, Console().width))
    console.print(table)
    console.print(f"indices identical across ranks: {run['indices_identical_across_ranks']}; "
                  f"all-reduced MLP output identical across ranks: "
                  f"{run['hidden_identical_across_ranks']}; run digest "
                  f"{run['run_indices_sha256'][:16]}")


# ------------------------------------------------------------------------------------------------
# the orchestrator: every run a fresh set of processes
# ------------------------------------------------------------------------------------------------

def plan_runs(allocators: list[str], nproc: int, reference: bool) -> list[tuple[str, int]]:
    runs = [(a, nproc) for a in allocators]
    if reference and nproc > 1:
        # The single-GPU run the sharded ones must reproduce. It goes first so that every
        # sharded run finds Triton's kernel cache warm and none pays for the compilation.
        runs.insert(0, (allocators[0], 1))
    return runs


def launch_run(args, allocator: str, nproc: int) -> tuple[int, list[str], dict | None]:
    """One run in a fresh set of processes: (exit status, command, the run's JSON or None). The
    ranks' allocator is set up by tp.launch from arena_tools.allocators."""
    from arena_tools import allocators
    env = dict(os.environ)
    if args.budget_bytes is None:
        env["VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"] = str(args.budget_mb)
    if allocator == "none":
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmds = []

    def argv(result_path: str) -> list[str]:
        cmds.append([sys.executable, "-m", "tp.launch", "--nproc-per-node", str(nproc), "--allocator",
                     allocator, str(Path(__file__).resolve()), "--json", result_path, *workload_argv(args)])
        print(f"=== {shlex.join(cmds[-1])}", flush=True)
        return cmds[-1]

    out = allocators.run_child(argv, env, timeout=args.run_timeout, capture=False, cwd=str(ROOT))
    if "error" not in out:
        return 0, cmds[-1], out
    return out["exit_status"], cmds[-1], out.get("result")


def orchestrate(args) -> int:
    import torch
    cuda = torch.cuda.is_available()
    allocators = args.allocators or (["arena", "default"] if cuda else ["none"])
    nproc = args.nproc_per_node or (min(2, torch.cuda.device_count()) if cuda else 2)
    runs = plan_runs(allocators, nproc, not args.no_reference)
    results = []
    for allocator, n in runs:
        t0 = time.perf_counter()
        code, cmd, run = launch_run(args, allocator, n)
        entry = {"allocator": allocator, "world_size": n, "command": shlex.join(cmd),
                 "exit_status": code, "elapsed_s": time.perf_counter() - t0}
        if run is not None:
            entry["run"] = run
        results.append(entry)
    comparison = compare_runs(results)
    summaries = [rank_summary(e["run"], r) for e in results if "run" in e
                 for r in e["run"]["ranks"]]
    out = {"device": _device_line(results), "runs": results, "summaries": summaries,
           "comparison": comparison, "ok": comparison["ok"]}
    print_comparison(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(out, sys.argv))
    return 0 if out["ok"] else 1


def _device_line(results: list[dict]) -> str:
    """From what the ranks reported: asking torch here would make a CUDA context in this
    process, on GPU 0, inside rank 0's measurements of a later run."""
    import torch
    seen = {}
    for e in results:
        for r in e.get("run", {}).get("ranks", []):
            seen[r["device"]] = r["device_name"]
    if not seen:
        return f"torch {torch.__version__}"
    names = sorted(set(seen.values()))
    gpus = sum(1 for d in seen if d.startswith("cuda"))
    what = f"{gpus} x {', '.join(names)}" if gpus else f"CPU ({', '.join(names)})"
    return f"{what}, torch {torch.__version__}"


def compare_runs(results: list[dict]) -> dict:
    done = [e for e in results if "run" in e]
    failed = [f"{e['allocator']} x{e['world_size']}: exit {e['exit_status']}" for e in results
              if e["exit_status"] != 0 or "run" not in e]
    if not done:
        return {"ok": False, "failed": failed, "reference": None, "matches": {}}
    ref = next((e for e in done if e["world_size"] == 1), done[0])
    ref_chunks = ref["run"]["ranks"][0]["chunks"]
    matches = {}
    for e in done:
        name = f"{e['allocator']} x{e['world_size']}"
        per_rank = []
        for r in e["run"]["ranks"]:
            same = sum(a["indices_sha256"] == b["indices_sha256"]
                       for a, b in zip(r["chunks"], ref_chunks))
            per_rank.append({"rank": r["rank"], "chunks_equal": same, "chunks": len(ref_chunks),
                             "equal": same == len(ref_chunks) == len(r["chunks"])})
        matches[name] = per_rank
    ok = not failed and all(e["run"]["ok"] for e in done) and \
        all(p["equal"] for per in matches.values() for p in per)
    return {"ok": ok, "failed": failed,
            "reference": f"{ref['allocator']} x{ref['world_size']}", "matches": matches}


def print_comparison(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console(width=max(200, Console().width))
    table = Table(title=f"tp seed workload, every run side by side ({out['device']})")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for e in out["runs"]:
        if "run" not in e:
            table.add_row(e["allocator"], str(e["world_size"]), "-",
                          *["-"] * (len(COLUMNS) - 4), f"exit {e['exit_status']}")
            continue
        for r in e["run"]["ranks"]:
            table.add_row(*summary_cells(rank_summary(e["run"], r)))
    console.print(table)
    cmp_ = out["comparison"]
    for name, per in cmp_["matches"].items():
        console.print(f"{name}: indices equal to {cmp_['reference']} in "
                      + ", ".join(f"rank {p['rank']} {p['chunks_equal']}/{p['chunks']} chunks"
                                  for p in per))
    for f in cmp_["failed"]:
        console.print(f"[red]failed: {f}[/red]")
    console.print("all checks passed" if out["ok"] else "[red]some check failed[/red]")


def markdown(out: dict, argv: list[str]) -> str:
    lines = [f"Command: `python {shlex.join(argv)}`", "",
             f"Device: {out['device']}; date {datetime.date.today().isoformat()}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for e in out["runs"]:
        for r in e.get("run", {}).get("ranks", []):
            lines.append("| " + " | ".join(summary_cells(rank_summary(e["run"], r))) + " |")
    cmp_ = out["comparison"]
    lines.append("")
    for name, per in cmp_["matches"].items():
        lines.append(f"- {name}: indices equal to {cmp_['reference']} in "
                     + ", ".join(f"rank {p['rank']} {p['chunks_equal']}/{p['chunks']} chunks"
                                 for p in per))
    lines.append(f"- all checks passed: {out['ok']}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_args(p)
    p.add_argument("--json", help="write the results here (a rank: its run; else every run)")
    p.add_argument("--markdown", help="orchestrator: write a Markdown table for RESULTS.md here")
    p.add_argument("--allocator", choices=("arena", "default", "none"),
                   help="a rank started by plain torchrun: the allocator to install")
    p.add_argument("--allocators", type=lambda s: [a for a in s.split(",") if a],
                   help="orchestrator: runs to make (default: arena,default on GPUs, none on CPU)")
    p.add_argument("--nproc-per-node", type=int,
                   help="orchestrator: ranks per run (default: min(2, GPUs); 2 on the CPU)")
    p.add_argument("--no-reference", action="store_true",
                   help="orchestrator: skip the one-rank reference run")
    p.add_argument("--run-timeout", type=float, default=None, help="orchestrator: seconds per run")
    args = p.parse_args(argv)
    for a in args.allocators or []:
        if a not in ("arena", "default", "none"):
            p.error(f"unknown allocator {a!r}; accepted: arena, default, none")
    if "RANK" in os.environ:
        return run_rank(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
