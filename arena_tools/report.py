"""Memory reports: what the arenas hold, how fragmented they are, who holds the most.

One structure serves everything, the one the C core writes on out-of-memory (``oom_report`` key):

    {"format": "indexer-arena-report-2", "budget": N,
     "devices": [{"device": d, "unified": bool,
                  "pools": [{"pool": "workspace" | "small" | "large",
                             "stats": {<every ia_stats_t field>},
                             "blocks": [[region_base, offset, size, requested, used, stream], ...]}]}]}

``arena_report.collect()`` builds it from any ``alloc.Arena`` objects (the installed allocator's views, or
host-backed arenas); ``arena_report.live_report()`` does so for the installed allocator, and ``save_live(DIR)``
writes that report (text, JSON, PNG) with the allocator's trace (CSV, snapshot) for a running
process. ``summarize()`` turns it
into per-arena numbers (capacity, in use, free, largest free block, fragmentation, a histogram of
free block sizes, the largest live blocks), which ``render_text()``, ``to_json()`` and
``write_png()`` present.

    python -m arena_tools report SOURCE [--json OUT|-] [--png OUT] [--text OUT] [--top N]

SOURCE is a JSON report (the out-of-memory report, or ``--json`` output), a snapshot pickle
(``arena_tools.export``; PyTorch's own snapshots too) or a CSV trace, whose final state is rebuilt by
replaying it on the host-backed arena.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Iterable, Sequence

from alloc.config import flag_value
from alloc.errors import ArenaError, excerpt
from alloc.records import Event
from alloc.units import MAX_DEVICES, MAX_SIZE, bound_name, fmt_bytes, is_count, is_int_in, output_width

from . import prog
from .arena_report import FORMAT_1, FORMAT_1_NAMES, REPORT_FORMAT, live_report, pool_order


class ReportError(ValueError):
    """A report file that cannot be read; the message names the file."""


# -- reading the structure ---------------------------------------------------------------------------
def stats_from_blocks(blocks: Sequence[Sequence[int]]) -> dict:
    """Every ia_stats_t field, those the blocks determine filled in, the counters and peaks 0
    (the field names come from the compiled core)."""
    from alloc.arena import STAT_NAMES
    return {**dict.fromkeys(STAT_NAMES, 0), **block_stats(blocks)}


def block_stats(blocks: Sequence[Sequence[int]]) -> dict:
    """The statistics the blocks determine, under the ia_stats_t field names; the peaks are the
    current values."""
    stats = {}
    free = [b[2] for b in blocks if not b[4]]
    used = [b for b in blocks if b[4]]
    stats.update(capacity=sum(b[2] for b in blocks), regions=len({b[0] for b in blocks}),
                 in_use=sum(b[2] for b in used), requested=sum(b[3] for b in used),
                 blocks=len(used), free_bytes=sum(free), largest_free=max(free, default=0),
                 free_blocks=len(free))
    stats["fragmentation"] = 1.0 - stats["largest_free"] / stats["free_bytes"] if stats["free_bytes"] else 0.0
    stats["capacity_peak"], stats["in_use_peak"] = stats["capacity"], stats["in_use"]
    return stats


def report_from_snapshot(snapshot: dict) -> dict:
    """A report from a memory snapshot's segments (ours, or PyTorch's own: its segments are then
    grouped into the small and large pools by their segment_type). Our snapshots also carry the
    arenas' statistics (peaks, counters); for others they are what the blocks say."""
    devices: dict[int, dict[str, list]] = {}
    for seg in snapshot.get("segments", []):
        pool = seg.get("ia_pool") or seg.get("segment_type") or "large"
        blocks = devices.setdefault(int(seg.get("device", 0)), {}).setdefault(pool, [])
        offset = 0
        for b in seg.get("blocks", []):
            used = str(b.get("state", "")).startswith("active")
            requested = b.get("requested_size", b["size"]) if used else 0
            blocks.append([seg["address"], offset, b["size"], requested, 1 if used else 0, 0])
            offset += b["size"]
    meta = snapshot.get("indexer_arena") or {}
    unified = {d["device"]: d.get("unified", False) for d in meta.get("devices", [])}
    recorded = {(s["device"], s["pool"]): s["stats"] for s in meta.get("stats", [])}
    budget = meta.get("budget")
    if budget is None:
        budget = next((sum(b[2] for b in blocks) for pools in devices.values()
                       for p, blocks in pools.items() if p == "workspace"), 0)
    return {"format": REPORT_FORMAT, "budget": int(budget or 0),
            "devices": [{"device": d, "unified": bool(unified.get(d, False)),
                         "pools": [{"pool": p, "stats": recorded.get((d, p)) or stats_from_blocks(b),
                                    "blocks": b}
                                   for p, b in sorted(pools.items(), key=lambda kv: pool_order(kv[0]))]}
                        for d, pools in sorted(devices.items())]}


def check_report(report: object, path: str = "<report>") -> dict:
    """Checks the structure of a report read from a file; raises ReportError naming what is wrong.
    Every field the summaries read is checked here, so nothing after this meets a bad value."""
    def bad(what: str) -> ReportError:
        return ReportError(f"{path}: {what}")

    if not isinstance(report, dict):
        raise bad("not a JSON object")
    if report.get("format") not in (REPORT_FORMAT, FORMAT_1):
        raise bad(f"not an indexer-arena memory report (format {excerpt(report.get('format'))}, expected "
                  f"{REPORT_FORMAT!r} or the older {FORMAT_1!r})")
    renames = FORMAT_1_NAMES if report["format"] == FORMAT_1 else {}
    if not is_int_in(report.setdefault("budget", 0), 0, MAX_SIZE):
        raise bad(f"'budget': expected a byte count from 0 to {bound_name(MAX_SIZE)}, found {excerpt(report['budget'])}")
    if not isinstance(report.get("devices"), list):
        raise bad("'devices' missing or not a list")
    for i, dev in enumerate(report["devices"]):
        if not isinstance(dev, dict) or not is_int_in(dev.get("device"), 0, MAX_DEVICES - 1) \
                or not isinstance(dev.get("pools"), list) or not isinstance(dev.setdefault("unified", False), bool):
            raise bad(f"devices[{i}]: expected {{'device': 0 to {bound_name(MAX_DEVICES - 1)}, 'unified': bool, "
                      f"'pools': [...]}}, found {excerpt(dev)}")
        for j, pool in enumerate(dev["pools"]):
            where = f"devices[{i}].pools[{j}]"
            if not isinstance(pool, dict) or not isinstance(pool.get("pool"), str) \
                    or not isinstance(pool.setdefault("blocks", []), list):
                raise bad(f"{where}: expected {{'pool': name, 'stats': {{...}}, 'blocks': [...]}}")
            for k, block in enumerate(pool["blocks"]):
                if not (isinstance(block, list) and len(block) == 6 and all(map(is_count, block))):
                    raise bad(f"{where}.blocks[{k}]: expected [region_base, offset, size, requested, "
                              f"used, stream] (integers from 0 to 2**64 - 1), found {excerpt(block)}")
            stats = pool.get("stats")
            if stats is None:
                pool["stats"] = stats_from_blocks(pool["blocks"])
                continue
            if not isinstance(stats, dict):
                raise bad(f"{where}.stats: expected an object of the arena's statistics, found {excerpt(stats)}")
            stats = pool["stats"] = {renames.get(name, name): value for name, value in stats.items()}
            for name, value in stats.items():
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1 \
                    if name == "fragmentation" else is_count(value)
                if not ok:  # the C core writes counts, and fragmentation as a fraction
                    raise bad(f"{where}.stats[{excerpt(name)}]: expected "
                              f"{'a fraction from 0 to 1' if name == 'fragmentation' else 'a count from 0 to 2**64 - 1'}, "
                              f"found {excerpt(value)}")
    return report


# -- numbers -----------------------------------------------------------------------------------------
def free_histogram(sizes: Iterable[int]) -> list[dict]:
    """Free block sizes in power-of-two classes [2^k, 2^(k+1)), the non-empty ones, smallest first."""
    classes: dict[int, list[int]] = {}
    for size in sizes:
        if size > 0:
            entry = classes.setdefault(size.bit_length() - 1, [0, 0])
            entry[0] += 1
            entry[1] += size
    return [{"min": 1 << k, "max": 1 << (k + 1), "count": c, "bytes": b}
            for k, (c, b) in sorted(classes.items())]


def _holders(events: Sequence[Event] | None) -> dict[tuple[int, int], Event]:
    """The allocation event behind each live address at the end of the events."""
    live: dict[tuple[int, int], Event] = {}
    for e in events or ():
        if e.action == "alloc":
            live[(e.device, e.address)] = e
        elif e.action == "free":
            live.pop((e.device, e.address), None)
    return live


def summarize(report: dict, *, top: int = 10, events: Sequence[Event] | None = None) -> list[dict]:
    """Per device and arena: the numbers an operator asks for, computed from the blocks, beside the
    arena's own counters (``stats``)."""
    origin = _holders(events)
    out = []
    for dev in report["devices"]:
        for pool in dev["pools"]:
            blocks = pool["blocks"]
            s = block_stats(blocks)
            used = sorted((b for b in blocks if b[4]), key=lambda b: (-b[2], b[0] + b[1]))
            holders = []
            for base, offset, size, requested, _used, stream in used[:top]:
                h = {"address": base + offset, "region_base": base, "offset": offset, "size": size,
                     "requested": requested, "stream": stream}
                e = origin.get((dev["device"], base + offset))
                if e is not None:
                    h.update(thread=e.thread, time_ns=e.time_ns)
                holders.append(h)
            out.append({
                "device": dev["device"], "pool": pool["pool"], "unified": bool(dev.get("unified")),
                "capacity": s["capacity"], "regions": s["regions"], "in_use": s["in_use"],
                "requested": s["requested"], "free": s["free_bytes"], "largest_free": s["largest_free"],
                "fragmentation": s["fragmentation"], "blocks": s["blocks"],
                "free_blocks": s["free_blocks"],
                "in_use_peak": pool.get("stats", {}).get("in_use_peak", s["in_use"]),
                "capacity_peak": pool.get("stats", {}).get("capacity_peak", s["capacity"]),
                "free_histogram": free_histogram(b[2] for b in blocks if not b[4]),
                "top_holders": holders,
            })
    return out


def timeline(events: Sequence[Event], report: dict | None = None, *, max_points: int = 20_000) -> dict:
    """Memory over the events, summed over devices and arenas: bytes asked for by live allocations
    and bytes reserved. Reserved starts from what the report's arenas hold minus what the events
    reserved (an arena made before the trace began shows up that way); with no report and no
    reserve events it is left out. Long traces keep the largest value of each stretch."""
    if not events:
        return {"t": [], "in_use": [], "reserved": None}
    sizes: dict[tuple[int, int], int] = {}
    t0 = events[0].time_ns
    t, in_use, net = [], [], []
    live = reserved = 0
    for e in events:
        if e.action == "alloc":
            sizes[(e.device, e.address)] = e.size
            live += e.size
        elif e.action == "free":
            live -= sizes.pop((e.device, e.address), 0)
        elif e.action == "reserve":
            reserved += e.size
        elif e.action == "release":
            reserved -= e.size
        else:
            continue
        t.append((e.time_ns - t0) / 1e9)
        in_use.append(live)
        net.append(reserved)
    has_reserves = any(e.action in ("reserve", "release") for e in events)
    if report is not None:
        start = sum(p.get("stats", {}).get("capacity", 0) for d in report["devices"] for p in d["pools"]) - reserved
        res = [start + n for n in net]
    elif has_reserves:
        res = [n - min(0, min(net)) for n in net]
    else:
        res = None
    if len(t) > max_points:
        k = -(-len(t) // max_points)
        t = t[::k]
        in_use = [max(in_use[i:i + k]) for i in range(0, len(in_use), k)]
        res = [max(res[i:i + k]) for i in range(0, len(res), k)] if res is not None else None
    return {"t": t, "in_use": in_use, "reserved": res}


# -- presenting --------------------------------------------------------------------------------------
def to_json(report: dict, summary: list[dict], tl: dict | None = None, *, source: str | None = None) -> dict:
    """The report itself (``python -m arena_tools report`` reads it back) with the summary beside it."""
    out = dict(report)
    out["summary"] = summary
    if tl is not None:
        out["timeline"] = tl
    if source is not None:
        out["source"] = source
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def render_text(report: dict, summary: list[dict], *, title: str = "memory report", width: int = 160,
                notes: Sequence[str] = ()) -> str:
    """Readable tables: one row per arena, then each arena's free-block histogram and top holders."""
    from .textout import Console, Table
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    budget = report.get("budget", 0)
    console.print(f"{title} (workspace budget {fmt_bytes(budget)})" if budget else title)
    for note in notes:
        console.print(note)
    table = Table(title="arenas")
    for col in ("device", "arena", "regions", "capacity", "in use", "free", "largest free",
                "fragmentation", "live blocks", "free blocks", "peak in use"):
        table.add_column(col, justify="left" if col in ("arena",) else "right", no_wrap=True)
    for s in summary:
        table.add_row(str(s["device"]) + (" (unified)" if s["unified"] else ""), s["pool"],
                      str(s["regions"]), fmt_bytes(s["capacity"]), fmt_bytes(s["in_use"]),
                      fmt_bytes(s["free"]), fmt_bytes(s["largest_free"]), _pct(s["fragmentation"]),
                      str(s["blocks"]), str(s["free_blocks"]), fmt_bytes(s["in_use_peak"]))
    console.print(table)
    for s in summary:
        name = f"device {s['device']} {s['pool']}"
        if s["free_histogram"]:
            h = Table(title=f"{name}: free blocks by size")
            for col in ("size", "blocks", "bytes"):
                h.add_column(col, justify="right")
            for row in s["free_histogram"]:
                h.add_row(f"{fmt_bytes(row['min'])} - {fmt_bytes(row['max'])}", str(row["count"]),
                          fmt_bytes(row["bytes"]))
            console.print(h)
        if s["top_holders"]:
            h = Table(title=f"{name}: largest live blocks")
            for col in ("address", "offset", "size", "requested", "stream", "thread"):
                h.add_column(col, justify="right")
            for row in s["top_holders"]:
                h.add_row(f"{row['address']:#x}", fmt_bytes(row["offset"]), fmt_bytes(row["size"]),
                          fmt_bytes(row["requested"]), f"{row['stream']:#x}", str(row.get("thread", "")))
            console.print(h)
    return buf.getvalue()


def write_png(report: dict, summary: list[dict], path: str | os.PathLike, *, tl: dict | None = None,
              title: str = "memory report") -> None:
    """A block map of every arena that holds memory (each region a bar: live blocks coloured, free
    blocks pale) and, with a timeline, memory over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arenas = [(dev["device"], pool) for dev in report["devices"] for pool in dev["pools"] if pool["blocks"]]
    rows = []  # (label, region size, blocks)
    for device, pool in arenas:
        regions: dict[int, list] = {}
        for b in pool["blocks"]:
            regions.setdefault(b[0], []).append(b)
        for i, (base, blocks) in enumerate(sorted(regions.items())):
            rows.append((f"device {device} {pool['pool']}" + (f" #{i}" if len(regions) > 1 else ""),
                         sum(b[2] for b in blocks), blocks))
    has_time = bool(tl and tl.get("t"))
    n_map = max(len(rows), 1)
    height = min(0.45 * n_map + 1.5, 12) + (3.2 if has_time else 0)
    fig = plt.figure(figsize=(11, height))
    grid = fig.add_gridspec(2 if has_time else 1, 1,
                            height_ratios=[min(0.45 * n_map + 1.5, 12), 3.2] if has_time else [1])
    ax = fig.add_subplot(grid[0])
    mib = float(1 << 20)
    for y, (label, _size, blocks) in enumerate(rows):
        free = [(b[1] / mib, b[2] / mib) for b in blocks if not b[4]]
        used = [(b[1] / mib, b[2] / mib) for b in blocks if b[4]]
        ax.broken_barh(free, (y - 0.4, 0.8), facecolors="#e8e8e8", edgecolors="none")
        ax.broken_barh(used, (y - 0.4, 0.8), facecolors="#4e79a7", edgecolors="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_ylim(-0.6, n_map - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("offset in region (MiB)")
    frag = ", ".join(f"{s['pool']} {_pct(s['fragmentation'])}" for s in summary if s["capacity"])
    ax.set_title(f"{title}: block map (blue: live, grey: free); fragmentation {frag or 'n/a'}", fontsize=9)
    if not rows:
        ax.text(0.5, 0.5, "no arena holds memory", ha="center", va="center", transform=ax.transAxes)
    if has_time:
        ax2 = fig.add_subplot(grid[1])
        ax2.step(tl["t"], [v / mib for v in tl["in_use"]], where="post", label="in use (requested)")
        if tl.get("reserved") is not None:
            ax2.step(tl["t"], [v / mib for v in tl["reserved"]], where="post", label="reserved")
        ax2.set_xlabel("seconds since the first event")
        ax2.set_ylabel("MiB")
        ax2.grid(alpha=0.3)
        ax2.legend(loc="upper left", fontsize=8)
        ax2.set_title("memory over time", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(directory: str | os.PathLike, report: dict, events: Sequence[Event] = (), *,
                  dropped: int = 0, top: int = 10, title: str = "memory report",
                  notes: Sequence[str] = ()) -> dict[str, str]:
    """Writes report.txt, report.json, report.png and, with events, trace.csv and
    snapshot.pickle into ``directory``; returns the paths by kind."""
    from . import export
    os.makedirs(directory, exist_ok=True)
    summary = summarize(report, top=top, events=events)
    tl = timeline(events, report) if events else None
    paths = {k: os.path.join(directory, name) for k, name in (
        ("text", "report.txt"), ("json", "report.json"), ("png", "report.png"))}
    with open(paths["text"], "w") as f:
        f.write(render_text(report, summary, title=title, notes=notes))
    with open(paths["json"], "w") as f:
        json.dump(to_json(report, summary, tl), f)
    write_png(report, summary, paths["png"], tl=tl, title=title)
    if events:
        paths["csv"] = os.path.join(directory, "trace.csv")
        paths["snapshot"] = os.path.join(directory, "snapshot.pickle")
        export.write_csv(events, paths["csv"])
        export.write_snapshot(export.to_snapshot(report, events, dropped=dropped), paths["snapshot"])
    return paths


def save_live(directory: str | os.PathLike, *, top: int = 10, title: str = "memory report",
              notes: Sequence[str] = ()) -> dict[str, str]:
    """For a running process: the installed allocator's report and, when tracing is on (the
    ``trace`` key or ``alloc.trace.tracing()``), its trace, written as ``write_outputs`` does. The
    trace is read first: events of allocations made meanwhile by other threads may be missing from
    it (quiesce the process for an exact match)."""
    from alloc.trace import plugin_trace
    trace = plugin_trace()
    events, dropped = trace.events() if trace is not None else ([], 0)
    return write_outputs(directory, live_report(), events, dropped=dropped, top=top, title=title,
                         notes=notes)


# -- the moment of the peak ---------------------------------------------------------------------------
def peak_prefix(events: Sequence[Event]) -> tuple[int, int]:
    """(n, bytes): the first ``n`` events end at the peak of the bytes live allocations hold, and
    what they hold then (the first such moment). Frees of what the trace never allocated count 0."""
    live: dict[tuple[int, int], int] = {}
    held = best = cut = 0
    for i, e in enumerate(events, 1):
        if e.action == "alloc":
            live[(e.device, e.address)] = e.size
            held += e.size
        elif e.action == "free":
            held -= live.pop((e.device, e.address), 0)
        if held > best:
            best, cut = held, i
    return cut, best


def at_peak(trace):
    """The trace cut at its peak (``peak_prefix``), with a note saying where that is."""
    import dataclasses
    cut, held = peak_prefix(trace.events)
    note = (f"at the peak: the state after event {cut:,} of {len(trace.events):,}, when live "
            f"allocations held {fmt_bytes(held)} (without --at peak: the state at the end)")
    return dataclasses.replace(trace, events=trace.events[:cut], origins=trace.origins[:cut],
                               kind="csv" if trace.kind == "snapshot" else trace.kind, snapshot=None), note


# -- reading any source ------------------------------------------------------------------------------
def load(path: str, *, budget: int | None = None, allow_unknown_frees: bool = False, at: str = "end"
         ) -> tuple[dict, list[Event], list[str]]:
    """(report, events, notes) from a JSON report, a snapshot pickle or a CSV trace; ``at="peak"``:
    the state when live allocations held the most (a trace's or snapshot's events replayed up to
    then)."""
    from . import export
    try:
        kind = export.sniff(path)
    except OSError as e:
        raise ReportError(f"{path}: cannot read it: {e.strerror or e}") from None
    if kind == "report":
        try:
            with open(path) as f:
                data = json.load(f)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an int of over 4,300 digits
            raise ReportError(f"{path}: not valid JSON: {excerpt(str(e), 200)}") from None
        except RecursionError:
            raise ReportError(f"{path}: nested too deeply to be a memory report") from None
        if at == "peak":
            raise ReportError(f"{path}: a JSON report holds one moment, not the events to find the "
                              "peak in; --at peak takes a CSV trace or a snapshot pickle")
        return check_report(data, path), [], []
    trace = export.load_trace(path, allow_unknown_frees=allow_unknown_frees)
    notes = []
    if at == "peak":
        trace, note = at_peak(trace)
        notes.append(note)
    if kind == "snapshot" and at == "end":  # at the peak: its events replayed, as a CSV's
        return check_report(report_from_snapshot(trace.snapshot), path), trace.events, [
            f"arenas from the snapshot's segments ({len(trace.snapshot['segments'])})"]
    from .host_replay import replay_host
    from .plan import workspace_budget
    budget, why = workspace_budget(trace, budget)
    result = replay_host(trace, budget=budget, keep_report=True, progress=sys.stderr.isatty())
    return result["report"], trace.events, notes + [
        f"a CSV trace holds no arena state: this is the state its {len(trace.events)} events leave in "
        f"the host-backed arena (workspace budget {fmt_bytes(budget)}: {why})"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog("report"), description=(
        "Memory report of a saved report, snapshot or trace: per device and arena, capacity, in use, "
        "free, largest free block, fragmentation, free-block histogram and largest live blocks."))
    p.add_argument("source", help="a JSON report (e.g. written on out-of-memory), a snapshot pickle or "
                                  "a CSV trace")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON ('-': standard output)")
    p.add_argument("--png", metavar="OUT", help="write a block map (and memory over time) as PNG")
    p.add_argument("--text", metavar="OUT", help="write the tables to this file instead of printing them")
    p.add_argument("--top", type=int, default=10, help="live blocks listed per arena (default 10)")
    p.add_argument("--budget-mb", type=int, metavar="MIB", help="CSV traces: workspace budget of the host replay")
    p.add_argument("--allow-unknown-frees", action="store_true",
                   help="skip frees of pointers the trace never allocated (a trace that starts mid-run)")
    p.add_argument("--at", choices=("end", "peak"), default="end",
                   help="traces and snapshots: the state at the end (default) or at the peak of live bytes")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from alloc.errors import ConfigError

    from .export import TraceFormatError
    from .paths import unwritable
    problems = [why for name in ("json", "png", "text") if getattr(args, name)
                for why in [unwritable(getattr(args, name), f"--{name}")] if why]
    if args.png == "-" or args.text == "-":
        problems.append("--png and --text take a file name ('-' is for --json)")
    if args.top < 0:
        problems.append(f"--top must not be negative, got {args.top}")
    try:
        args.budget_mb = flag_value("budget_mb", "--budget-mb", args.budget_mb)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    try:
        report, events, notes = load(args.source, budget=args.budget_mb << 20 if args.budget_mb else None,
                                     allow_unknown_frees=args.allow_unknown_frees, at=args.at)
    except (ReportError, TraceFormatError, ConfigError, ArenaError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(report, top=args.top, events=events)
    tl = timeline(events, report) if events else None
    title = f"memory report of {args.source}"
    if args.json:
        data = json.dumps(to_json(report, summary, tl, source=args.source))
        if args.json == "-":
            print(data)
        else:
            with open(args.json, "w") as f:
                f.write(data)
    if args.png:
        write_png(report, summary, args.png, tl=tl, title=os.path.basename(args.source))
    text = render_text(report, summary, title=title, notes=notes,
                       width=output_width(not args.text and sys.stdout.isatty(), 160))
    if args.text:
        with open(args.text, "w") as f:
            f.write(text)
    elif args.json != "-":
        print(text, end="")
    written = [f"{flag} {path}" for flag, path in (("JSON", args.json), ("PNG", args.png), ("tables", args.text))
               if path and path != "-"]
    if written:  # on stderr when stdout carries the JSON
        print(f"written: {', '.join(written)}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0
