"""Byte counts: for people, and the bounds the C core holds them to."""

MiB = 1 << 20
GiB = 1 << 30
U64_MAX = (1 << 64) - 1
"""The largest size, address or stream a C uint64_t, size_t or pointer holds here."""
MAX_SIZE = 1 << 62
"""The largest capacity, region or request the C core takes (IA_MAX_REQUEST in csrc/internal.h)."""


def is_count(value) -> bool:
    """A byte count or counter as the core holds one: an int (not a bool) from 0 to U64_MAX."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U64_MAX


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; exact bytes below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if n < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def output_width(to_terminal: bool, fallback: int) -> int:
    """Columns for a table: the terminal's when it goes to one, else ``fallback`` (files, pipes)."""
    import shutil
    return shutil.get_terminal_size((fallback, 24)).columns if to_terminal else fallback
