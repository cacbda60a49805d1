"""Code the tests share that is not a fixture: the repository's root, a fresh interpreter, and
(in the modules beside this one) recorded workloads, GPU preludes, kernel compilers, and the
programs and C harnesses that tests start.

No module here may share a name with a package: tp_probe.py runs as a script, with this folder
first on sys.path (hence indexer_cpu.py, not indexer.py)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent


def fake_package(root: Path, modules: dict[str, str], name: str = "fake_engine") -> Path:
    """A package `name` under `root` holding `modules` ({module: source}, dedented), standing in
    for an engine's; returns `root`, the folder to put on sys.path."""
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for module, source in modules.items():
        (pkg / f"{module}.py").write_text(textwrap.dedent(source))
    return root


def run_python(code: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (a fresh CUDA context, a fresh allocator choice)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=timeout)
