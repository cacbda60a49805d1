"""The tensor-parallel seed workload's summaries: a row per rank, the runs side by side, and the
Markdown table RESULTS.md takes (benchmarks/alloc/tp_seed.py)."""

from __future__ import annotations

import datetime
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from alloc.units import MiB, fmt_mib  # noqa: E402
from benchmarks import harness  # noqa: E402

HEADLINE_TOKENS = 166_400
"""Where the guide reads the default allocator's growth (13.6 GiB on one H200)."""


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
        fmt_mib(s['workspace_min']) if s["workspace_min"] == s["workspace_max"]
        else f"{fmt_mib(s['workspace_min'])}-{fmt_mib(s['workspace_max'])}")
    if s["workspace_ok"] is False:
        ws += " FAIL"
    nccl_own = None if s["pg_outside"] is None else s["pg_outside"] + (s["allreduce_outside"] or 0)
    via = None if s["pg_allocator"] is None else s["pg_allocator"] + (s["allreduce_allocator"] or 0)
    return [s["allocator"], str(s["world_size"]), str(s["rank"]), fmt_mib(s["first_chunk"]),
            fmt_mib(s["at_headline"]), fmt_mib(s["peak"]), fmt_mib(s["loop_growth"]), ws,
            "-" if s["workspace_device_calls"] is None else str(s["workspace_device_calls"]),
            fmt_mib(nccl_own), fmt_mib(via), f"{s['steps_s']:.2f} ({s['first_step_s']:.2f})",
            f"{s['mlp_s']:.2f}",
            f"{s['indexer_s']:.2f}", f"{s['mlp_rel_err']:.2e}" + ("" if s["mlp_ok"] else " FAIL"),
            f"{s['index_min_agreement']:.4f}" + ("" if s["index_ok"] else " FAIL")]


def print_run(run: dict) -> None:
    harness.table(f"tp seed workload: allocator {run['allocator']}, {run['world_size']} rank(s), "
                  f"{run['backend']}", COLUMNS,
                  [summary_cells(rank_summary(run, r)) for r in run["ranks"]], width=200)
    print(f"indices identical across ranks: {run['indices_identical_across_ranks']}; "
          f"all-reduced MLP output identical across ranks: "
          f"{run['hidden_identical_across_ranks']}; run digest "
          f"{run['run_indices_sha256'][:16]}")


def _matches(comparison: dict) -> list[str]:
    """Per run: in how many chunks each rank's indices equal the reference run's."""
    return [f"{name}: indices equal to {comparison['reference']} in "
            + ", ".join(f"rank {p['rank']} {p['chunks_equal']}/{p['chunks']} chunks" for p in per)
            for name, per in comparison["matches"].items()]


def print_comparison(out: dict) -> None:
    rows = []
    for e in out["runs"]:
        if "run" not in e:
            rows.append([e["allocator"], str(e["world_size"]), "-", *["-"] * (len(COLUMNS) - 4),
                         f"exit {e['exit_status']}"])
            continue
        rows += [summary_cells(rank_summary(e["run"], r)) for r in e["run"]["ranks"]]
    harness.table(f"tp seed workload, every run side by side ({out['device']})", COLUMNS, rows, width=200)
    for line in _matches(out["comparison"]):
        print(line)
    for f in out["comparison"]["failed"]:
        print(f"failed: {f}")
    print("all checks passed" if out["ok"] else "some check failed")


def markdown(out: dict, argv: list[str]) -> str:
    lines = [f"Command: `python {shlex.join(argv)}`", "",
             f"Device: {out['device']}; date {datetime.date.today().isoformat()}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for e in out["runs"]:
        for r in e.get("run", {}).get("ranks", []):
            lines.append("| " + " | ".join(summary_cells(rank_summary(e["run"], r))) + " |")
    cmp_ = out["comparison"]
    lines.append("")
    lines += [f"- {line}" for line in _matches(cmp_)]
    lines.append(f"- all checks passed: {out['ok']}")
    return "\n".join(lines) + "\n"
