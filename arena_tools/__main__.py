"""PROG COMMAND ...

  fit          pre-launch check: will a serving configuration's indexer workspace fit? (exit 1 if not)
  report       memory report of a saved snapshot, trace or out-of-memory report
  replay       replay an allocation trace under several allocators
  convert      convert a trace between RMM's CSV log and PyTorch's memory_viz snapshot
  keys         the configuration keys of INDEXER_ARENA_CONF (as python -m alloc keys)
  devices      per CUDA device: memory attributes, unified or not, free memory
  build-shim   compile the C++ shims for the installed torch ahead of time

PROG COMMAND --help describes a command; PROG --version prints the version.
"""

from __future__ import annotations

import os
import sys

from alloc import __main__ as runtime

from . import prog


def _fit(argv: list[str]) -> int:
    from .fit import main
    return main(argv)


def _report(argv: list[str]) -> int:
    from .report import main
    return main(argv)


def _replay(argv: list[str]) -> int:
    from .replay import main
    return main(argv)


def _convert(argv: list[str]) -> int:
    from .convert import main
    return main(argv)


COMMANDS = {"fit": _fit, "report": _report, "replay": _replay, "convert": _convert,
            **{name: (lambda argv, command=command: command(argv, prog()))
               for name, command in runtime.COMMANDS.items()}}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    try:
        return installed("indexer-arena")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["--version"]:
            print(f"{prog()} {version()}")
            code = 0
        else:
            code = runtime.run(COMMANDS, __doc__.replace("PROG", prog()), argv)
        sys.stdout.flush()  # here, so that a reader gone away is met inside the handler
        return code
    except BrokenPipeError:  # `indexer-arena --help | head -1`: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
