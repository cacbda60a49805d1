"""The test build of the C core (alloc._core_testing, alloc/_build.py), built in place when its
sources changed and chosen for this process and its children with INDEXER_ARENA_CORE=testing.
A process that finds the variable set already was handed its core by its parent (a child
pytest, the aarch64 Python with its own extension) and builds nothing.

pytest-xdist starts several workers at once: a file lock lets one build while the others wait."""

import fcntl
import hashlib
import os
import subprocess
import sys

from tests.support import ROOT

BUILD = ROOT / "build" / "core-testing"
STAMP = BUILD / "sources.sha256"


def _fingerprint() -> str:
    h = hashlib.sha256()
    for path in sorted([*(ROOT / "csrc").rglob("*.[ch]"), ROOT / "alloc" / "_build.py"]):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _built(fingerprint: str) -> bool:
    return (STAMP.exists() and STAMP.read_text() == fingerprint
            and any((ROOT / "alloc").glob("_core_testing.*so")))


def ensure_built() -> None:
    if "INDEXER_ARENA_CORE" in os.environ:
        return
    os.environ["INDEXER_ARENA_CORE"] = "testing"
    fingerprint = _fingerprint()
    if _built(fingerprint):
        return
    BUILD.mkdir(parents=True, exist_ok=True)
    with open(BUILD.parent / "core-testing.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built(fingerprint):
            return
        for old in (ROOT / "alloc").glob("_core_testing.*so"):
            old.unlink()
        done = subprocess.run([sys.executable, str(ROOT / "alloc" / "_build.py"), "--testing"], cwd=ROOT,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the test build of the C core failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        STAMP.write_text(fingerprint)
