"""The compiled core this process uses, the one place that imports it.

``alloc._core`` (the production extension), or, with INDEXER_ARENA_CORE=testing, which the test
suite sets, ``alloc._core_testing``: the same sources with the test machinery of csrc/testing/
built in (alloc/_build.py).
"""

import os

from .errors import InstallError, excerpt

_CHOICE = os.environ.get("INDEXER_ARENA_CORE", "")

if _CHOICE == "testing":
    try:
        from . import _core_testing as module
    except ImportError as e:
        raise InstallError("INDEXER_ARENA_CORE=testing asks for the test build of the C core, which is not "
                           "built: run `python alloc/_build.py --testing` (the test suite builds it itself), "
                           "or unset INDEXER_ARENA_CORE") from e
elif _CHOICE == "":
    from . import _core as module
else:
    raise InstallError(f"INDEXER_ARENA_CORE={excerpt(_CHOICE)} is not a build of the C core: leave it unset "
                       "(the production core) or set it to 'testing' (the test build)")

ffi, lib = module.ffi, module.lib
PATH: str = module.__file__
"""The loaded extension's file: the library PyTorch must dlopen to find the entry points."""
