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
import importlib.util
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

from alloc.config import flag_value
from alloc.errors import ConfigError
from alloc.units import MiB

from . import prog
from .fit_output import ALLOCATORS, print_table, summary_lines, write_plot  # noqa: F401 (fit's API)
from .paths import unwritable
from .serving import byte_count, cdiv, device_memory, model_from_config, serving_available
from .serving import check_int as _check_int
from .textout import Ticker
from .torch_model import CachingAllocatorModel, ModelOutOfMemory

LOGITS, TOPK, BOUNDS, OUTSIDE = "logits", "topk", "bounds", "outside"

SEED = dict(max_model_len=262_144, chunk_tokens=3_200, compress_ratio=4, budget_mb=512,
            prompt_tokens=254_000)
"""The measured seed workload; max_model_len is any length that admits the prompt."""
DEFAULT_MAX_NUM_SEQS = 256
"""vLLM's --max-num-seqs default: the decode step's sequences, each row max_model_len wide."""
MAX_CHUNKS = 20_000
"""The most chunks a check models: a 10-million-token prompt in 512-token chunks. The report is a
row per chunk, so a plan of more (1 token per chunk of a long prompt: millions) would run for hours
and print a table nobody reads; it is refused at once, naming the chunk size that fits. At the
bound the model takes seconds and the table a minute."""
MAX_PIECES = 1_000_000
"""The most logits pieces a check replays: the work itself, which the chunk bound does not bound (a
20,000-chunk plan whose budget holds one row per piece is 64 million pieces, hours of replay).
About five seconds of replay on a 2-core machine; a plan of more is refused at once."""


def logits_width(seen: int, compress_ratio: int) -> int:
    """Columns of the logits workspace once ``seen`` tokens are in the batch."""
    return cdiv(cdiv(seen, compress_ratio), 64) * 64


# -- the workload -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Alloc:
    key: str  # unique in the workload; the matching Free names it
    nbytes: int
    kind: str  # LOGITS (the workspace), TOPK, BOUNDS or OUTSIDE (logits larger than the budget)

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
        if not self.tokens:
            return f"decode step ({self.pieces[0]:,} sequences)"
        return f"chunk {self.index} ({self.seen:,} tokens)"


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


def decode_step(prompt_tokens: int, max_model_len: int, max_num_seqs: int, budget_bytes: int,
                index: int) -> ChunkPlan:
    """One decode step of ``max_num_seqs`` sequences after the prefill: DeepGEMM's paged logits,
    float32 ``[max_num_seqs, max_model_len]`` in one piece (alloc/engines.py's
    ``paged_logits_bytes``): inside the workspace when the budget holds it, else served outside
    the arena by the engine's allocator, as the plugin does."""
    nbytes = max_num_seqs * max_model_len * 4
    logits = Alloc("decode.logits", nbytes, LOGITS if nbytes <= budget_bytes else OUTSIDE)
    return ChunkPlan(index, prompt_tokens, 0, max_model_len, max_num_seqs, (max_num_seqs,),
                     (logits, Free(logits.key)))


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
    chunk_tokens: int  # 0: the decode step
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
    allocator: str  # the allocator the verdict (and the exit status) is for
    rows: tuple[ChunkRow, ...]  # the prefill's chunks
    default_crossing: int | None  # first chunk whose default_bytes exceed the available memory
    arena_crossing: int | None
    decode: ChunkRow | None = None  # the decode step after the prefill (max_num_seqs rows)
    memory: dict = field(default_factory=dict)  # how the available memory was worked out

    @property
    def steps(self) -> tuple[ChunkRow, ...]:
        """The prefill's chunks, then the decode step."""
        return self.rows + ((self.decode,) if self.decode else ())

    @property
    def default_peak(self) -> int:
        return max(r.default_bytes for r in self.steps)

    @property
    def arena_peak(self) -> int:
        return max(r.arena_bytes for r in self.steps)

    def fits_with(self, allocator: str) -> bool:
        return (self.default_crossing if allocator == "default" else self.arena_crossing) is None

    @property
    def fits(self) -> bool:
        return self.fits_with(self.allocator)

    def row(self, chunk: int) -> ChunkRow:
        return self.steps[chunk - 1]

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
                         "prompt_tokens": self.prompt_tokens, "topk": self.topk,
                         "max_num_seqs": self.decode.rows_per_piece if self.decode else 0},
            "available_bytes": self.available_bytes,
            "available_source": self.available_source,
            "memory": self.memory,
            "allocator": self.allocator,
            "fits": self.fits,
            "default": {"fits": self.fits_with("default"), "peak_bytes": self.default_peak,
                        "peak_segments": max(r.default_segments for r in self.steps),
                        **crossing(self.default_crossing)},
            "arena": {"fits": self.fits_with("arena"), "workspace_bytes": self.budget_bytes,
                      "general_peak_bytes": self.arena_peak - self.budget_bytes,
                      "peak_bytes": self.arena_peak, **crossing(self.arena_crossing)},
            "chunks": [asdict(r) for r in self.rows],
            "decode": asdict(self.decode) if self.decode else None,
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


def _check_arguments(max_model_len: int, chunk_tokens: int, compress_ratio: int, budget_mb: int,
                     prompt_tokens: int, topk: int, max_num_seqs: int, allocator: str) -> None:
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
    _check_int("max_num_seqs", max_num_seqs, 0, "a non-negative number of sequences (0: no decode step)")
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


def fit(max_model_len: int, chunk_tokens: int, compress_ratio: int, budget_mb: int,
        prompt_tokens: int, available_bytes: int | None = None, *, topk: int = 2048,
        allocator: str = "default", max_num_seqs: int = 0, memory: dict | None = None,
        progress: bool = False) -> FitReport:
    """Replays the prefill of ``prompt_tokens`` (and, with ``max_num_seqs``, one decode step of
    that many sequences) through a model of PyTorch's default caching allocator and through the
    arena, against ``available_bytes`` (None: this device's memory, see ``device_memory``).

    The verdict (``FitReport.fits``) is for ``allocator``: 'default' fits when the default
    allocator never holds more than is available, 'arena' when the arena never does; both are in
    the report (``fits_with``). ``memory`` is kept in the report: how ``available_bytes`` was found.
    """
    _check_arguments(max_model_len, chunk_tokens, compress_ratio, budget_mb, prompt_tokens, topk,
                     max_num_seqs, allocator)
    if available_bytes is None:
        available_bytes, source = device_memory()
    else:
        _check_int("available_bytes", available_bytes, 1, "a positive number of bytes")
        source = "given"
    budget = budget_mb * MiB
    plans = seed_workload(prompt_tokens, chunk_tokens, compress_ratio, budget, topk)
    rows = _replay_rows(plans, budget, cdiv(prompt_tokens, chunk_tokens), progress,
                        lambda n: decode_step(prompt_tokens, max_model_len, max_num_seqs, budget, n)
                        if max_num_seqs else None)
    decode = rows.pop() if max_num_seqs else None

    def first(over) -> int | None:
        steps = rows + ([decode] if decode else [])
        return next((r.chunk for r in steps if over(r) > available_bytes), None)

    return FitReport(max_model_len, chunk_tokens, compress_ratio, budget, prompt_tokens, topk,
                     available_bytes, source, allocator, tuple(rows),
                     first(lambda r: r.default_bytes), first(lambda r: r.arena_bytes), decode,
                     dict(memory or {}))


def _replay_rows(plans: Iterable[ChunkPlan], budget: int, chunks: int, progress: bool,
                 decode) -> list[ChunkRow]:
    """A row per chunk (and the decode step last, when ``decode(index)`` makes one)."""
    default, general = CachingAllocatorModel(), CachingAllocatorModel()
    ticker = Ticker("fit: replaying chunk", chunks) if progress else None
    rows = []

    def add(plan: ChunkPlan) -> None:
        [default_peak] = replay(default, [plan])
        [general_peak] = replay(general, [plan], workspace=False)
        rows.append(ChunkRow(plan.index, plan.seen, plan.tokens, plan.width, plan.rows_per_piece,
                             len(plan.pieces), plan.piece_bytes, default_peak,
                             default.num_segments, budget + general_peak))
    for plan in plans:
        add(plan)
        if ticker:
            ticker.update(plan.index)
    if ticker:
        ticker.close()
    step = decode(len(rows) + 1)
    if step is not None:
        add(step)
    return rows


# -- command line -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog("fit"),
        description="Pre-launch fit check of a serving configuration's sparse-attention indexer: "
                    "the chunked prefill of one prompt and a decode step, per chunk the logits piece, "
                    "what PyTorch's default caching allocator would hold and what the arena holds, "
                    "against the memory the engine leaves (flags named as vLLM's). Exit status: "
                    "0 fits, 1 does not fit, 2 bad arguments; the verdict is --allocator's.")
    g = p.add_argument_group("the workload (vLLM's flags where they mean the same)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help=f"longest sequence (default: the model config's max_position_embeddings "
                        f"with --model, else the seed's {SEED['prompt_tokens']:,})")
    g.add_argument("--prompt-tokens", type=int, default=None, metavar="TOKENS",
                   help="the prompt whose prefill is checked (default: --max-model-len)")
    g.add_argument("--max-num-batched-tokens", "--chunk-tokens", dest="chunk_tokens", type=int,
                   default=SEED["chunk_tokens"], metavar="TOKENS",
                   help=f"tokens per prefill chunk (default {SEED['chunk_tokens']:,}); "
                        f"at most {MAX_CHUNKS:,} chunks and {MAX_PIECES:,} logits pieces")
    g.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, metavar="N",
                   help="sequences in the decode step, whose logits are [N, max-model-len] "
                        f"float32 (default {DEFAULT_MAX_NUM_SEQS}, vLLM's; 0: no decode step)")
    g.add_argument("--compress-ratio", type=int, default=SEED["compress_ratio"], metavar="N")
    g.add_argument("--budget-mb", type=int, default=None, metavar="MIB",
                   help="workspace budget (default: budget_mb of INDEXER_ARENA_CONF, as the "
                        "allocator would take it; 512 without one)")
    g.add_argument("--topk", type=int, default=2048, metavar="K",
                   help="per-piece top-k output width; 0 when the indices go to a buffer made "
                        "once, as vLLM does (default: 2048, the conservative gate)")
    m = p.add_argument_group("the memory")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of the device's memory the engine takes (default 0.9, vLLM's)")
    m.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="GPUs the weights and KV cache are split over (default 1)")
    m.add_argument("--model", metavar="DIR", help="a model directory (or its config.json): weights "
                   "and KV cache per token read from it")
    m.add_argument("--weights-gib", type=float, default=None, metavar="GIB",
                   help="the model's weights, all GPUs together (default: from --model, else 0)")
    m.add_argument("--kv-bytes-per-token", type=int, default=None, metavar="BYTES",
                   help="KV cache per token, all layers (default: from --model, else 0)")
    m.add_argument("--kv-cache-memory", type=byte_count, default=None, metavar="BYTES",
                   help="KV cache per GPU, as vLLM's flag (default: as vLLM sizes it, the rest of "
                        "--gpu-memory-utilization after the weights and one budget of profiled logits)")
    m.add_argument("--device-memory-mb", type=float, default=None, metavar="MIB",
                   help="the device's memory (default: the GPU's total; host memory on unified "
                        "memory or without a GPU)")
    m.add_argument("--available-mb", type=float, default=None, metavar="MIB",
                   help="memory left to the workspace, given directly: skips the arithmetic above")
    o = p.add_argument_group("the output")
    o.add_argument("--allocator", choices=ALLOCATORS, default="default",
                   help="the allocator the exit status is for (default: default, PyTorch's as it ships)")
    o.add_argument("--summary", action="store_true", help="the verdicts only, without the per-chunk table")
    o.add_argument("--json", action="store_true", help="print the report as JSON")
    o.add_argument("--plot", metavar="FILE", help="write memory against tokens as a PNG (needs matplotlib)")
    return p


def _mib_flag(name: str, value: float | None) -> int | None:
    if value is None:
        return None
    if not 0 < value < float(1 << 44):  # a finite number of MiB the byte count can hold
        raise ValueError(f"{name} must be a positive number of MiB, got {value}")
    return max(1, round(value * MiB))


def _resolve(args) -> tuple[int | None, dict]:
    """Fills the defaults that follow from what was given; returns (available bytes or None,
    how they were found)."""
    from alloc.config import from_env
    # as the allocator would take it: the flag, else the configuration
    args.budget_mb = flag_value("budget_mb", "--budget-mb", args.budget_mb) or from_env().budget_mb
    if args.plot and unwritable(args.plot, "--plot"):
        raise ValueError(unwritable(args.plot, "--plot"))
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib, which is not installed: pip install matplotlib")
    model = model_from_config(args.model) if args.model else {}
    if args.max_model_len is None:
        args.max_model_len = int(model.get("max_position_embeddings") or SEED["prompt_tokens"])
    if args.prompt_tokens is None:
        args.prompt_tokens = args.max_model_len
    available = _mib_flag("--available-mb", args.available_mb)
    if available is not None:
        return available, {}
    device = _mib_flag("--device-memory-mb", args.device_memory_mb)
    device, source = (device, "given") if device else device_memory()
    weights = (round(args.weights_gib * (1 << 30)) if args.weights_gib is not None
               else model.get("weights_bytes") or 0)
    per_token = args.kv_bytes_per_token if args.kv_bytes_per_token is not None else \
        model.get("kv_bytes_per_token", 0)
    if weights < 0 or per_token < 0:
        raise ValueError("--weights-gib and --kv-bytes-per-token must not be negative")
    memory = serving_available(device, args.gpu_memory_utilization, args.tensor_parallel_size,
                               weights_bytes=weights, kv_cache_bytes=args.kv_cache_memory,
                               kv_bytes_per_token=per_token, max_model_len=args.max_model_len,
                               profiled_bytes=args.budget_mb * MiB)
    memory.update(device_source=source, **({"model_config": model["config"]} if model else {}))
    return memory["available_bytes"], memory


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 0 for --help and 2 for its own errors
        return 0 if e.code in (0, None) else 2
    try:
        available, memory = _resolve(args)
        report = fit(args.max_model_len, args.chunk_tokens, args.compress_ratio, args.budget_mb,
                     args.prompt_tokens, available, topk=args.topk, allocator=args.allocator,
                     max_num_seqs=args.max_num_seqs, memory=memory, progress=True)
    except (ValueError, RuntimeError) as e:  # ConfigError too
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if memory:
        report = replace(report, available_source="the device's memory less the weights and KV cache")
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
        print_table(report, table=not args.summary)
    if args.plot:
        print(f"plot written to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
