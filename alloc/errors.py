"""Exceptions raised by the Python face. Each message says what was asked, what the arena holds and
what to change."""

import reprlib

EXCERPT_CHARS = 80
"""The most characters of an offending value an error message quotes: files, settings and flags are
the user's, and a field of megabytes must not make a line of megabytes."""


class _Short(reprlib.Repr):
    """reprlib's bounded repr, whose ints stay bounded too (repr() of an int of more than 4,300
    digits raises, and of fewer is as long as the digits)."""

    def __init__(self, limit: int):
        super().__init__()
        self.maxstring = self.maxother = self.maxlong = limit
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 2, 4, 6, 6

    def repr_int(self, x, level):
        return str(x) if x.bit_length() <= 128 else f"<an integer of {x.bit_length()} bits>"


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """The repr of ``value`` as an error message quotes it: one line of at most about ``limit``
    characters; a longer value is cut, marked '...' and followed by its length."""
    if isinstance(value, (str, bytes)):
        text = repr(value[:limit + 1])
        whole = f" ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    else:
        text = _Short(limit).repr(value)
        whole = f" ({len(value)} items)" if isinstance(value, (list, tuple, dict, set)) else ""
    if len(text) <= limit and (not isinstance(value, (str, bytes)) or len(value) <= limit):
        return text
    return text[:limit] + "..." + whole


class ArenaError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(ArenaError, ValueError):
    """A configuration value is unknown, malformed or out of range."""

    def __init__(self, key: str, value: object, accepted: str, source: str = "", reason: str = ""):
        self.key, self.value, self.accepted, self.source = key, value, accepted, source
        where = f" (from {source})" if source else ""
        why = f": {reason}" if reason else ""
        super().__init__(f"invalid value {excerpt(value)} for {excerpt(key)}{where}{why}; accepted: {accepted}")


class ArenaOutOfMemory(ArenaError, MemoryError):
    """The arena could not serve a request; the message names the request and the arena's state."""

    def __init__(self, message: str, *, requested: int, stats: dict):
        super().__init__(message)
        self.requested = requested
        self.stats = stats


class InvalidFree(ArenaError, ValueError):
    """A free of a pointer the arena does not hold as a live block."""


class DoubleFree(InvalidFree):
    """The pointer lies inside the arena but is not the start of a live block."""


class ForeignPointer(InvalidFree):
    """The pointer lies outside every region of the arena."""


class InvariantError(ArenaError, AssertionError):
    """The arena's internal invariant check failed (a bug in the arena, never in the caller)."""


class BackendError(ArenaError, RuntimeError):
    """The backend (host mappings or the CUDA runtime) failed for a reason other than memory."""


class InstallError(ArenaError, RuntimeError):
    """The allocator could not be installed into PyTorch."""


class WorkspaceBusy(ArenaError, RuntimeError):
    """The workspace arena could not be released: some of its blocks are live."""
