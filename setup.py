# setuptools needs a setup.py only to hand cffi its build script; all metadata
# lives in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["ffi/build_ffi.py:ffibuilder"])
