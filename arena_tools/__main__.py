"""python -m arena_tools COMMAND ...   (installed as the indexer-arena command)

  fit          pre-launch check: does a chunked-prefill configuration fit? (exit 1 if not)
  report       memory report of a saved snapshot, trace or out-of-memory report
  replay       replay an allocation trace under several allocators
  keys         the configuration keys of INDEXER_ARENA_CONF (as python -m alloc keys)
  devices      per CUDA device: memory attributes, unified or not, free memory
  build-shim   compile the C++ shims for the installed torch ahead of time
"""

from __future__ import annotations

import sys

from alloc import __main__ as runtime

PROG = "python -m arena_tools"


def _fit(argv: list[str]) -> int:
    from .fit import main
    return main(argv)


def _report(argv: list[str]) -> int:
    from .report import main
    return main(argv)


def _replay(argv: list[str]) -> int:
    from .replay import main
    return main(argv)


COMMANDS = {"fit": _fit, "report": _report, "replay": _replay,
            **{name: (lambda argv, command=command: command(argv, PROG))
               for name, command in runtime.COMMANDS.items()}}


def main(argv: list[str] | None = None) -> int:
    return runtime.run(COMMANDS, __doc__, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
