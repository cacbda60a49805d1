"""Markers, the execution modes of the kernel tests, and the fixtures the tests share.

A kernel test runs in one of three modes, named by its marker:

- ``interpreter``: under Triton's interpreter on the CPU. ``@triton.jit`` decides between
  compiling and interpreting when the module defining the kernel is imported, so
  TRITON_INTERPRET must be set before anything imports ``indexer``: too late inside a pytest
  process that has collected other tests. A process without it therefore runs all its selected
  interpreter tests in one child pytest with TRITON_INTERPRET=1 and reports each test's outcome
  from it. ``TRITON_INTERPRET=1 python -m pytest -m interpreter ...`` runs them in-process.
- ``gpu``: compiled, on a CUDA device; skipped without one, and in an interpreting process.
- ``compiled``: compiled ahead of time on the CPU for the GPUs of ``tests/support/aot.py``
  (no GPU); skipped in an interpreting process and where Triton's ptxas is missing.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support import ROOT, run_python
from tests.support.testing_core import ensure_built

ensure_built()  # before anything imports alloc: this process and its children load the test build

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Set in the child pytest that runs the interpreter tests: where it writes their outcomes.
RESULTS_VAR = "INDEXER_ARENA_TEST_RESULTS"
_RESULTS = os.environ.pop(RESULTS_VAR, None)  # not for the child's own children
CHILD_TIMEOUT_S = 1800


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    cuda = _cuda_available()
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    interpreted = pytest.mark.skip(reason="kernels are interpreted in this process (TRITON_INTERPRET=1)")
    compiler = None
    for item in items:
        if "gpu" in item.keywords:
            if not cuda:
                item.add_marker(no_cuda)
            elif INTERPRETED:
                item.add_marker(interpreted)
        if "compiled" in item.keywords:
            if INTERPRETED:
                item.add_marker(interpreted)
                continue
            if compiler is None:
                from tests.support.aot import unavailable
                compiler = unavailable()
            if compiler:
                item.add_marker(pytest.mark.skip(reason=compiler))


# --- the interpreter mode: one child pytest for the session --------------------------------------

def _outcomes_of_the_interpreter_run(session) -> dict:
    """Runs every selected interpreter test of the session in one child pytest with
    TRITON_INTERPRET=1; returns {nodeid: (outcome, text)}. Once per session."""
    cached = getattr(session, "_interpreter_outcomes", None)
    if cached is not None:
        return cached
    nodeids = [item.nodeid for item in session.items if "interpreter" in item.keywords]
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "outcomes.json"
        env = dict(os.environ, TRITON_INTERPRET="1", **{RESULTS_VAR: str(results)})
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   "--rootdir", str(ROOT), *nodeids], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            tail = proc.stdout[-20000:] + proc.stderr[-5000:]
        except subprocess.TimeoutExpired as e:
            tail = f"the interpreter run took more than {CHILD_TIMEOUT_S} s\n{e.stdout or ''}"
        outcomes = json.loads(results.read_text()) if results.exists() else {}
    missing = ("failed", "the interpreter run did not report this test; its output:\n" + tail)
    session._interpreter_outcomes = {nodeid: tuple(outcomes.get(nodeid, missing)) for nodeid in nodeids}
    return session._interpreter_outcomes


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if INTERPRETED or "interpreter" not in pyfuncitem.keywords:
        return None
    outcome, text = _outcomes_of_the_interpreter_run(pyfuncitem.session)[pyfuncitem.nodeid]
    if outcome == "skipped":
        pytest.skip(text)
    if outcome == "failed":
        pytest.fail(f"under TRITON_INTERPRET=1:\n{text}", pytrace=False)
    return True


def pytest_runtest_logreport(report):
    """In the child: records each interpreter test's outcome for the parent to report."""
    if not _RESULTS:
        return
    outcomes = _child_outcomes
    if report.failed:
        outcomes[report.nodeid] = ("failed", f"({report.when}) {report.longreprtext}")
    elif report.skipped and outcomes.get(report.nodeid, ("",))[0] != "failed":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        outcomes[report.nodeid] = ("skipped", reason)
    elif report.when == "call" and report.nodeid not in outcomes:
        outcomes[report.nodeid] = ("passed", "")


_child_outcomes: dict = {}


def pytest_sessionfinish(session):
    if _RESULTS:
        Path(_RESULTS).write_text(json.dumps(_child_outcomes))


# --- fixtures ------------------------------------------------------------------------------------

@pytest.fixture
def fresh_python():
    """run_python(code, env=None, timeout=300): `code` in a fresh interpreter."""
    return run_python
