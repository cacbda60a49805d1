"""Tables, lines and progress for the tools' output, with rich or without it.

A plain ``pip install`` brings no rich (it is the ``tools`` extra): every command still prints, as
plain text. With rich, tables are rich's; either way a table fits the width it is given by
wrapping its cells (a number is folded onto a second line, never cut to an ellipsis).
"""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
import time

try:
    from rich.console import Console as _RichConsole
    from rich.table import Table as _RichTable
except ImportError:  # the tools extra is not installed: plain text
    _RichConsole = _RichTable = None

_MARKUP = re.compile(r"\[/?[a-z ]+\]")


def terminal_columns(fallback: int = 120) -> int:
    """The terminal's width when standard output is one, else ``fallback`` (files, pipes)."""
    return shutil.get_terminal_size((fallback, 24)).columns if sys.stdout.isatty() else fallback


class _PlainTable:
    """The part of rich's Table the tools use, drawn as aligned columns of plain text."""

    def __init__(self, title: str = "", **_):
        self.title, self.columns, self.justify, self.rows = title, [], [], []

    def add_column(self, name: str, justify: str = "left", **_) -> None:
        self.columns.append(name)
        self.justify.append(justify)

    def add_row(self, *cells, **_) -> None:
        self.rows.append([_MARKUP.sub("", str(c)) for c in cells])

    def render(self, width: int) -> str:
        rows = [self.columns, *self.rows]
        n = len(self.columns)
        widths = [max(len(r[i]) if i < len(r) else 0 for r in rows) for i in range(n)]
        while sum(widths) + 2 * (n - 1) > width and max(widths) > 4:  # narrow the widest first
            widths[widths.index(max(widths))] -= 1
        lines = [textwrap.fill(self.title, width)] if self.title else []
        for k, row in enumerate(rows):
            cells = [_wrap(row[i] if i < len(row) else "", widths[i]) for i in range(n)]
            for j in range(max(len(c) for c in cells)):
                parts = [(c[j] if j < len(c) else "") for c in cells]
                lines.append("  ".join(p.rjust(w) if just == "right" else p.ljust(w)
                                       for p, w, just in zip(parts, widths, self.justify)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    """Words onto lines of ``width``; a word longer than the line is folded, not cut."""
    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [""]


class _PlainConsole:
    def __init__(self, file=None, width: int | None = None, **_):
        self.file = file or sys.stdout
        self.width = width or shutil.get_terminal_size((120, 24)).columns

    def print(self, obj="", **_) -> None:
        text = obj.render(self.width) if isinstance(obj, _PlainTable) else _MARKUP.sub("", str(obj))
        print(text, file=self.file)


if _RichTable is not None:
    class Table(_RichTable):
        """rich's Table whose columns fold what does not fit instead of cutting it."""

        def add_column(self, *args, **kwargs) -> None:
            kwargs.update(no_wrap=False, overflow="fold")
            super().add_column(*args, **kwargs)

    Console = _RichConsole
else:
    Table, Console = _PlainTable, _PlainConsole


class Ticker:
    """Progress of a long job on standard error, redrawn in place on a terminal (nothing
    elsewhere, so that logs and pipes stay clean); silent for the first ``after`` seconds."""

    def __init__(self, label: str, total: int, *, file=None, after: float = 1.0, every: float = 0.2):
        self.label, self.total, self.file = label, total, file or sys.stderr
        self.start, self.after, self.every, self.shown = time.monotonic(), after, every, 0.0
        self.enabled = self.file.isatty()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.start < self.after or now - self.shown < self.every:
            return
        self.shown = now
        rate = done / max(now - self.start, 1e-9)
        left = (self.total - done) / rate if rate else 0.0
        self.file.write(f"\r{self.label}: {done:,} of {self.total:,}, about {left:.0f} s left ")
        self.file.flush()

    def close(self) -> None:
        if self.enabled and self.shown:
            self.file.write("\r\033[K")
            self.file.flush()


class _PlainBars:
    """The part of rich.progress.Progress the replay uses: one Ticker per task."""

    def __init__(self, *_, **__):
        self.tasks: list[Ticker] = []

    def start(self) -> None:
        pass

    def add_task(self, description: str, total: int = 0) -> int:
        self.tasks.append(Ticker(description, total))
        return len(self.tasks) - 1

    def update(self, task: int, completed: int = 0, total: int | None = None) -> None:
        ticker = self.tasks[task]
        ticker.total = ticker.total if total is None else total
        ticker.update(completed)

    def stop(self) -> None:
        for ticker in self.tasks:
            ticker.close()


try:
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,  # noqa: F401
                               TimeRemainingColumn)
except ImportError:
    Progress = _PlainBars
    BarColumn = MofNCompleteColumn = TextColumn = TimeRemainingColumn = _PlainBars
