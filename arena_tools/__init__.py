"""indexer-arena's offline tools: reports, traces in other tools' formats, replay under several
allocators, the pre-launch fit check, and the allocator table the benchmarks share.

They import the runtime (``alloc``), never the other way round; ``indexer-arena`` (or ``python -m
arena_tools``) is their command line. Every command runs from a plain ``pip install``; rich (nicer
tables) and matplotlib (PNG output) are the ``tools`` extra.
"""

import os
import sys


def prog(command: str = "") -> str:
    """The command as it was typed: ``indexer-arena`` installed, ``python -m arena_tools`` run as a
    module (whose argv[0] is this package's __main__.py)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if not name or name in ("__main__.py", "-c", "-m") or name.startswith("python"):
        name = "python -m arena_tools"
    return f"{name} {command}".rstrip()
