"""PyTorch's memory tools on the seed workload, under PyTorch's allocator and under the process
scope: each runs the workload in a fresh process with torch.cuda.memory._record_memory_history()
on and dumps its snapshot; then, for each, torch.cuda._memory_viz draws its trace plot (HTML, to
open in a browser) and this program draws the two side by side in one picture: the bytes each
allocator holds (its segments) and the bytes in live tensors, event by event, from the snapshots'
own traces.

    python examples/memory_viz.py DIR [--prompt-tokens N] [--max-entries N]   # on a GPU
    python examples/memory_viz.py DIR --render                                # from DIR's snapshots

Writes DIR/<allocator>.pickle (with a GPU), DIR/<allocator>.html and DIR/memory_viz.png;
examples/memory_viz/ holds those of an H200 at --prompt-tokens 166400 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alloc.units import MiB, fmt_mib  # noqa: E402
from arena_tools.paths import unwritable  # noqa: E402

ALLOCATORS = {"default": "PyTorch's allocator", "arena": "indexer-arena, process scope"}


def record(args) -> None:
    """In a child: the workload under one allocator with history on, its snapshot dumped."""
    import torch

    import alloc
    from arena_tools.fit import seed_workload
    if args.worker == "arena":
        alloc.install(alloc.Config(budget_mb=512))
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for plan in seed_workload(args.prompt_tokens, 3200, 4, 512 * MiB, topk=0):
        for rows in plan.pieces:
            with alloc.workspace() if args.worker == "arena" else contextlib.nullcontext():
                logits = torch.empty(rows, plan.width, dtype=torch.float32, device="cuda")
            logits.uniform_(generator=gen)
            torch.topk(logits, min(2048, plan.width), dim=1, sorted=False)
            del logits
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(str(Path(args.dir) / f"{args.worker}.pickle"))


def held_over_time(snapshot: dict) -> tuple[list[int], list[int]]:
    """Bytes in segments and bytes in live blocks after each trace event of device 0."""
    reserved = live = 0
    # the trace starts with the recording; what was held before it is in neither count
    held, used = [], []
    for e in snapshot["device_traces"][0]:
        action, size = e["action"], e["size"]
        if action in ("segment_alloc", "segment_map"):
            reserved += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        elif action == "alloc":
            live += size
        elif action == "free_completed":
            live -= size
        held.append(reserved)
        used.append(live)
    return held, used


def render(out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torch.cuda import _memory_viz

    fig, axes = plt.subplots(1, len(ALLOCATORS), figsize=(12, 4), sharey=True)
    for ax, (name, title) in zip(axes, ALLOCATORS.items()):
        with open(out / f"{name}.pickle", "rb") as f:
            snapshot = pickle.load(f)
        (out / f"{name}.html").write_text(_memory_viz.trace_plot(snapshot))
        held, used = held_over_time(snapshot)
        ax.plot([h / MiB for h in held], label="held by the allocator (segments)")
        ax.plot([u / MiB for u in used], label="in live tensors")
        ax.set_title(f"{title}: peak held {fmt_mib(max(held, default=0))} MiB")
        ax.set_xlabel("allocator event")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MiB")
    axes[0].legend(loc="upper left")
    fig.suptitle("the seed workload's logits pieces, as torch.cuda.memory._snapshot() traces them")
    fig.tight_layout()
    fig.savefig(out / "memory_viz.png", dpi=110)
    print(f"wrote {out / 'memory_viz.png'} and the trace plots {', '.join(f'{n}.html' for n in ALLOCATORS)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="where the snapshots, trace plots and picture go")
    p.add_argument("--prompt-tokens", type=int, default=254_000)
    p.add_argument("--max-entries", type=int, default=20_000, help="trace events each snapshot keeps")
    p.add_argument("--render", action="store_true", help="only draw, from the snapshots already in DIR")
    p.add_argument("--worker", choices=list(ALLOCATORS), help=argparse.SUPPRESS)
    args = p.parse_args()
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    why = unwritable(str(out / "memory_viz.png"), "DIR")
    if why:
        p.error(why)
    if args.worker:
        record(args)
        return 0
    if not args.render:
        for name in ALLOCATORS:  # fresh processes: the allocator is chosen before CUDA starts
            subprocess.run([sys.executable, __file__, str(out), "--worker", name, "--prompt-tokens",
                            str(args.prompt_tokens), "--max-entries", str(args.max_entries)], check=True)
    missing = [n for n in ALLOCATORS if not (out / f"{n}.pickle").exists()]
    if missing:
        p.error(f"no snapshot of {', '.join(missing)} in {out}: run without --render on a GPU first")
    render(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
