"""python -m alloc COMMAND ...

  keys         the configuration keys of INDEXER_ARENA_CONF
  devices      per CUDA device: memory attributes, unified or not, free memory
  fit          pre-launch check: does a chunked-prefill configuration fit? (exit 1 if not)
  report       memory report of a saved snapshot, trace or out-of-memory report
  replay       replay an allocation trace under several allocators
  build-shim   compile the C++ shims for the installed torch ahead of time
"""

from __future__ import annotations

import argparse
import os
import sys


def _no_arguments(command: str, description: str, argv: list[str]) -> None:
    """The commands that take no arguments: --help describes them, anything else is refused."""
    parser = argparse.ArgumentParser(prog=f"python -m alloc {command}", description=description)
    parser.parse_args(argv)  # exits 0 for --help, 2 with a usage line for anything else


def _keys(argv: list[str]) -> int:
    _no_arguments("keys", "The configuration keys of INDEXER_ARENA_CONF.", argv)
    from .config import ENV_VAR, VLLM_BUDGET_VAR, describe_keys
    print(f"{ENV_VAR}=key:value,key:value   ({VLLM_BUDGET_VAR} also sets budget_mb)\n")
    print(describe_keys())
    return 0


def _devices(argv: list[str]) -> int:
    _no_arguments("devices", "Per CUDA device: memory attributes, unified or not, free memory.", argv)
    import torch
    from rich.console import Console
    from rich.table import Table

    from .unified import FIELDS, device_attributes, is_unified
    if not torch.cuda.is_available():
        print("no CUDA device is visible")
        return 1
    table = Table(title="CUDA devices")
    for col in ("device", "name", *FIELDS, "unified", "free / total MiB"):
        table.add_column(col)
    for d in range(torch.cuda.device_count()):
        attrs = device_attributes(d)
        free, total = torch.cuda.mem_get_info(d)
        table.add_row(str(d), torch.cuda.get_device_name(d), *(str(attrs[f]) for f in FIELDS),
                      "yes" if is_unified(attrs) else "no", f"{free >> 20:,} / {total >> 20:,}")
    Console().print(table)
    return 0


def _build_shim(argv: list[str]) -> int:
    """Builds the out-of-memory shim, and the process-scope allocator where torch has CUDA."""
    _no_arguments("build-shim", "Compile the C++ shims for the installed torch ahead of time and print "
                  "their paths (cached under $INDEXER_ARENA_CACHE, default ~/.cache/indexer-arena).", argv)
    import torch
    from .shims import build
    print(build("oom"))
    if torch.version.cuda:
        print(build("allocator"))
    return 0


def _fit(argv: list[str]) -> int:
    from .fit import main
    return main(argv)


def _report(argv: list[str]) -> int:
    from .report import main
    return main(argv)


def _replay(argv: list[str]) -> int:
    from .replay import main
    return main(argv)


COMMANDS = {"keys": _keys, "devices": _devices, "fit": _fit, "report": _report, "replay": _replay,
            "build-shim": _build_shim}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return command(argv[1:])
    except BrokenPipeError:  # the reader went away (`keys | head -1`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
