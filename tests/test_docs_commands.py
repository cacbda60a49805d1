"""Every shell command in README.md and docs/ runs: each line of a ```sh block is run (from a
scratch folder that sees the checkout's examples/), with `indexer-arena` being this tree's
command, and must end with status 0 or 1 (1: a fit that does not fit), no traceback. A block that
cannot run on a CPU machine without network says why, on the line before its fence:
``<!-- not run: REASON -->``. The README's length is held under 2,000 words here too."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest

from tests.support import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?P<before>[^\n]*)\n```(?:sh|bash|shell)\n(?P<body>.*?)```", re.S)
NOT_RUN = re.compile(r"<!-- not run: [^>]+ -->")


def blocks() -> list[tuple[str, str, bool]]:
    """(document, block, runs) for every shell block."""
    out = []
    for doc in DOCS:
        for m in FENCE.finditer(doc.read_text()):
            out.append((doc.relative_to(ROOT).as_posix(), m.group("body"), not NOT_RUN.search(m.group("before"))))
    return out


def commands(body: str) -> list[str]:
    """The block's commands: lines joined over trailing backslashes, comment lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


RUNNABLE = [(doc, command) for doc, body, runs in blocks() if runs for command in commands(body)]


def test_every_document_with_commands_is_seen():
    seen = {doc for doc, _, _ in blocks()}
    assert {"README.md", "docs/tools.md", "docs/development.md", "docs/serving-engines.md"} <= seen
    assert len(RUNNABLE) >= 10
    for doc, body, runs in blocks():
        if not runs:
            assert commands(body), f"{doc}: an empty block marked not run"


def test_the_readme_is_short():
    words = len((ROOT / "README.md").read_text().split())
    assert words < 2_000, f"README.md has {words} words; move detail into docs/"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder whose examples/ is the checkout's, and a bin/ whose indexer-arena is this tree's."""
    folder = tmp_path_factory.mktemp("docs")
    (folder / "examples").symlink_to(ROOT / "examples")
    bin_ = folder / "bin"
    bin_.mkdir()
    shim = bin_ / "indexer-arena"
    shim.write_text(f"#!/bin/sh\nPYTHONPATH='{ROOT}' exec '{sys.executable}' -m arena_tools \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    (bin_ / "python").symlink_to(sys.executable)
    return folder


@pytest.mark.parametrize("doc, command", RUNNABLE, ids=[f"{d}:{c[:60]}" for d, c in RUNNABLE])
def test_the_command_runs(doc, command, scratch):
    env = {**os.environ, "PATH": f"{scratch / 'bin'}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    env.pop("INDEXER_ARENA_CONF", None)
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=scratch, env=env,
                          timeout=300)
    assert done.returncode in (0, 1), f"{doc}: {command}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
    assert "Traceback" not in done.stderr and "error:" not in done.stderr, f"{doc}: {command}\n{done.stderr[-1500:]}"
    assert done.stdout.strip(), f"{doc}: {command} printed nothing"
