"""Builds and loads the one C++ function that throws c10::OutOfMemoryError (csrc/oom_shim.cpp).

It must be compiled against the torch that runs, so it is built on first use with the system C++
compiler and cached under $INDEXER_ARENA_CACHE (default ~/.cache/indexer-arena), keyed by the
source, the torch version and the compiler. ``python -m alloc build-shim`` builds it ahead of time,
e.g. while baking a container image.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shlex
import shutil
import subprocess
import tempfile

from .errors import InstallError

SOURCE = pathlib.Path(__file__).resolve().parent.parent / "csrc" / "oom_shim.cpp"
SYMBOL = "indexer_arena_raise_oom"
_loaded: dict[str, ctypes.CDLL] = {}


def cache_dir() -> pathlib.Path:
    root = os.environ.get("INDEXER_ARENA_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "indexer-arena")
    return pathlib.Path(root)


def _compiler() -> list[str]:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx or not shutil.which(shlex.split(cxx)[0]):
        found = f"CXX={cxx!r} is not an executable" if cxx else "none was found"
        raise InstallError(
            f"building the out-of-memory shim needs a C++ compiler and {found}: install g++ (or "
            "set CXX), or build it once where one exists with `python -m alloc build-shim` and "
            "share $INDEXER_ARENA_CACHE")
    return shlex.split(cxx)


def build() -> pathlib.Path:
    """Returns the path of the shim for the running torch, compiling it if needed."""
    import torch
    from torch.utils import cpp_extension

    cxx = _compiler()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), " ".join(cxx).encode(),
                                     str(abi).encode()])).hexdigest()[:16]
    out = cache_dir() / f"oom_shim-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lib_dir = pathlib.Path(torch.__file__).resolve().parent / "lib"
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = pathlib.Path(tmp) / out.name
        cmd = [*cxx, "-shared", "-fPIC", "-O2", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               *(f"-I{p}" for p in cpp_extension.include_paths()), str(SOURCE),
               f"-L{lib_dir}", "-lc10", f"-Wl,-rpath,{lib_dir}", "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise InstallError(f"building the out-of-memory shim failed:\n$ {shlex.join(cmd)}\n"
                               f"{done.stderr[-4000:]}")
        os.replace(partial, out)  # atomic: concurrent workers see a whole file or none
    return out


def raise_oom_address() -> int:
    """Address of indexer_arena_raise_oom in the loaded shim (kept loaded for the process)."""
    path = str(build())
    if path not in _loaded:
        _loaded[path] = ctypes.CDLL(path)
    return ctypes.cast(getattr(_loaded[path], SYMBOL), ctypes.c_void_p).value
