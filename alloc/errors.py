"""Exceptions raised by the Python face. Each message says what was asked, what the arena holds and
what to change."""


class ArenaError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(ArenaError, ValueError):
    """A configuration value is unknown, malformed or out of range."""

    def __init__(self, key: str, value: object, accepted: str, source: str = "", reason: str = ""):
        self.key, self.value, self.accepted, self.source = key, value, accepted, source
        where = f" (from {source})" if source else ""
        why = f": {reason}" if reason else ""
        super().__init__(f"invalid value {value!r} for {key!r}{where}{why}; accepted: {accepted}")


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
