"""python -m alloc COMMAND ...

  keys         the configuration keys of INDEXER_ARENA_CONF
  devices      per CUDA device: memory attributes, unified or not, free memory
  build-shim   compile the C++ shims for the installed torch ahead of time

The offline tools (fit, report, replay) are python -m arena_tools.
"""

from __future__ import annotations

import argparse
import os
import sys

TOOLS = ("fit", "report", "replay")  # commands that moved to python -m arena_tools


def _no_arguments(command: str, description: str, argv: list[str], prog: str) -> None:
    """The commands that take no arguments: --help describes them, anything else is refused."""
    parser = argparse.ArgumentParser(prog=f"{prog} {command}", description=description)
    parser.parse_args(argv)  # exits 0 for --help, 2 with a usage line for anything else


def keys(argv: list[str], prog: str = "python -m alloc") -> int:
    _no_arguments("keys", "The configuration keys of INDEXER_ARENA_CONF.", argv, prog)
    from .config import ENV_VAR, VLLM_BUDGET_VAR, describe_keys
    print(f"{ENV_VAR}=key:value,key:value   ({VLLM_BUDGET_VAR} also sets budget_mb)\n")
    print(describe_keys())
    return 0


def _columns(rows: list[list[str]]) -> str:
    """Rows as left-aligned columns, the first row a header underlined."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def devices(argv: list[str], prog: str = "python -m alloc") -> int:
    _no_arguments("devices", "Per CUDA device: memory attributes, unified or not, whether the driver maps pages (expandable), free memory.", argv, prog)
    import torch

    from .plugin import mapping_refusal
    from .unified import FIELDS, device_attributes, is_unified
    if not torch.cuda.is_available():
        print("no CUDA device is visible")
        return 1
    rows = [["device", "name", *FIELDS, "unified", "maps pages", "free / total MiB"]]
    notes = []
    for d in range(torch.cuda.device_count()):
        attrs = device_attributes(d)
        free, total = torch.cuda.mem_get_info(d)
        why = mapping_refusal(d)
        if why is not None:  # expandable:auto serves this device's general pools from regions
            notes.append(f"device {d}: {why}")
        rows.append([str(d), torch.cuda.get_device_name(d), *(str(attrs[f]) for f in FIELDS),
                     "yes" if is_unified(attrs) else "no", "yes" if why is None else "no",
                     f"{free >> 20:,} / {total >> 20:,}"])
    print("CUDA devices")
    print(_columns(rows))
    for note in notes:
        print(note)
    return 0


def build_shim(argv: list[str], prog: str = "python -m alloc") -> int:
    """Builds the out-of-memory shim, and the process-scope allocator where torch has CUDA."""
    _no_arguments("build-shim", "Compile the C++ shims for the installed torch ahead of time and print "
                  "their paths (cached under $INDEXER_ARENA_CACHE, default ~/.cache/indexer-arena).", argv, prog)
    import torch

    from .shims import build
    print(build("oom"))
    if torch.version.cuda:
        print(build("allocator"))
    return 0


COMMANDS = {"keys": keys, "devices": devices, "build-shim": build_shim}


def run(commands: dict, doc: str, argv: list[str], moved: dict[str, str] | None = None) -> int:
    """Dispatches argv[0] to one of ``commands``; ``moved`` names the new home of old commands."""
    if not argv or argv[0] in ("-h", "--help"):
        print(doc)
        return 0 if argv else 2
    if moved and argv[0] in moved:
        print(f"{argv[0]!r} is an offline tool now: run {moved[argv[0]]} {argv[0]} ...", file=sys.stderr)
        return 2
    command = commands.get(argv[0])
    if command is None:
        print(f"unknown command {argv[0]!r}; commands: {', '.join(commands)}", file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except BrokenPipeError:  # the reader went away (`keys | head -1`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def main(argv: list[str] | None = None) -> int:
    return run(COMMANDS, __doc__, sys.argv[1:] if argv is None else argv,
               moved=dict.fromkeys(TOOLS, "python -m arena_tools"))


if __name__ == "__main__":
    sys.exit(main())
