"""Pre-launch fit check: will a chunked prefill's indexer workspace fit in the memory available?

The seed workload is the sparse-attention indexer of a chunked prefill. Chunk i (``chunk_tokens``
query tokens, the last one shorter) sees ``seen`` tokens so far, itself included; its logits
workspace is float32 ``[rows, width]`` with ``width = cdiv(cdiv(seen, compress_ratio), 64) * 64``,
cut into pieces of at most ``budget // (width * 4)`` rows. Each piece is allocated, filled,
top-k'd and freed. PyTorch's default caching allocator cannot reuse a smaller cached block for the
next, larger piece, so it keeps one segment per distinct size: chunk i costs about 10.24 MB x i
until the pieces reach the budget, and the sum passes 13 GiB by chunk 52.

What the replay includes, decided from the H200 numbers (torch 2.11, 254,000 tokens, 3,200-token
chunks, compress ratio 4, 512 MiB; ``torch.cuda.memory_reserved``: 13,522 MiB at 166,400 tokens,
14,034 MiB at the end, 54 segments):

- the logits pieces: 52 segments of 12 to 508 MiB, then one of 512 MiB: 13,520 and 14,032 MiB;
  this alone is within 0.02% of the measurement;
- the per-chunk key bounds ``ks``/``ke`` (int32 ``[chunk_tokens]``): one 2 MiB small-pool
  segment; with it the model gives 13,522 / 14,034 MiB and 54 segments, the measurement exactly;
- the top-k output of each piece (int32 ``[rows, topk]``), while ``topk > 0``: it reserves one
  26 MiB segment more at the first chunk, and one at the second chunk instead of that chunk's
  20 MiB logits segment: +32 MiB, 13,554 / 14,066 MiB (+0.24% / +0.23%). The measured run evidently kept
  its top-k indices out of the allocator (as vLLM does, in a buffer made at start-up), so
  ``topk=0`` reproduces it to the MiB; the default ``topk=2048`` is the conservative gate.

Left out: the CUDA context, cuBLAS workspace and the like (about 90 MiB on the H200, outside the
allocator), and every tensor that lives across chunks (weights, KV cache): ``available`` means what
is left for this workload.

The arena column holds the budget from the first chunk, plus what the arena's general path holds
for the non-workspace allocations (bounds and top-k outputs), modelled with the same caching
allocator model: the C core's general pools use PyTorch's segment sizes (2 MiB small regions,
20 MiB under 10 MiB, 2 MiB multiples above).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass

from alloc.config import flag_value
from alloc.errors import ConfigError
from alloc.units import MiB

from .allocators import ALLOCATORS as TABLE
from .paths import unwritable
from .torch_model import CachingAllocatorModel, ModelOutOfMemory

LOGITS, TOPK, BOUNDS = "logits", "topk", "bounds"
ALLOCATORS = tuple(TABLE[n].name for n in ("default", "arena"))
"""The allocators the check models: PyTorch's caching allocator as it ships, and the arena."""

SEED = dict(max_model_len=262_144, chunk_tokens=3_200, compress_ratio=4, budget_mb=512,
            prompt_tokens=254_000)
"""The measured seed workload; max_model_len is any length that admits the prompt."""
MAX_CHUNKS = 20_000
"""The most chunks a check models: a 10-million-token prompt in 512-token chunks. The report is a
row per chunk, so a plan of more (1 token per chunk of a long prompt: millions) would run for hours
and print a table nobody reads; it is refused at once, naming the chunk size that fits. At the
bound the model takes seconds and the table a minute."""
MAX_PIECES = 1_000_000
"""The most logits pieces a check replays: the work itself, which the chunk bound does not bound (a
20,000-chunk plan whose budget holds one row per piece is 64 million pieces, hours of replay).
About five seconds of replay on a 2-core machine; a plan of more is refused at once."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def logits_width(seen: int, compress_ratio: int) -> int:
    """Columns of the logits workspace once ``seen`` tokens are in the batch."""
    return cdiv(cdiv(seen, compress_ratio), 64) * 64


# -- the workload -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Alloc:
    key: str  # unique in the workload; the matching Free names it
    nbytes: int
    kind: str  # LOGITS (the workspace), TOPK or BOUNDS

    @property
    def workspace(self) -> bool:
        return self.kind == LOGITS


@dataclass(frozen=True)
class Free:
    key: str


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk of the prefill and its allocation events, in program order."""
    index: int  # from 1
    start: int  # tokens before this chunk
    tokens: int
    width: int
    rows_per_piece: int
    pieces: tuple[int, ...]  # rows of each piece
    events: tuple[Alloc | Free, ...]

    @property
    def seen(self) -> int:
        return self.start + self.tokens

    @property
    def piece_bytes(self) -> int:
        """The largest logits piece of the chunk (the first)."""
        return self.pieces[0] * self.width * 4

    @property
    def label(self) -> str:
        return f"chunk {self.index} ({self.seen:,} tokens)"


def _check_int(name: str, value: object, minimum: int, accepted: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(name, value, accepted, reason="not an integer")
    if value < minimum:
        raise ConfigError(name, value, accepted, reason=f"below {minimum}")


def seed_workload(prompt_tokens: int, chunk_tokens: int, compress_ratio: int, budget_bytes: int,
                  topk: int = 2048) -> Iterator[ChunkPlan]:
    """The chunks of the indexer's prefill of one prompt, each with its allocation events.

    Per chunk: ``ks`` and ``ke`` (int32 ``[tokens]``, the key range of each query) for the whole
    chunk; per piece the logits (float32 ``[rows, width]``) and, with ``topk > 0``, the top-k
    indices (int32 ``[rows, topk]``), the logits freed once the top-k is taken, the indices once
    consumed. ``topk=0`` stands for indices written into a buffer allocated once, outside.
    """
    _check_int("prompt_tokens", prompt_tokens, 1, "a positive number of tokens")
    _check_int("chunk_tokens", chunk_tokens, 1, "a positive number of tokens")
    _check_int("compress_ratio", compress_ratio, 1, "a positive integer")
    _check_int("budget_bytes", budget_bytes, 1, "a positive number of bytes")
    _check_int("topk", topk, 0, "a non-negative number of keys per query (0: no per-piece output)")
    row = logits_width(prompt_tokens, compress_ratio) * 4
    if budget_bytes < row:
        raise ConfigError("budget_bytes", budget_bytes, f"at least {row} bytes",
                          reason=f"one row of the logits of {prompt_tokens:,} tokens takes {row}")
    return _chunks(prompt_tokens, chunk_tokens, compress_ratio, budget_bytes, topk)


def _chunks(prompt_tokens: int, chunk_tokens: int, compress_ratio: int, budget_bytes: int,
            topk: int) -> Iterator[ChunkPlan]:
    start, index = 0, 0
    while start < prompt_tokens:
        index += 1
        tokens = min(chunk_tokens, prompt_tokens - start)
        width = logits_width(start + tokens, compress_ratio)
        per_piece = budget_bytes // (width * 4)
        pieces = tuple(min(per_piece, tokens - first) for first in range(0, tokens, per_piece))
        c = f"c{index}"
        events: list[Alloc | Free] = [Alloc(f"{c}.ks", tokens * 4, BOUNDS),
                                      Alloc(f"{c}.ke", tokens * 4, BOUNDS)]
        for p, rows in enumerate(pieces):
            logits = Alloc(f"{c}.p{p}.logits", rows * width * 4, LOGITS)
            events.append(logits)
            if topk:
                out = Alloc(f"{c}.p{p}.topk", rows * topk * 4, TOPK)
                events += [out, Free(logits.key), Free(out.key)]
            else:
                events.append(Free(logits.key))
        events += [Free(f"{c}.ks"), Free(f"{c}.ke")]
        yield ChunkPlan(index, start, tokens, width, per_piece, pieces, tuple(events))
        start += tokens


def replay(model: CachingAllocatorModel, chunks: Iterable[ChunkPlan], *,
           workspace: bool = True, general: bool = True) -> list[int]:
    """Runs the chunks' events through ``model``; returns each chunk's peak reserved bytes.

    ``workspace``/``general`` select the logits and the other allocations. A ModelOutOfMemory
    propagates with ``chunk`` set to the chunk index and the chunk named in its message.
    """
    peaks = []
    for plan in chunks:
        live: dict[str, int] = {}
        peak = model.reserved
        for event in plan.events:
            if isinstance(event, Alloc):
                if not (workspace if event.workspace else general):
                    continue
                try:
                    live[event.key] = model.malloc(event.nbytes, f"{plan.label}, {event.key}")
                except ModelOutOfMemory as e:
                    e.chunk = plan.index
                    raise
                peak = max(peak, model.reserved)
            elif event.key in live:
                model.free(live.pop(event.key))
        peaks.append(peak)
    return peaks


# -- the report -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkRow:
    chunk: int
    tokens: int  # seen once this chunk is done
    chunk_tokens: int
    width: int
    rows_per_piece: int
    pieces: int
    piece_bytes: int  # the largest logits piece
    default_bytes: int  # default caching allocator: peak reserved during the chunk
    default_segments: int
    arena_bytes: int  # the arena: budget + what its general path holds


@dataclass(frozen=True)
class FitReport:
    max_model_len: int
    chunk_tokens: int
    compress_ratio: int
    budget_bytes: int
    prompt_tokens: int
    topk: int
    available_bytes: int
    available_source: str
    allocator: str  # the allocator the verdict is for
    rows: tuple[ChunkRow, ...]
    default_crossing: int | None  # first chunk whose default_bytes exceed the available memory
    arena_crossing: int | None

    @property
    def default_peak(self) -> int:
        return max(r.default_bytes for r in self.rows)

    @property
    def arena_peak(self) -> int:
        return max(r.arena_bytes for r in self.rows)

    @property
    def fits(self) -> bool:
        return (self.default_crossing if self.allocator == "default" else self.arena_crossing) is None

    def row(self, chunk: int) -> ChunkRow:
        return self.rows[chunk - 1]

    def row_at(self, tokens: int) -> ChunkRow:
        """The chunk that processes token number ``tokens`` (counting from 1)."""
        for r in self.rows:
            if r.tokens >= tokens:
                return r
        raise ValueError(f"tokens={tokens} is past the prompt of {self.prompt_tokens} tokens")

    def to_dict(self) -> dict:
        def crossing(chunk: int | None) -> dict:
            return {"first_crossing_chunk": chunk,
                    "first_crossing_tokens": None if chunk is None else self.row(chunk).tokens}
        return {
            "workload": {"max_model_len": self.max_model_len, "chunk_tokens": self.chunk_tokens,
                         "compress_ratio": self.compress_ratio, "budget_bytes": self.budget_bytes,
                         "prompt_tokens": self.prompt_tokens, "topk": self.topk},
            "available_bytes": self.available_bytes,
            "available_source": self.available_source,
            "allocator": self.allocator,
            "fits": self.fits,
            "default": {"peak_bytes": self.default_peak,
                        "peak_segments": max(r.default_segments for r in self.rows),
                        **crossing(self.default_crossing)},
            "arena": {"workspace_bytes": self.budget_bytes,
                      "general_peak_bytes": self.arena_peak - self.budget_bytes,
                      "peak_bytes": self.arena_peak, **crossing(self.arena_crossing)},
            "chunks": [asdict(r) for r in self.rows],
        }


def count_pieces(prompt_tokens: int, chunk_tokens: int, compress_ratio: int, budget_bytes: int) -> int:
    """The logits pieces of the prefill, counted a chunk at a time (as ``_chunks`` cuts them)."""
    total, start = 0, 0
    while start < prompt_tokens:
        tokens = min(chunk_tokens, prompt_tokens - start)
        per_piece = budget_bytes // (logits_width(start + tokens, compress_ratio) * 4)
        total += cdiv(tokens, max(per_piece, 1))
        start += tokens
    return total


def _check_pieces(prompt_tokens: int, chunk_tokens: int, compress_ratio: int, budget_bytes: int) -> None:
    pieces = count_pieces(prompt_tokens, chunk_tokens, compress_ratio, budget_bytes)
    if pieces > MAX_PIECES:
        raise ConfigError("budget_mb", budget_bytes // MiB,
                          "a larger budget (fewer rows to a piece) or a shorter prompt",
                          reason=f"the prefill cuts into {pieces:,} logits pieces, more than the "
                                 f"{MAX_PIECES:,} a fit check replays")


def _available_from_host() -> tuple[int, str]:
    try:
        from alloc.hostmem import available_bytes
    except ImportError as e:
        raise RuntimeError("cannot read this machine's available memory (alloc.hostmem: "
                           f"{e}); pass available_bytes (--available-mb)") from None
    try:
        return int(available_bytes()), "this machine (alloc.hostmem.available_bytes)"
    except (OSError, RuntimeError) as e:  # BackendError is a RuntimeError
        raise RuntimeError(f"cannot read this machine's available memory: {e}; pass "
                           "available_bytes (--available-mb)") from None


def fit(max_model_len: int, chunk_tokens: int, compress_ratio: int, budget_mb: int,
        prompt_tokens: int, available_bytes: int | None = None, *, topk: int = 2048,
        allocator: str = "default") -> FitReport:
    """Replays the prefill of ``prompt_tokens`` through a model of PyTorch's default caching
    allocator and through the arena, against ``available_bytes`` (None: read from this machine).

    The verdict (``FitReport.fits``) is for ``allocator``: 'default' fits when the default
    allocator never holds more than is available, 'arena' when the arena never does.
    """
    _check_int("max_model_len", max_model_len, 1, "a positive number of tokens")
    _check_int("chunk_tokens", chunk_tokens, 1, "a positive number of tokens")
    _check_int("compress_ratio", compress_ratio, 1, "a positive integer")
    _check_int("budget_mb", budget_mb, 1, "a positive integer number of MiB")
    _check_int("prompt_tokens", prompt_tokens, 1,
               f"a positive number of tokens no larger than max_model_len ({max_model_len:,})")
    if prompt_tokens > max_model_len:
        raise ConfigError("prompt_tokens", prompt_tokens,
                          f"a positive number of tokens no larger than max_model_len "
                          f"({max_model_len:,})", reason="longer than max_model_len")
    _check_int("topk", topk, 0, "a non-negative number of keys per query (0: no per-piece output)")
    if cdiv(prompt_tokens, chunk_tokens) > MAX_CHUNKS:
        raise ConfigError("chunk_tokens", chunk_tokens,
                          f"at least {cdiv(prompt_tokens, MAX_CHUNKS):,} tokens for a {prompt_tokens:,}-token prompt",
                          reason=f"{cdiv(prompt_tokens, chunk_tokens):,} chunks, more than the {MAX_CHUNKS:,} "
                                 "a fit check models")
    if allocator not in ALLOCATORS:
        raise ConfigError("allocator", allocator, " or ".join(map(repr, ALLOCATORS)))
    row = logits_width(max_model_len, compress_ratio) * 4
    if budget_mb * MiB < row:
        raise ConfigError("budget_mb", budget_mb, f"at least {cdiv(row, MiB)} MiB",
                          reason=f"one row of the logits at max_model_len ({max_model_len:,} "
                                 f"tokens, compress ratio {compress_ratio}) takes {row:,} bytes")
    _check_pieces(prompt_tokens, chunk_tokens, compress_ratio, budget_mb * MiB)
    if available_bytes is None:
        available_bytes, source = _available_from_host()
    else:
        _check_int("available_bytes", available_bytes, 1, "a positive number of bytes")
        source = "given"

    budget = budget_mb * MiB
    default, general = CachingAllocatorModel(), CachingAllocatorModel()
    rows = []
    for plan in seed_workload(prompt_tokens, chunk_tokens, compress_ratio, budget, topk):
        [default_peak] = replay(default, [plan])
        [general_peak] = replay(general, [plan], workspace=False)
        rows.append(ChunkRow(plan.index, plan.seen, plan.tokens, plan.width, plan.rows_per_piece,
                             len(plan.pieces), plan.piece_bytes, default_peak,
                             default.num_segments, budget + general_peak))

    def first(over) -> int | None:
        return next((r.chunk for r in rows if over(r) > available_bytes), None)

    return FitReport(max_model_len, chunk_tokens, compress_ratio, budget, prompt_tokens, topk,
                     available_bytes, source, allocator, tuple(rows),
                     first(lambda r: r.default_bytes), first(lambda r: r.arena_bytes))


# -- output -----------------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


def _where(report: FitReport, chunk: int | None) -> str:
    if chunk is None:
        return "never crosses the available memory"
    return f"first crosses the available memory at chunk {chunk} ({report.row(chunk).tokens:,} tokens)"


def print_table(report: FitReport, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    file = file or sys.stdout
    # Off a terminal rich assumes 80 columns, which folds the table; a terminal keeps its own.
    console = Console(file=file, width=None if file.isatty() else 120)
    table = Table(title=f"fit: {report.prompt_tokens:,}-token prompt in "
                        f"{report.chunk_tokens:,}-token chunks, compress ratio "
                        f"{report.compress_ratio}, budget {_mib(report.budget_bytes)}, "
                        f"available {_mib(report.available_bytes)}")
    for name in ("chunk", "tokens", "width", "rows/piece", "pieces", "logits piece",
                 "default holds", "arena holds", "crossing"):
        table.add_column(name, justify="left" if name == "crossing" else "right")
    for r in report.rows:
        over = r.default_bytes > report.available_bytes
        note = "default crosses" if r.chunk == report.default_crossing else ""
        if r.chunk == report.arena_crossing:
            note = (note + ", " if note else "") + "arena crosses"
        table.add_row(str(r.chunk), f"{r.tokens:,}", f"{r.width:,}", f"{r.rows_per_piece:,}",
                      str(r.pieces), _mib(r.piece_bytes), _mib(r.default_bytes),
                      _mib(r.arena_bytes), note, style="red" if over else None)
    console.print(table)
    general = report.arena_peak - report.budget_bytes
    segments = max(r.default_segments for r in report.rows)
    for line in (
            f"available: {_mib(report.available_bytes)} ({report.available_source})",
            f"default caching allocator: peak {_mib(report.default_peak)} in "
            f"{segments} segment{'' if segments == 1 else 's'}; "
            f"{_where(report, report.default_crossing)}",
            f"arena: {_mib(report.budget_bytes)} workspace + {_mib(general)} general path "
            f"({'top-k outputs, ' if report.topk else ''}bounds) = {_mib(report.arena_peak)}; "
            f"{_where(report, report.arena_crossing)}",
            f"verdict for the {report.allocator} allocator: "
            + ("[green]FITS[/green]" if report.fits else "[red]DOES NOT FIT[/red]")):
        console.print(line, soft_wrap=True)  # whole lines, so that they can be grepped


def write_plot(report: FitReport, path: str) -> None:
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


# -- command line -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m arena_tools fit",
        description="Pre-launch fit check of the indexer's chunked prefill: per chunk, the logits "
                    "piece, what PyTorch's default caching allocator would hold, what the arena "
                    "holds, and where the default would cross the available memory. Exit status: "
                    "0 fits, 1 does not fit, 2 bad arguments.")
    p.add_argument("--max-model-len", type=int, default=SEED["max_model_len"], metavar="TOKENS")
    p.add_argument("--chunk-tokens", type=int, default=SEED["chunk_tokens"], metavar="TOKENS",
                   help=f"tokens per chunk; the prompt may take at most {MAX_CHUNKS:,} chunks")
    p.add_argument("--compress-ratio", type=int, default=SEED["compress_ratio"], metavar="N")
    p.add_argument("--budget-mb", type=int, default=None, metavar="MIB",
                   help="workspace budget (default: budget_mb of INDEXER_ARENA_CONF, as the "
                        "allocator would take it; 512 without one)")
    p.add_argument("--prompt-tokens", type=int, default=SEED["prompt_tokens"], metavar="TOKENS")
    p.add_argument("--available-mb", type=float, default=None, metavar="MIB",
                   help="memory available to this workload (default: read from this machine)")
    p.add_argument("--topk", type=int, default=2048, metavar="K",
                   help="per-piece top-k output width; 0 when the indices go to a buffer made "
                        "once (as in the measured run) (default: 2048)")
    p.add_argument("--allocator", choices=ALLOCATORS, default="default",
                   help="the allocator the verdict and exit status are for (default: default)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE", help="write memory against tokens as a PNG")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 0 for --help and 2 for its own errors
        return 0 if e.code in (0, None) else 2
    from alloc.config import from_env
    try:  # as the allocator would take it: the flag, else the configuration
        args.budget_mb = flag_value("budget_mb", "--budget-mb", args.budget_mb) or from_env().budget_mb
    except ValueError as e:  # ConfigError too
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.plot and unwritable(args.plot, "--plot"):
        print(f"{parser.prog}: error: {unwritable(args.plot, '--plot')}", file=sys.stderr)
        return 2
    available = None
    if args.available_mb is not None:
        if not 0 < args.available_mb < float(1 << 44):  # a finite number of MiB the byte count can hold
            parser.print_usage(sys.stderr)
            print(f"{parser.prog}: error: --available-mb must be a positive number of MiB, got "
                  f"{args.available_mb}", file=sys.stderr)
            return 2
        available = max(1, round(args.available_mb * MiB))
    try:
        report = fit(args.max_model_len, args.chunk_tokens, args.compress_ratio, args.budget_mb,
                     args.prompt_tokens, available, topk=args.topk, allocator=args.allocator)
    except (ValueError, RuntimeError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            write_plot(report, args.plot)
        except OSError as e:
            print(f"{parser.prog}: error: cannot write the plot to {args.plot!r}: {e}",
                  file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print_table(report)
    if args.plot:
        print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
