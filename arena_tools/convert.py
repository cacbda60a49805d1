"""indexer-arena convert: a trace from RMM's CSV log to a PyTorch memory_viz snapshot, or back.

The CSV is the columns RMM's logging_resource_adaptor writes (arena_tools/export.py reads and
writes it); the snapshot is the pickle ``torch.cuda.memory._dump_snapshot`` writes, which
https://pytorch.org/memory_viz opens. Which way is decided by the input: a snapshot pickle becomes
CSV, a CSV trace becomes a snapshot.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import prog


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog("convert"), description=(
        "Convert an allocation trace between RMM's CSV log and a PyTorch memory_viz snapshot "
        "pickle (the direction follows the input). Exit status: 0 written, 2 an input or output "
        "that cannot be used."))
    p.add_argument("source", help="a CSV trace (RMM's log columns) or a snapshot pickle")
    p.add_argument("output", help="the file to write: a snapshot pickle from a CSV, a CSV from a snapshot")
    p.add_argument("--allow-unknown-frees", action="store_true",
                   help="skip frees of pointers the trace never allocated (a trace that starts mid-run)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from alloc.errors import ArenaError, ConfigError

    from . import export
    from .paths import unwritable
    why = unwritable(args.output, "output")
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        trace = export.load_trace(args.source, allow_unknown_frees=args.allow_unknown_frees)
        if trace.kind == "snapshot":
            export.write_csv(trace.events, args.output)
            what = "CSV trace (RMM's columns, with device and pool)"
        else:
            export.write_snapshot(export.to_snapshot(None, trace.events, dropped=trace.dropped), args.output)
            what = "memory_viz snapshot"
    except OSError as e:
        print(f"error: {args.source}: cannot read it: {e.strerror or e}", file=sys.stderr)
        return 2
    except (export.TraceFormatError, ConfigError, ArenaError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{what} of {len(trace.events)} events written to {args.output}")
    return 0
