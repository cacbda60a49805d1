"""Configuration: one environment variable in PyTorch's ``key:value,key:value`` style.

``INDEXER_ARENA_CONF`` holds the settings; the workspace budget may instead come from
``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB``, which serving engines already set. Every value is checked
and a bad one raises ConfigError naming the key, the value and what is accepted. A key that is not
given takes its documented default; a key that is given is never replaced by one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .errors import ConfigError, excerpt
from .units import MAX_SIZE, whole_number

ENV_VAR = "INDEXER_ARENA_CONF"
VLLM_BUDGET_VAR = "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"
SCOPES = ("process", "workspace")
"""The scopes alloc.install() takes: the arena as the process's CUDA allocator, or for workspaces alone."""


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text
    return parse


def c_path(text: str) -> bytes:
    """A path as the C core opens it: the file system's bytes, with no NUL byte (C would read the
    path as cut there and open another file)."""
    if not text:
        raise ValueError("must not be empty")
    if "\0" in text:
        raise ValueError(f"a NUL byte at position {text.index(chr(0))} would end the path there in C")
    try:
        return os.fsencode(text)
    except UnicodeEncodeError as e:
        raise ValueError(f"the character {text[e.start]!r} at position {e.start} cannot be written "
                         "as a file name here") from None


def _path(text: str) -> str:
    c_path(text)
    return text


MAX_MIB = MAX_SIZE >> 20  # MiB counts whose bytes the core can take


def _int_in(low: int, high: int, below: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = whole_number(text)
        if value < low:
            raise ValueError(below)
        if value > high:
            raise ValueError(f"must be at most {high}")
        return value
    return parse


def _power_of_two_16(text: str) -> int:
    value = whole_number(text)
    if value < 16 or value & (value - 1) or value > 1 << 30:
        raise ValueError("must be a power of two from 16 to 2**30")
    return value


@dataclass(frozen=True)
class Key:
    name: str
    parse: Callable[[str], object]
    accepted: str
    doc: str
    default: object  # what a key that is not given takes (None: off)

    @property
    def shown_default(self) -> str:
        return "none" if self.default is None else str(self.default)


# The one table of the configuration: Config's fields, `python -m alloc keys` and docs/configuration.md's
# table (describe_keys, markdown_keys) all come from it.
KEYS: dict[str, Key] = {k.name: k for k in (
    Key("budget_mb", _int_in(1, MAX_MIB, "must be greater than zero"), "a positive integer number of MiB",
        "size of each device's workspace arena, reserved once", 512),
    Key("alignment", _power_of_two_16, "a power of two from 16 to 2**30 (bytes)",
        "alignment of every workspace block", 256),
    Key("unified", _choice("auto", "on", "off"), "auto, on or off",
        "guard every device reservation against host memory, as unified-memory GPUs need "
        "(auto: on where the device reports itself integrated)", "auto"),
    Key("host_headroom_mb", _int_in(0, MAX_MIB, "must not be negative"), "a non-negative integer number of MiB",
        "unified memory: host memory kept free beyond every reservation", 4096),
    Key("meminfo", _path, "a path to a file in /proc/meminfo format",
        "unified memory: where MemAvailable is read", "/proc/meminfo"),
    Key("trace", _int_in(0, 1 << 32, "must not be negative"), "a non-negative integer (events)",
        "record allocation events in a ring of this many entries (0: off)", 0),
    Key("oom_report", _path, "a file path",
        "on out-of-memory, write the memory report there and name it in the error", None),
    Key("trace_file", _path, "a file path",
        "at the process's exit, write the allocation trace there as RMM's CSV log (Device and Pool "
        "columns added; indexer-arena convert makes it a memory_viz snapshot); recording starts "
        "at install, in a ring of `trace` events (1048576 when trace is 0)", None),
    Key("expandable", _choice("auto", "on", "off"), "auto, on or off",
        "process scope: each general pool is one address range whose 2 MiB pages are mapped as "
        "blocks need them and unmapped by torch.cuda.empty_cache(), as PyTorch's "
        "expandable_segments (auto: where the driver supports CUDA virtual memory management; "
        "off: regions, one cudaMalloc each; on: refuse to start where it cannot)", "auto"),
)}


@dataclass(frozen=True)
class Config:
    budget_mb: int = KEYS["budget_mb"].default
    alignment: int = KEYS["alignment"].default
    unified: str = KEYS["unified"].default
    host_headroom_mb: int = KEYS["host_headroom_mb"].default
    meminfo: str = KEYS["meminfo"].default
    trace: int = KEYS["trace"].default
    oom_report: str | None = KEYS["oom_report"].default
    trace_file: str | None = KEYS["trace_file"].default
    expandable: str = KEYS["expandable"].default

    def __post_init__(self):
        """Every field is checked as the environment's text would be, whatever made the Config."""
        for name, key in KEYS.items():
            value = getattr(self, name)
            if value is None and key.default is None:  # a path key left off
                continue
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ConfigError(name, value, key.accepted, "arguments", f"a {type(value).__name__}")
            object.__setattr__(self, name, _parse_value(key, str(value), "arguments"))

    @property
    def budget_bytes(self) -> int:
        return self.budget_mb << 20

    @property
    def host_headroom_bytes(self) -> int:
        return self.host_headroom_mb << 20

    def replace(self, **changes) -> Config:
        for name, value in changes.items():
            if name not in KEYS:
                raise ConfigError(name, value, f"one of {', '.join(KEYS)}", "arguments",
                                  "unknown key")
        return dataclasses.replace(self, **changes)

    def to_env(self) -> str:
        """The INDEXER_ARENA_CONF text that reproduces this configuration."""
        default = Config()
        return ",".join(f"{k}:{getattr(self, k)}" for k in KEYS
                        if getattr(self, k) != getattr(default, k))


def _parse_value(key: Key, text: str, source: str) -> object:
    try:
        return key.parse(text)
    except ValueError as e:
        raise ConfigError(key.name, text, key.accepted, source, str(e)) from None


def parse(text: str, source: str = ENV_VAR) -> dict[str, object]:
    """Parses ``key:value,key:value`` into a dict of checked values."""
    values: dict[str, object] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition(":")
        name, value = name.strip(), value.strip()
        if name not in KEYS:
            raise ConfigError(name, value, f"one of {', '.join(KEYS)}", source, "unknown key")
        if not sep:
            raise ConfigError(name, item, f"{name}:<{KEYS[name].accepted}>", source,
                              "missing ':' between key and value")
        if name in values:
            raise ConfigError(name, value, "each key once", source, "given twice")
        values[name] = _parse_value(KEYS[name], value, source)
    return values


def from_env(environ: Mapping[str, str] | None = None) -> Config:
    """Reads INDEXER_ARENA_CONF and VLLM_SPARSE_INDEXER_MAX_LOGITS_MB."""
    environ = os.environ if environ is None else environ
    values = parse(environ.get(ENV_VAR, ""))
    vllm = environ.get(VLLM_BUDGET_VAR)
    if vllm is not None:
        budget = _parse_value(KEYS["budget_mb"], vllm.strip(), VLLM_BUDGET_VAR)
        if "budget_mb" in values and values["budget_mb"] != budget:
            raise ConfigError("budget_mb", values["budget_mb"], "the same budget in both places",
                              f"{ENV_VAR}, while {VLLM_BUDGET_VAR}={excerpt(vllm)}",
                              "the two settings disagree")
        values["budget_mb"] = budget
    return Config(**values)


def flag_value(name: str, flag: str, value: int | str | None) -> object:
    """A command-line flag's value checked as the key ``name`` is (None: not given), so that the
    flag and the key take the same values; else ValueError naming the flag, the value and what is
    accepted, one line for the command to print."""
    if value is None:
        return None
    key = KEYS[name]
    try:
        return key.parse(str(value).strip())
    except ValueError as e:
        raise ValueError(f"{flag} {excerpt(value)}: {e}; accepted: {key.accepted}") from None


def describe_keys() -> str:
    """One line per key, for ``python -m alloc keys``."""
    return "\n".join(f"{k.name:<18} {k.doc} (default {k.shown_default}); {k.accepted}"
                     for k in KEYS.values())


def markdown_keys() -> str:
    """The table of the keys in docs/configuration.md."""
    rows = [f"| `{k.name}` | {k.shown_default} | {k.doc}; {k.accepted} |" for k in KEYS.values()]
    return "\n".join(["| key | default | meaning |", "|---|---|---|", *rows])
