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

    python benchmarks/alloc/tp_seed.py --json tp.json      # GPUs: arena and default on min(2, GPUs)
                                                     # ranks, plus a one-GPU reference run
    python benchmarks/alloc/tp_seed.py --allocators none --nproc-per-node 2 [small shapes]   # CPU, gloo

One run, as the orchestrator starts it (also under torchrun)::

    python -m tp.launch --nproc-per-node 2 --allocator arena benchmarks/alloc/tp_seed.py --json r.json
    torchrun --nproc-per-node 2 -m tp.launch --allocator arena benchmarks/alloc/tp_seed.py --json r.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.alloc.tp_rank import (_check_workspace, _sample_rows, chunks, run_rank,  # noqa: E402
                                      workload_args, workload_argv)
from benchmarks.alloc.tp_tables import (COLUMNS, markdown, print_comparison, rank_summary,  # noqa: E402
                                        summary_cells)

# The one rank's steps and the tables live beside this program; what the tests call stays here.
__all__ = ["chunks", "_sample_rows", "_check_workspace", "plan_runs", "compare_runs", "rank_summary",
           "summary_cells", "COLUMNS", "print_comparison", "markdown", "run_rank", "main"]


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
