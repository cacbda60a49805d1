import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

# Everything declarative lives in pyproject.toml; this file hands cffi its builder and puts into
# the package the sources that alloc/shims.py compiles at run time against the installed torch
# (an editable install reads them from csrc/ itself).
RUNTIME_SOURCES = ("oom_shim.cpp", "torch_allocator.cpp", "arena.h")


class build_py_with_runtime_sources(build_py):
    def run(self):
        super().run()
        target = pathlib.Path(self.build_lib) / "alloc" / "_csrc"
        target.mkdir(parents=True, exist_ok=True)
        for name in RUNTIME_SOURCES:
            shutil.copy2(pathlib.Path(__file__).parent / "csrc" / name, target / name)


setup(cffi_modules=["alloc/_build.py:ffibuilder"], cmdclass={"build_py": build_py_with_runtime_sources})
