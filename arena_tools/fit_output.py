"""arena_tools.fit's output: the per-chunk table, the summary lines with both verdicts, the plot."""

from __future__ import annotations

import sys

from alloc.units import MiB
from alloc.units import fmt_mib_text as _mib

from .allocators import ALLOCATORS as TABLE
from .textout import Console, Table, terminal_columns

ALLOCATORS = tuple(TABLE[n].name for n in ("default", "arena"))


def _where(report, chunk: int | None) -> str:
    if chunk is None:
        return "never crosses the available memory"
    if not report.row(chunk).chunk_tokens:
        return "first crosses the available memory at the decode step after the prefill"
    return f"first crosses the available memory at chunk {chunk} ({report.row(chunk).tokens:,} tokens)"


def summary_lines(report) -> list[str]:
    """The story in a few whole lines (each can be grepped): where the memory comes from, what
    each allocator holds at its peak, both verdicts, and which one the exit status follows."""
    m = report.memory
    lines = [f"available to the workspace: {_mib(report.available_bytes)} ({report.available_source})"]
    if m.get("device_bytes"):
        lines.append(f"  = {_mib(m['device_bytes'])} ({m.get('device_source', 'the device')}) - "
                     f"{_mib(m['weights_bytes_per_gpu'])} weights - {_mib(m['kv_cache_bytes_per_gpu'])} "
                     f"KV cache a GPU (tensor parallel {m['tensor_parallel_size']}; KV cache: "
                     f"{m['kv_cache_sized_by']}, --gpu-memory-utilization {m['gpu_memory_utilization']:g})")
    general = report.arena_peak - report.budget_bytes
    segments = max(r.default_segments for r in report.steps)
    decode = report.decode
    if decode:
        lines.append(f"decode step: {decode.rows_per_piece:,} sequences x {decode.width:,} tokens of "
                     f"float32 logits = {_mib(decode.piece_bytes)}"
                     + ("" if decode.piece_bytes <= report.budget_bytes else
                        ", larger than the budget: served outside the arena"))
    lines += [
        f"default caching allocator: peak {_mib(report.default_peak)} in {segments} "
        f"segment{'' if segments == 1 else 's'}; {_where(report, report.default_crossing)}",
        f"arena: {_mib(report.budget_bytes)} workspace + {_mib(general)} general path "
        f"({'top-k outputs, ' if report.topk else ''}bounds) = {_mib(report.arena_peak)}; "
        f"{_where(report, report.arena_crossing)}"]
    for allocator in ALLOCATORS:
        lines.append(f"verdict for the {allocator} allocator: "
                     + ("[green]FITS[/green]" if report.fits_with(allocator) else "[red]DOES NOT FIT[/red]"))
    lines.append(f"exit status {0 if report.fits else 1}: the {report.allocator} allocator's verdict "
                 "(--allocator; 0 fits, 1 does not fit, 2 bad arguments)")
    return lines


def print_table(report, file=None, *, table: bool = True) -> None:
    file = file or sys.stdout
    console = Console(file=file, width=terminal_columns(120) if file is sys.stdout else 120)
    if table:
        t = Table(title=f"fit: {report.prompt_tokens:,}-token prompt in "
                        f"{report.chunk_tokens:,}-token chunks, compress ratio "
                        f"{report.compress_ratio}, budget {_mib(report.budget_bytes)}, "
                        f"available {_mib(report.available_bytes)}")
        for name in ("chunk", "tokens", "width", "rows/piece", "pieces", "logits piece",
                     "default holds", "arena holds", "crossing"):
            t.add_column(name, justify="left" if name == "crossing" else "right")
        for r in report.steps:
            over = r.default_bytes > report.available_bytes
            note = "default crosses" if r.chunk == report.default_crossing else ""
            if r.chunk == report.arena_crossing:
                note = (note + ", " if note else "") + "arena crosses"
            t.add_row("decode" if not r.chunk_tokens else str(r.chunk), f"{r.tokens:,}",
                      f"{r.width:,}", f"{r.rows_per_piece:,}", str(r.pieces), _mib(r.piece_bytes),
                      _mib(r.default_bytes), _mib(r.arena_bytes), note, style="red" if over else None)
        console.print(t)
    for line in summary_lines(report):
        console.print(line, soft_wrap=True)  # whole lines, so that they can be grepped


def write_plot(report, path: str) -> None:
    """Memory against tokens for both allocators, with the available memory, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import StrMethodFormatter

    # Each chunk's peak holds from its first token to its last: steps drawn on chunk ends.
    x = [0] + [r.tokens for r in report.rows]
    default = [r.default_bytes / MiB for r in report.rows]
    arena = [r.arena_bytes / MiB for r in report.rows]
    fig = Figure(figsize=(9, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.step(x, default[:1] + default, where="pre", label="PyTorch default caching allocator")
    ax.step(x, arena[:1] + arena, where="pre", label="indexer-arena (budget + general path)")
    ax.axhline(report.available_bytes / MiB, color="red", linestyle="--",
               label=f"available ({_mib(report.available_bytes)})")
    if report.default_crossing is not None:
        row = report.row(report.default_crossing)
        ax.axvline(row.tokens, color="red", linestyle=":", linewidth=1)
        ax.annotate(f"default crosses at chunk {row.chunk}\n({row.tokens:,} tokens)",
                    (row.tokens, report.available_bytes / MiB), textcoords="offset points",
                    xytext=(-10, 10), ha="right")
    ax.set_xlabel("prompt tokens processed")
    ax.set_ylabel("memory held (MiB)")
    ax.set_title(f"{report.chunk_tokens:,}-token chunks, compress ratio {report.compress_ratio}, "
                 f"budget {_mib(report.budget_bytes)}, top-k {report.topk}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Title": "indexer-arena fit"})
