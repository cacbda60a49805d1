"""Byte counts for people."""

MiB = 1 << 20
GiB = 1 << 30


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
