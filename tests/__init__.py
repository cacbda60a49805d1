"""The test suite. A package so that ``tests.support`` is found here and nowhere else; the test
folders themselves are not packages (pytest imports them with ``--import-mode=importlib``)."""
