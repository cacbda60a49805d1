from setuptools import setup

# Everything declarative lives in pyproject.toml; this file only hands cffi its builder.
setup(cffi_modules=["alloc/_build.py:ffibuilder"])
