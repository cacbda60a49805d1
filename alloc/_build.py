"""cffi builder for the C core (run by setuptools through ``cffi_modules`` in setup.py).

The declarations are csrc/arena.h itself, then csrc/arena_testing.h (what the tests reach beside
it), each passed through the C preprocessor with IA_CDEF set so that the statistics X-macro expands
into the struct cffi sees.
"""

import os
import pathlib
import shlex
import subprocess
import sysconfig

from cffi import FFI

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
HEADERS = ("arena.h", "arena_testing.h")


def preprocessed_header() -> str:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cmd = [*shlex.split(cc), "-E", "-P", "-DIA_CDEF", "-x", "c", "-"]
    source = "".join(f'#include "{CSRC / name}"\n' for name in HEADERS)
    return subprocess.run(cmd, input=source, check=True, capture_output=True, text=True).stdout


def compile_args() -> list[str]:
    args = ["-std=gnu11", "-fvisibility=hidden", "-fexceptions", "-Wall", "-Wextra",
            "-Wno-unused-parameter", "-Wno-missing-field-initializers"]
    if os.environ.get("INDEXER_ARENA_DEBUG_BUILD") == "1":
        args += ["-O0", "-g", "-fno-omit-frame-pointer", "-DIA_DEBUG=1"]
    else:
        args += ["-O2"]
    return args


ffibuilder = FFI()
ffibuilder.cdef(preprocessed_header())
ffibuilder.set_source(
    "alloc._core",
    "".join(f'#include "{name}"\n' for name in HEADERS),
    sources=sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.c")),
    include_dirs=[str(CSRC)],
    extra_compile_args=compile_args(),
    libraries=["dl", "pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(ROOT), verbose=True)
