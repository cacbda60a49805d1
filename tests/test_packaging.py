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
    env.pop("INDEXER_ARENA_CORE", None)  # a user's install: the production core
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


# -- a fresh environment from the wheel, without extras ---------------------------------------------
def _distribution_closure(names: list[str]) -> set[str]:
    """The installed distributions ``names`` need, their requirements' requirements included (a
    requirement behind an extra is not needed)."""
    import re
    from importlib import metadata
    seen, todo = set(), list(names)
    while todo:
        name = re.split(r"[\s;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        seen.add(name)
        todo += [r for r in dist.requires or () if "extra ==" not in r]
    return seen


def _link_distributions(names: set[str], folder: pathlib.Path) -> None:
    """Each distribution's top-level files and folders (its metadata too), linked into ``folder``."""
    from importlib import metadata
    folder.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        root = pathlib.Path(dist.locate_file(""))
        for top in {pathlib.PurePath(f).parts[0] for f in dist.files or ()}:
            if not (folder / top).exists() and (root / top).exists() and top != "..":
                (folder / top).symlink_to(root / top)


def _fresh_env(**extra) -> dict:
    """The environment a fresh venv's commands see: nothing of this checkout (no PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "INDEXER_ARENA_CONF", "INDEXER_ARENA_CORE")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def fresh_venv(installed):
    """A new virtual environment with the wheel installed without extras: its one dependency,
    cffi, and torch (the serving engine's own, which `devices` and `build-shim` read) come from
    this environment's copies, linked in; rich and matplotlib are not there."""
    tmp, _ = installed
    [wheel] = (tmp / "dist").glob("indexer_arena-*.whl")
    venv = tmp / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True,
                          env=_fresh_env())
    assert made.returncode == 0, made.stderr
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, env=_fresh_env()).stdout.strip()
    needs = ["cffi"] + (["torch"] if _has("torch") else [])
    _link_distributions(_distribution_closure(needs), tmp / "deps")
    pathlib.Path(site, "deps.pth").write_text(str(tmp / "deps") + "\n")
    done = subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)],
                          capture_output=True, text=True, env=_fresh_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def test_the_wheels_tags_and_license(installed):
    tmp, site = installed
    [wheel] = (tmp / "dist").glob("indexer_arena-*.whl")
    assert "-cp310-abi3-linux_" in wheel.name  # the C core is built for the stable ABI: CPython 3.10+
    [info] = site.glob("indexer_arena-*.dist-info")
    meta = (info / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in meta and "Classifier: Operating System :: POSIX :: Linux" in meta
    assert "Apache License" in (info / "licenses" / "LICENSE").read_text()


def test_a_fresh_venv_without_extras_runs_every_command(fresh_venv, installed):
    tmp, _ = installed
    bin_ = fresh_venv / "bin"
    for extra in ("rich", "matplotlib"):
        assert subprocess.run([bin_ / "python", "-c", f"import {extra}"], capture_output=True,
                              env=_fresh_env()).returncode != 0, extra
    trace = ROOT / "examples" / "seed_report" / "trace.csv"
    runs = [(["--version"], (0,), "indexer-arena 0.1.0"),
            (["fit", "--available-mb", "8192"], (1,), "verdict for the arena allocator: FITS"),
            (["fit", "--summary"], (0, 1), "verdict for the default allocator"),
            (["report", str(ROOT / "examples" / "seed_report" / "report.json")], (0,), "arenas"),
            (["replay", str(trace), "--allocators", "host"], (0,), "peak memory"),
            (["convert", str(trace), str(tmp / "seed.pickle")], (0,), "memory_viz snapshot"),
            (["convert", str(tmp / "seed.pickle"), str(tmp / "seed.csv")], (0,), "CSV trace"),
            (["report", str(tmp / "seed.pickle")], (0,), "arenas"),
            (["keys"], (0,), "budget_mb")]
    if _has("torch"):  # these two read the installed torch: without it there is nothing to run
        runs += [(["devices"], (0, 1), "CUDA device"), (["build-shim"], (0,), "oom")]
    env = _fresh_env(INDEXER_ARENA_CACHE=str(tmp / "cache"))
    for argv, codes, expect in runs:
        done = subprocess.run([bin_ / "indexer-arena", *argv], capture_output=True, text=True, cwd=tmp,
                              env=env, timeout=600)
        assert done.returncode in codes and expect in done.stdout, (argv, done.stdout[-500:], done.stderr[-2000:])
        assert "Traceback" not in done.stderr, (argv, done.stderr[-2000:])
    head = subprocess.run(f"'{bin_ / 'indexer-arena'}' --help | head -1", shell=True, capture_output=True,
                          text=True, cwd=tmp, env=env, timeout=60)
    assert head.stdout.startswith("indexer-arena COMMAND") and head.stderr == "", head.stderr
