"""Numbers: byte counts for people, and the bounds the C core holds counts, sizes and devices to."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
PAGE = 2 * MiB
"""The driver's granularity: cudaMalloc rounds to it and the VMM maps pages of it, so an arena's
regions round to it by default (ia_arena_default_options in csrc/arena/arena.c) and the host backend
simulates pages of it."""
U64_MAX = (1 << 64) - 1
"""The largest size, address or stream a C uint64_t, size_t or pointer holds here."""
MAX_SIZE = 1 << 62
"""The largest capacity, region or request the C core takes (IA_MAX_REQUEST in csrc/arena/private.h)."""
MAX_DEVICES = 64
"""Devices the allocator serves: indices 0 to MAX_DEVICES - 1 (IA_MAX_DEVICES in csrc/arena/arena.h)."""

_BOUNDS = {U64_MAX: ("2**64 - 1", "the most a 64-bit field holds"),
           MAX_SIZE: ("2**62", "the most an arena takes"),
           U64_MAX - 1: ("2**64 - 2", "the highest stream; 2**64 - 1 is the core's no-stream value"),
           MAX_DEVICES - 1: (str(MAX_DEVICES - 1), "the highest device index the allocator serves")}


def bound_name(high: int) -> str:
    """How a message names a bound above: '2**62 (the most an arena takes)'."""
    short, why = _BOUNDS.get(high, (str(high), ""))
    return f"{short} ({why})" if why else short


def is_count(value) -> bool:
    """A byte count or counter as the core holds one: an int (not a bool) from 0 to U64_MAX."""
    return is_int_in(value, 0, U64_MAX)


def is_int_in(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def whole_number(text: str, base: int = 10) -> int:
    """An integer written plainly: an optional minus sign, then the digits 0-9 (base 16: also a-f,
    after an optional 0x). int() would also take underscores, a plus sign, spaces and other
    scripts' digits, which no file or setting of ours means."""
    body = text[1:] if text.startswith("-") else text
    if base == 16 and body[:2].lower() == "0x":
        body = body[2:]
    digits = "0123456789" if base == 10 else "0123456789abcdefABCDEF"
    if not body or body.strip(digits):
        raise ValueError("not an integer written in the digits 0-9" if base == 10
                         else "not a hexadecimal integer")
    if len(body) > 1000:  # far past every bound here; int() itself refuses 4,300 digits
        raise ValueError(f"a number of {len(body)} digits")
    return int(text, base)


def bounded(value: int, low: int, high: int) -> int:
    """``value`` when it lies from ``low`` to ``high``; else ValueError naming the bound it crosses."""
    if value < low:
        raise ValueError("negative" if low == 0 else f"less than {low}")
    if value > high:
        short, why = _BOUNDS.get(high, (str(high), ""))
        raise ValueError(f"more than {high}" + (f" ({short}, {why})" if short != str(high) else
                                                (f" ({why})" if why else "")))
    return value


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; exact bytes below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if n < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def fmt_mib(n: float | None, decimals: int = 0) -> str:
    """A byte count as a table's MiB column: 2,950 (``decimals`` 0), 2,750.0 (1); "-" for None."""
    return "-" if n is None else f"{n / MiB:,.{decimals}f}"


def fmt_mib_text(n: float) -> str:
    """A byte count in a sentence, in MiB to a tenth: '2,750.0 MiB'."""
    return f"{fmt_mib(n, 1)} MiB"


def output_width(to_terminal: bool, fallback: int) -> int:
    """Columns for a table: the terminal's when it goes to one, else ``fallback`` (files, pipes)."""
    import shutil
    return shutil.get_terminal_size((fallback, 24)).columns if to_terminal else fallback
