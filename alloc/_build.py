"""cffi builder for the C core, and the one list of its sources.

Two extensions come from the same sources (csrc/README.md says which folder holds what):

- ``alloc._core``, the production one, which setuptools builds through ``cffi_modules`` in
  setup.py: the budget arena (csrc/arena/) and PyTorch's allocator (csrc/torch/), declared by
  csrc/indexer_arena.h.
- ``alloc._core_testing``: the same with the test machinery (csrc/testing/: the simulated CUDA
  graph capture, test-only entry points) built in and declared by csrc/testing/testing.h. The
  test suite builds it in place (``python alloc/_build.py --testing``; tests/conftest.py does it
  when the sources changed) and loads it with INDEXER_ARENA_CORE=testing (alloc/_lib.py).

Each header is passed through the C preprocessor with IA_CDEF set, so that the statistics X-macro
expands into the struct cffi sees. The C harnesses and benchmarks take their sources from
``sources()`` too.
"""

import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import sysconfig


ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
ARENA = ("arena",)                                 # the budget arena alone
PRODUCTION = ("arena", "torch")                    # alloc._core
TESTING = ("arena", "torch", "testing")            # alloc._core_testing
MODULES = {False: "alloc._core", True: "alloc._core_testing"}


def sources(folders=PRODUCTION) -> list[pathlib.Path]:
    """The C files of the given folders of csrc/, sorted."""
    return sorted(p for folder in folders for p in (CSRC / folder).glob("*.c"))


def headers(testing: bool) -> tuple[str, ...]:
    return ("indexer_arena.h", "testing/testing.h") if testing else ("indexer_arena.h",)


def preprocessed_header(testing: bool) -> str:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cmd = [*shlex.split(cc), "-E", "-P", "-DIA_CDEF", "-x", "c", "-"]
    source = "".join(f'#include "{CSRC / name}"\n' for name in headers(testing))
    return subprocess.run(cmd, input=source, check=True, capture_output=True, text=True).stdout


def compile_args() -> list[str]:
    args = ["-std=gnu11", "-fvisibility=hidden", "-fexceptions", "-Wall", "-Wextra",
            "-Wno-unused-parameter", "-Wno-missing-field-initializers"]
    if os.environ.get("INDEXER_ARENA_DEBUG_BUILD") == "1":
        args += ["-O0", "-g", "-fno-omit-frame-pointer", "-DIA_DEBUG=1"]
    else:
        args += ["-O2"]
    return args


def builder(testing: bool = False, absolute: bool = False):
    """The cffi builder (an FFI) of one extension. absolute: source paths as such, for a build
    outside setuptools (which wants them relative)."""
    from cffi import FFI  # here: the source lists above serve where cffi is not installed
    ffi = FFI()
    ffi.cdef(preprocessed_header(testing))
    ffi.set_source(
        MODULES[testing],
        "".join(f'#include "{name}"\n' for name in headers(testing)),
        sources=[str(p if absolute else p.relative_to(ROOT)) for p in sources(TESTING if testing else PRODUCTION)],
        include_dirs=[str(CSRC)],
        extra_compile_args=compile_args(),
        libraries=["dl", "pthread"],
    )
    return ffi


def ffibuilder():
    """The production extension's builder, which setup.py's cffi_modules calls."""
    return builder(testing=False)

if __name__ == "__main__":
    # In place, into alloc/: `python alloc/_build.py` (production) or `... --testing`.
    testing = sys.argv[1:] == ["--testing"]
    if sys.argv[1:] not in ([], ["--testing"]):
        sys.exit(f"usage: python alloc/_build.py [--testing] (got {' '.join(sys.argv[1:])!r})")
    # Objects of each build in a folder of their own, so that two builds never share one.
    built = builder(testing, absolute=True).compile(tmpdir=str(ROOT / "build" / ("core-testing" if testing else "core")))
    shutil.copy2(built, ROOT / "alloc" / pathlib.Path(built).name)
