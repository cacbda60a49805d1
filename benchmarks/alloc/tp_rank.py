"""One rank of the seed workload under tensor parallelism (benchmarks/alloc/tp_seed.py): the
workload's flags, the chunk loop in named steps (become a rank, set up, the loop, the checks) and
the run's assembly on rank 0."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from alloc.units import MiB  # noqa: E402
from benchmarks.alloc.tp_tables import print_run  # noqa: E402

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


def become_rank(args):
    """``(context, owned)``: the rank tp.launch made, or one made here when plain torchrun
    started this script (owned: this rank must tear its process group down)."""
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
    return ctx, owned


class Rank(NamedTuple):
    """What the loop runs on: the rank's context, its MLP shard and serving step, the dtypes and
    the logits budget."""
    ctx: object
    mlp: object
    step: object
    dtype: object
    mlp_dtype: object
    budget: int

    def say(self, *what) -> None:
        print(f"[rank {self.ctx.env.rank}]", *what, flush=True)


def set_up(args, ctx) -> Rank:
    """The rank's weights, kv cache and step buffers, then one all-reduce of the real size."""
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
    dtype = getattr(torch, DTYPES[args.dtype])
    mlp_dtype = getattr(torch, DTYPES[args.mlp_dtype])
    mlp = ShardedMLP.from_seed(args.seed, args.hidden, args.intermediate, ctx.env.rank,
                               ctx.env.world_size, dtype=mlp_dtype, device=ctx.device)
    step = ServingStep(mlp, max_tokens=args.prompt_tokens, max_chunk_tokens=args.chunk_tokens,
                       head_dim=args.head_dim, kv_dtype=dtype, compress_ratio=args.compress_ratio,
                       topk=args.topk, max_logits_bytes=budget, device=ctx.device)
    ctx.mark("weights and kv cache")
    # The all-reduce of the real size, once before the loop: NCCL connects its channels and
    # sizes its buffers for it at the first call, and that cost belongs to NCCL, not to chunk 1.
    probe = torch.zeros(args.chunk_tokens, args.hidden, dtype=mlp_dtype, device=ctx.device)
    ctx.mark("before full-size all-reduce")
    dist.all_reduce(probe)
    ctx.mark("full-size all-reduce")
    del probe
    ctx.mark("loop start")
    return Rank(ctx, mlp, step, dtype, mlp_dtype, budget)


def chunk_loop(args, r: Rank) -> tuple[list[dict], list[dict]]:
    """Every chunk through the serving step: a row of figures per chunk, and the sampled rows'
    inputs and outputs for the checks."""
    import torch
    ctx, step = r.ctx, r.step
    base = ctx.find("context").device_used
    rows, samples, previous_seen = [], [], 0
    for index, (tokens, seen) in enumerate(chunks(args.prompt_tokens, args.chunk_tokens), 1):
        new_kv = step.kv_entries(seen) - step.kv_entries(previous_seen)
        hidden, q, w, kv, kv_scale = _chunk_inputs(args, index, tokens, new_kv, ctx.device, r.dtype,
                                                   r.mlp_dtype)
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
        t0 = time.perf_counter()
        result = step(hidden, q, w, kv, kv_scale)
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
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
    return rows, samples


def checks(args, r: Rank, rows: list[dict], samples: list[dict]) -> dict:
    """The workspace held to its budget (arena), the MLP and the indices against float64."""
    return {"mlp_check": _check_mlp(args, samples, r.ctx.device, r.mlp_dtype),
            "index_check": _check_indices(args, samples, r.step),
            "workspace_check": _check_workspace(rows, r.budget) if r.ctx.allocator == "arena" else None}


def run_rank(args) -> int:
    """One rank's whole run; rank 0 gathers every rank's figures, writes and prints the run."""
    import torch
    import torch.distributed as dist
    ctx, owned = become_rank(args)
    t_setup = time.perf_counter()
    r = set_up(args, ctx)
    setup_s = time.perf_counter() - t_setup
    rank, world, device = ctx.env.rank, ctx.env.world_size, ctx.device
    r.say(f"{args.prompt_tokens:,} tokens in {len(chunks(args.prompt_tokens, args.chunk_tokens))} "
          f"chunks on {device}, allocator {ctx.allocator}, world size {world}")
    loop_start = time.perf_counter()
    rows, samples = chunk_loop(args, r)
    loop_s = time.perf_counter() - loop_start
    r.say(f"loop done in {loop_s:.2f} s; checking against float64 references")
    t_check = time.perf_counter()
    checked = checks(args, r, rows, samples)
    check_s = time.perf_counter() - t_check
    device_name = torch.cuda.get_device_name(device) if ctx.cuda else platform.machine() or "cpu"
    mine = {"rank": rank, "local_rank": ctx.env.local_rank, "device": str(device),
            "device_name": device_name, "context": ctx.to_dict(), "chunks": rows,
            "weights_bytes": r.mlp.nbytes, "step_buffers_bytes": r.step.nbytes,
            "setup_s": setup_s, "loop_s": loop_s, "check_s": check_s, **checked,
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
