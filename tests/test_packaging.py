"""The package as a user installs it: a wheel built from this tree, installed outside it, run from
another directory. What the package needs at run time (the C++ sources its shims compile against
the installed torch) must be inside it."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

SMOKE = """
import pathlib, sys
import alloc, indexer
from alloc import shims
site = pathlib.Path(sys.argv[1]).resolve()
assert pathlib.Path(alloc.__file__).resolve().is_relative_to(site), alloc.__file__
assert shims.source_dir().is_relative_to(site), shims.source_dir()
built = shims.build("oom")
assert built.exists() and shims.raise_oom_address()
print("ok", built)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                            "-q", "-w", str(tmp / "dist")], capture_output=True, text=True, cwd=tmp)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp / "dist").glob("indexer_arena-*.whl")
    site = tmp / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, site


def run_installed(installed, *args):
    tmp, site = installed
    env = {**os.environ, "PYTHONPATH": str(site), "INDEXER_ARENA_CACHE": str(tmp / "cache")}
    env.pop("INDEXER_ARENA_CONF", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp, env=env, timeout=600)


def test_the_wheel_carries_the_shim_sources_and_builds_them_outside_the_checkout(installed):
    pytest.importorskip("torch")
    done = run_installed(installed, "-c", SMOKE, str(installed[1]))
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr


def test_the_installed_command_line_runs(installed):
    done = run_installed(installed, "-m", "alloc", "keys")
    assert done.returncode == 0 and "budget_mb" in done.stdout, done.stderr
    done = run_installed(installed, "-m", "arena_tools", "fit", "--prompt-tokens", "20000", "--chunk-tokens", "3200",
                         "--budget-mb", "64", "--available-mb", "4096")
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stdout + done.stderr
