"""What the benchmarks share: their common flags, a run of each allocator in a fresh process (thin
over ``arena_tools.allocators``, the one table of allocators and the one fresh-process runner),
one table printer and the goal lines.

A benchmark that compares allocators is one program in two roles. The parent parses its flags,
starts a child per allocator and round (``each_allocator``) and prints the tables; a child is the
same program started with the hidden ``--worker NAME --result PATH``, and ``child`` runs its
work under that allocator and writes the result where the parent reads it.

The programs run as ``python benchmarks/alloc/bench_llama.py ...`` from anywhere: each puts the
repository root on ``sys.path`` before importing this module (the children get it on PYTHONPATH
from ``arena_tools.allocators.child_environ``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence

from arena_tools import allocators
from arena_tools.paths import unwritable


def parser(doc: str, *, workers: Sequence[str] = (), rounds: int | None = None,
           rounds_help: str = "passes over every allocator, alternated") -> argparse.ArgumentParser:
    """The program's parser, its description the first paragraph of ``doc``, with --json (checked
    writable before any work), --rounds where ``rounds`` is its default, and the hidden
    --worker/--result of a child where ``workers`` names the allocators it accepts."""
    p = _Parser(description=doc.strip().split("\n\n")[0])
    p.add_argument("--json", help="write the results here as JSON")
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    if workers:
        p.add_argument("--worker", choices=list(workers), help=argparse.SUPPRESS)
        p.add_argument("--result", help=argparse.SUPPRESS)
    return p


class _Parser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):
        out = super().parse_args(args, namespace)
        why = unwritable(out.json, "--json") if getattr(out, "json", None) else None
        if why:
            self.error(why)
        if getattr(out, "rounds", 1) < 1:
            self.error(f"--rounds must be a positive integer, got {out.rounds}")
        return out


def child(args, work: Callable[[argparse.Namespace], dict]) -> bool:
    """In a child (--worker given): runs ``work(args)``, writes its result for the parent and
    returns True. In the parent: False."""
    if getattr(args, "worker", None) is None:
        return False
    allocators.write_result(args.result, work(args))
    return True


def each_allocator(names: Sequence[str], script: str, forwarded: Sequence[str], *, rounds: int = 1,
                   stop_on_error: bool = False) -> list[dict]:
    """Runs ``script --worker NAME --result PATH *forwarded`` under each allocator of ``names``,
    each in a fresh process, the rounds alternating (A B A B); the results in run order, each
    also summed up in a line on standard error as its run ends (allocators.summary). With
    ``stop_on_error`` the first failed run ends the program with its standard error."""
    runs = allocators.run_each(names, lambda name, result: allocators.python(
        script, "--worker", name, "--result", result, *forwarded), rounds=rounds,
        on_result=lambda round_, r: print(allocators.summary(round_, r), file=sys.stderr, flush=True))
    if stop_on_error:
        allocators.stop_on_error(runs)
    return runs


def forwarded(argv: Sequence[str] | None = None, drop: Iterable[str] = ("--json",)) -> list[str]:
    """The parent's own flags (``sys.argv[1:]`` by default) less those the children must not
    get: each flag of ``drop`` with its value."""
    out = list(sys.argv[1:] if argv is None else argv)
    for option in drop:
        out = allocators.without_option(out, option)
    return out


def best(runs: Sequence[dict], names: Iterable[str], key: str, *, most: bool = False) -> dict[str, dict]:
    """Each allocator's best run by ``key``: the least (times) or, with ``most``, the greatest
    (rates)."""
    pick = max if most else min
    return {name: pick((r for r in runs if r["allocator"] == name), key=lambda r: r[key])
            for name in names}


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], *,
          justify: str = "right", width: int | None = None) -> None:
    """Prints one table: rich's where it is installed (the ``tools`` extra), plain text
    otherwise, the same cells either way; ``width``: at least that many columns wide."""
    rows = [list(map(str, r)) for r in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max([len(c), *(len(r[i]) for r in rows if i < len(r))]) for i, c in enumerate(columns)]
        align = (lambda s, w: s.rjust(w)) if justify == "right" else (lambda s, w: s.ljust(w))
        print(title)
        for r in [list(columns), *rows]:
            print("  ".join(align(cell, w) for cell, w in zip(r, widths)).rstrip())
        return
    out = Table(title=title)
    for col in columns:
        out.add_column(col, justify=justify)
    for r in rows:
        out.add_row(*r)
    Console(width=max(width, Console().width) if width else None).print(out)


def goal(text: str, met: bool, shown: str | None = None) -> bool:
    """Prints ``goal: TEXT[: SHOWN]: met`` (or ``NOT met``) and returns ``met``."""
    print(f"goal: {text}" + (f": {shown}" if shown else "") + f": {'met' if met else 'NOT met'}")
    return met


def write_json(path: str | None, results, indent: int = 1) -> None:
    """The results as JSON at ``path`` ('-': standard output); nothing without a path."""
    if not path:
        return
    text = json.dumps(results, indent=indent, default=str)
    if path == "-":
        print(text)
        return
    with open(path, "w") as f:
        f.write(text)
