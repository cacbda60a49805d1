import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

# Everything declarative lives in pyproject.toml; this file hands cffi its builder and puts into
# the package the sources that alloc/shims.py compiles at run time against the installed torch
# (alloc.shims.RUNTIME_SOURCES, among csrc/'s C++ files and headers; an editable install reads
# them from csrc/ itself).


class build_py_with_runtime_sources(build_py):
    def run(self):
        super().run()
        target = pathlib.Path(self.build_lib) / "alloc" / "_csrc"
        target.mkdir(parents=True, exist_ok=True)
        csrc = pathlib.Path(__file__).parent / "csrc"
        for source in [*csrc.rglob("*.cpp"), *csrc.rglob("*.h")]:
            (target / source.relative_to(csrc)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / source.relative_to(csrc))


setup(cffi_modules=["alloc/_build.py:ffibuilder"], cmdclass={"build_py": build_py_with_runtime_sources})
