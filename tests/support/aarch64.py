"""Building the C core and its harnesses for aarch64 with the cross compiler and running them
under qemu-user; building the cffi extension against an aarch64 Python and running that Python
under qemu too. ``.ci/aarch64`` installs what this needs (Debian packages: the cross compiler,
Arm's C library, qemu-user, and an arm64 Python unpacked into a folder of its own).

Without it the tests that use this skip, saying what is missing; with
INDEXER_ARENA_REQUIRE_AARCH64=1 (CI sets it) they fail instead, so that CI never passes for
having run nothing."""

import importlib
import importlib.util
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support import ROOT, SUPPORT

CC = os.environ.get("INDEXER_ARENA_AARCH64_CC", "aarch64-linux-gnu-gcc")
QEMU = "qemu-aarch64"
LIBC = Path("/usr/aarch64-linux-gnu")  # libc6-dev-arm64-cross: Arm's C library and loader
PYTHON_ROOT = Path(os.environ.get("INDEXER_ARENA_AARCH64_PYTHON",
                                  Path.home() / ".cache" / "indexer-arena" / "aarch64-python"))
REQUIRED = os.environ.get("INDEXER_ARENA_REQUIRE_AARCH64") == "1"
SETUP = ".ci/aarch64 installs it (as root, with apt)"
# What pytest needs, pure Python: linked from this interpreter's site-packages. (Hypothesis
# carries a compiled module of this machine's: the tests that use it stay on this machine.)
PURE_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")


def need(missing: str) -> None:
    """Skips (or, where CI requires the aarch64 runs, fails) when ``missing`` says why."""
    if missing:
        (pytest.fail if REQUIRED else pytest.skip)(f"{missing}; {SETUP}")


def toolchain_missing() -> str:
    absent = [tool for tool in (CC, QEMU) if shutil.which(tool) is None]
    if absent:
        return f"{' and '.join(absent)} not found"
    if not (LIBC / "lib" / "ld-linux-aarch64.so.1").exists():
        return f"Arm's C library is not in {LIBC}"
    return ""


def python() -> Path | None:
    found = sorted((PYTHON_ROOT / "usr" / "bin").glob("python3.*[0-9]"))
    return found[-1] if found else None


def python_missing() -> str:
    missing = toolchain_missing()
    if missing:
        return missing
    if python() is None:
        return f"no aarch64 Python under {PYTHON_ROOT}"
    if not list(PYTHON_ROOT.glob("usr/lib/python3/dist-packages/_cffi_backend*.so")):
        return f"no aarch64 cffi backend under {PYTHON_ROOT}"
    return ""


# The sanitizers read their options from /proc/self/environ, which under qemu is qemu's own
# environment; LeakSanitizer cannot run there (it stops the threads as a debugger would).
SANITIZER_ENV = {"ASAN_OPTIONS": "detect_leaks=0"}


def run(exe, *args, timeout=600, guest_env=None, cwd=None) -> subprocess.CompletedProcess:
    """``exe args`` under qemu-aarch64 with Arm's C library; ``guest_env`` goes to the program
    alone (LD_LIBRARY_PATH there names aarch64 libraries, which qemu itself must not load)."""
    env = [arg for k, v in (guest_env or {}).items() for arg in ("-E", f"{k}={v}")]
    return subprocess.run([QEMU, "-L", str(LIBC), *env, str(exe), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **SANITIZER_ENV})


EXTENSION = "_core_testing.abi3.so"


def _build():
    return importlib.import_module("alloc._build")


def compile_core(out: Path, flags=()) -> list[Path]:
    """The test build's C sources (alloc/_build.py) compiled for aarch64 (position-independent,
    so that the extension can take the same objects), two at a time; returns the objects."""
    out.mkdir(parents=True, exist_ok=True)

    def one(source: Path) -> Path:
        obj = out / f"{source.parent.name}-{source.stem}.o"
        done = subprocess.run([CC, "-c", "-O2", "-fPIC", "-std=gnu11", "-pthread", *flags,
                               f"-I{ROOT / 'csrc'}", str(source), "-o", str(obj)],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"{source.name} for aarch64: {done.stderr}"
        return obj

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, _build().sources(_build().TESTING)))


def build_harness(out: Path, harness: str, objects: list[Path], flags=()) -> Path:
    """tests/support/stress/<harness>.c linked with the core's aarch64 objects."""
    exe = out / f"{harness}-aarch64"
    done = subprocess.run([CC, "-O2", "-std=gnu11", "-pthread", *flags, f"-I{ROOT / 'csrc'}",
                           str(SUPPORT / "stress" / f"{harness}.c"), *map(str, objects), "-ldl",
                           "-o", str(exe)], capture_output=True, text=True)
    assert done.returncode == 0, f"{harness} for aarch64: {done.stderr}"
    assert is_arm(exe), f"{exe} is not an aarch64 program"
    return exe


def is_arm(path: Path) -> bool:
    """An ELF file whose machine (e_machine, bytes 18-19) is EM_AARCH64 (183)."""
    head = path.read_bytes()[:20]
    return head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183


def build_extension(out: Path, objects: list[Path]) -> Path:
    """The test build of the cffi extension (alloc._core_testing, which INDEXER_ARENA_CORE=testing
    selects) for the aarch64 Python: its C source written by this tree's builder (alloc/_build.py),
    compiled with the builder's flags against that Python's headers and linked with the core's
    objects. Returns a folder holding an ``alloc`` package, this tree's modules beside the aarch64
    extension."""
    builder = _build()
    source = out / "_core_testing.c"
    builder.builder(testing=True).emit_c_code(str(source))
    include = PYTHON_ROOT / "usr" / "include"
    headers = sorted(include.glob("python3.*"))
    assert headers, f"no Python headers under {include}"
    package = out / "site" / "alloc"
    package.mkdir(parents=True)
    done = subprocess.run([CC, "-shared", "-fPIC", *builder.compile_args(), f"-I{ROOT / 'csrc'}",
                           f"-I{headers[-1]}", f"-I{include}", str(source), *map(str, objects),
                           "-ldl", "-lpthread", "-o", str(package / EXTENSION)],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"the extension for aarch64: {done.stderr}"
    assert is_arm(package / EXTENSION)
    for module in (ROOT / "alloc").glob("*.py"):
        (package / module.name).symlink_to(module)
    return package.parent


def pure_site(out: Path) -> Path:
    """A folder of links to this interpreter's pure-Python test packages (no compiled module
    of this machine's may reach the aarch64 Python: torch and numpy stay out), and a
    sitecustomize that makes the aarch64 Python's children (tests that start a fresh
    interpreter) run under qemu too: without binfmt_misc this machine cannot execute them."""
    site = out / "pure"
    site.mkdir(parents=True, exist_ok=True)
    wrapper = out / "python-aarch64"
    guest = " ".join(f"-E {k}={v}" for k, v in guest_env(site.parent / "site", site).items())
    wrapper.write_text(f'#!/bin/sh\nexec {QEMU} -L {LIBC} {guest} {python()} -P "$@"\n')
    wrapper.chmod(0o755)
    (site / "sitecustomize.py").write_text(f"import sys\nsys.executable = {str(wrapper)!r}\n")
    for name in PURE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        target = origin.parent if origin.name == "__init__.py" else origin
        (site / target.name).symlink_to(target)
    return site


def run_python(site: Path, pure: Path, *args, timeout=900) -> subprocess.CompletedProcess:
    """``python3 -P args`` (the aarch64 Python under qemu, in the repository's root, which -P
    keeps off the front of its path) with ``site`` (the aarch64 ``alloc``) first on its path,
    then the repository, the pure packages and its own cffi backend."""
    return run(python(), "-P", *args, timeout=timeout, guest_env=guest_env(site, pure), cwd=ROOT)


def guest_env(site: Path, pure: Path) -> dict:
    lib = PYTHON_ROOT / "lib" / "aarch64-linux-gnu"
    usr_lib = PYTHON_ROOT / "usr" / "lib" / "aarch64-linux-gnu"
    path = os.pathsep.join(map(str, [site, ROOT, pure, PYTHON_ROOT / "usr/lib/python3/dist-packages"]))
    return {"LD_LIBRARY_PATH": f"{lib}:{usr_lib}", "PYTHONPATH": path,
            "PYTHONDONTWRITEBYTECODE": "1", "INDEXER_ARENA_CORE": "testing"}
