"""Builds and loads the C++ pieces that must be compiled against the torch that runs.

- ``oom``: the one function that throws c10::OutOfMemoryError (csrc/torch/oom_shim.cpp), which both
  scopes use; it needs torch's headers only.
- ``allocator``: the process scope's CUDA allocator (csrc/torch/torch_allocator.cpp), a subclass of
  PyTorch's CUDAPluggableAllocator over the C core; it also needs the CUDA runtime's headers.

Each is built on first use with the system C++ compiler and cached under $INDEXER_ARENA_CACHE
(default ~/.cache/indexer-arena), keyed by the sources, the torch version and the compiler.
``python -m alloc build-shim`` builds them ahead of time, e.g. while baking a container image.
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
from dataclasses import dataclass

from .errors import InstallError

# An installed wheel carries the sources in the package (setup.py copies them there); a checkout
# or an editable install reads them from csrc/.
_SOURCE_DIRS = (pathlib.Path(__file__).resolve().parent / "_csrc",
                pathlib.Path(__file__).resolve().parent.parent / "csrc")


def source_dir() -> pathlib.Path:
    for d in _SOURCE_DIRS:
        if all((d / name).exists() for name in RUNTIME_SOURCES):
            return d
    raise InstallError(f"this installation lacks the C++ sources the allocator compiles at run time "
                       f"(looked in {' and '.join(map(str, _SOURCE_DIRS))}): reinstall indexer-arena")


@dataclass(frozen=True)
class Shim:
    what: str       # for messages
    source: str     # under csrc/
    cuda: bool      # needs the CUDA headers and the core's public headers, and links torch's CUDA libraries


SHIMS = {
    "oom": Shim("the out-of-memory shim", "torch/oom_shim.cpp", cuda=False),
    "allocator": Shim("the process-scope allocator", "torch/torch_allocator.cpp", cuda=True),
}
#: The core's public headers a CUDA shim includes, under csrc/.
CORE_HEADERS = ("torch/allocator.h", "arena/arena.h")
#: What the shims compile or include (setup.py copies csrc/'s C++ files and headers into the package).
RUNTIME_SOURCES = (*(shim.source for shim in SHIMS.values()), *CORE_HEADERS)
_loaded: dict[str, ctypes.CDLL] = {}


def cache_dir() -> pathlib.Path:
    root = os.environ.get("INDEXER_ARENA_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "indexer-arena")
    return pathlib.Path(root)


def _compiler(what: str) -> list[str]:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx or not shutil.which(shlex.split(cxx)[0]):
        found = f"CXX={cxx!r} is not an executable" if cxx else "none was found"
        raise InstallError(
            f"building {what} needs a C++ compiler and {found}: install g++ (or set CXX), or build "
            "it once where one exists with `python -m alloc build-shim` and share "
            "$INDEXER_ARENA_CACHE")
    return shlex.split(cxx)


def _cuda_includes(what: str) -> list[str]:
    from torch.utils import cpp_extension
    home = cpp_extension.CUDA_HOME
    candidates = [pathlib.Path(home) / "include"] if home else []
    try:  # the headers pip's CUDA runtime package carries
        import nvidia.cuda_runtime as runtime
        candidates += [pathlib.Path(p) / "include" for p in runtime.__path__]
    except ImportError:
        pass
    for path in candidates:
        if (path / "cuda_runtime_api.h").exists():
            return [f"-I{path}"]
    raise InstallError(
        f"building {what} needs the CUDA runtime's headers (cuda_runtime_api.h) and none were "
        f"found (CUDA_HOME={home!r}): install the CUDA toolkit or set CUDA_HOME to it, or build "
        "it once where they exist with `python -m alloc build-shim` and share $INDEXER_ARENA_CACHE")


def build(name: str = "oom") -> pathlib.Path:
    """Returns the path of shim `name` for the running torch, compiling it if needed."""
    import torch
    from torch.utils import cpp_extension

    shim = SHIMS[name]
    csrc = source_dir()
    cxx = _compiler(shim.what)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    sources = [csrc / name for name in (shim.source, *(CORE_HEADERS if shim.cuda else ()))]
    key = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in sources), torch.__version__.encode(),
                                     " ".join(cxx).encode(), str(abi).encode()])).hexdigest()[:16]
    out = cache_dir() / f"{pathlib.Path(shim.source).stem}-{key}.so"
    if out.exists():
        return out
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libraries = ["-lc10"]
    if shim.cuda:
        includes += _cuda_includes(shim.what) + [f"-I{csrc}"]
        libraries = ["-ltorch_cuda", "-ltorch_cpu", "-lc10_cuda", "-lc10"]
    out.parent.mkdir(parents=True, exist_ok=True)
    lib_dir = pathlib.Path(torch.__file__).resolve().parent / "lib"
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = pathlib.Path(tmp) / out.name
        cmd = [*cxx, "-shared", "-fPIC", "-O2", "-std=c++17", "-fvisibility=hidden",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(csrc / shim.source),
               f"-L{lib_dir}", *libraries, f"-Wl,-rpath,{lib_dir}", "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise InstallError(f"building {shim.what} failed:\n$ {shlex.join(cmd)}\n{done.stderr[-4000:]}")
        os.replace(partial, out)  # atomic: concurrent workers see a whole file or none
    return out


def _load(name: str) -> ctypes.CDLL:
    path = str(build(name))
    if path not in _loaded:
        _loaded[path] = ctypes.CDLL(path)
    return _loaded[path]


def raise_oom_address() -> int:
    """Address of indexer_arena_raise_oom in the loaded shim (kept loaded for the process)."""
    return ctypes.cast(_load("oom").indexer_arena_raise_oom, ctypes.c_void_p).value


def install_allocator(entry_points: int) -> None:
    """Makes the process-scope allocator PyTorch's CUDA allocator, over the C core's entry-point
    table at address `entry_points`."""
    fn = _load("allocator").indexer_arena_install_allocator
    fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    why = fn(entry_points)
    if why is not None:
        raise InstallError(f"PyTorch refused the allocator: {why.decode(errors='replace')}")
