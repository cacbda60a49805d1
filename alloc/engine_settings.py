"""The engine plugin's settings in every process of a distributed engine (docs/multi-node.md).

A distributed engine starts its workers in processes whose environment is not the driver's: vLLM's
Ray executors and data-parallel engine-core actors get only the variables vLLM copies (0.13: the
names vLLM registers; 0.33: those and its prefixes, ``VLLM_``, ``NCCL_``, ...; 0.33's
``RayExecutorV2`` applies the driver's whole environment with ``setdefault``, so a node's own value
wins), and a multi-node launch without Ray (vLLM ``--nnodes``, SGLang ``--nnodes``) starts each
node with its own. So:

- the driver side adds CARRIED to what vLLM copies, with DRIVER_VAR, this process's settings as
  text, set at the moment of the copy (the plugin's routes on vLLM's copy functions);
- a process that finds DRIVER_VAR runs with the driver's settings, and one whose own differ says
  so in one line; a worker re-reads them at its start, for a plugin loaded before they arrived;
- every process that loads the plugin logs one line: its role, host and settings, or why it is
  off; the ranks of one model compare their settings over the engine's process group when it is
  made (``disagreement``), so that ranks that would plan the indexer's chunks from different
  budgets are named at start instead of hanging in a collective.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from . import config as config_mod
from .errors import ConfigError

SCOPE_VAR = "INDEXER_ARENA_SCOPE"
DRIVER_VAR = "INDEXER_ARENA_DRIVER"
"""The driver's settings as ``scope;conf`` (``off`` when its plugin is off), set by the driver's
plugin when vLLM copies its environment to workers; the workers take their settings from it."""
CARRIED = (SCOPE_VAR, config_mod.ENV_VAR, config_mod.VLLM_BUDGET_VAR, DRIVER_VAR)
PLANNING = ("budget_mb", "alignment")
"""The keys every rank must share: the indexer plans its chunks from them."""


def planning(config: config_mod.Config) -> str:
    """The configuration's keys that every rank must share, as text."""
    return ", ".join(f"{k} {getattr(config, k)}" for k in PLANNING)


def scope_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The scope INDEXER_ARENA_SCOPE names, or None when it is unset or empty."""
    environ = os.environ if environ is None else environ
    scope = environ.get(SCOPE_VAR, "").strip()
    if not scope:
        return None
    if scope not in config_mod.SCOPES:
        raise ConfigError(SCOPE_VAR, scope, f"{' or '.join(config_mod.SCOPES)} (unset: off)",
                          "the environment", "unknown scope")
    return scope


@dataclass(frozen=True)
class Settings:
    scope: str | None                    # None: off
    config: config_mod.Config | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        scope = scope_from_env(environ)
        return cls(scope, config_mod.from_env(environ) if scope else None)

    def encode(self) -> str:
        return "off" if self.scope is None else f"{self.scope};{self.config.to_env()}"

    @classmethod
    def decode(cls, text: str) -> Settings:
        """DRIVER_VAR's text; ConfigError naming DRIVER_VAR when it is not what encode() makes."""
        if text.strip() == "off":
            return cls(None)
        scope, sep, conf = text.partition(";")
        if not sep or scope not in config_mod.SCOPES:
            raise ConfigError(DRIVER_VAR, text[:80], "process;<conf>, workspace;<conf> or off "
                              "(set by the driver's plugin)", "the environment", "malformed")
        return cls(scope, config_mod.Config(**config_mod.parse(conf, DRIVER_VAR)))

    def describe(self) -> str:
        if self.scope is None:
            return "off"
        extra = ",".join(f"{k}:{v}" for k, v in (item.split(":", 1) for item in
                         self.config.to_env().split(",") if item) if k != "budget_mb")
        return (f"{self.scope} scope, budget {self.config.budget_mb} MiB"
                + (f" ({extra})" if extra else ""))

    def fingerprint(self) -> str:
        """What the ranks of one model must share."""
        if self.scope is None:
            return "off"
        return f"{self.scope} scope, {planning(self.config)}"

    def apply(self, environ) -> None:
        """Writes these settings where this process's readers look (the engine's own reader of
        VLLM_SPARSE_INDEXER_MAX_LOGITS_MB included), replacing the node's."""
        for name in (SCOPE_VAR, config_mod.ENV_VAR):
            environ.pop(name, None)
        if self.scope is not None:
            environ[SCOPE_VAR] = self.scope
            environ[config_mod.ENV_VAR] = self.config.to_env()
            if config_mod.VLLM_BUDGET_VAR in environ:
                environ[config_mod.VLLM_BUDGET_VAR] = str(self.config.budget_mb)


@dataclass(frozen=True)
class Resolved:
    settings: Settings        # what this process runs with
    own: Settings             # this node's environment's
    driver: Settings | None   # the driver's, where they reached this process

    def line(self, role: str) -> tuple[bool, str]:
        """(a warning, the one line) this process logs about its settings."""
        if self.driver is not None and self.driver != self.own:
            return True, (f"{role}: this node's settings ({self.own.describe()}) differ from the "
                          f"driver's ({self.driver.describe()}); the driver's are used, so that "
                          "every rank plans alike: set the same on every node, or none on the "
                          "workers' nodes")
        if self.settings.scope is None:
            where = "on the driver" if self.driver is not None else "on this node"
            return False, f"{role}: off: {SCOPE_VAR} unset {where}"
        source = "the driver's" if self.driver is not None else "this node's environment"
        return False, f"{role}: {self.settings.describe()} (from {source})"


def resolve(environ: Mapping[str, str] | None = None) -> Resolved:
    """This process's settings: the driver's where DRIVER_VAR carried them, else its own. A bad
    setting raises ConfigError."""
    environ = os.environ if environ is None else environ
    own = Settings.from_env(environ)
    text = environ.get(DRIVER_VAR, "")
    driver = Settings.decode(text) if text.strip() else None
    return Resolved(driver if driver is not None else own, own, driver)


def _process_name() -> str:
    """The name an operator sees in ps: the multiprocessing name, else the process's title (Ray's
    actors ``ray::<class>``, vLLM's processes), else the script's."""
    name = multiprocessing.current_process().name
    if name != "MainProcess":
        return name
    try:  # the title as ps shows it, whoever set it (Ray sets its own, vLLM's through setproctitle)
        with open("/proc/self/cmdline", "rb") as f:
            words = f.read().split(b"\0")[0].decode(errors="replace").split()
        title = os.path.basename(words[0]) if words else ""
    except OSError:  # not Linux: the script's name serves
        title = ""
    if title and not title.startswith("python"):
        return title[:40]
    return os.path.basename(sys.argv[0])[:40] if sys.argv and sys.argv[0] else "python"


def role(rank: int | None = None, world: int | None = None) -> str:
    """The process as an operator finds it: its rank once known, its name, pid and host."""
    name = _process_name()
    who = f"rank {rank} of {world}, " if rank is not None else ""
    return f"{who}{name} (pid {os.getpid()} on {socket.gethostname()})"


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}" + (
        f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def disagreement(fingerprints: list[str]) -> str | None:
    """The one line naming ranks whose settings differ (index: rank), or None when all agree."""
    groups: dict[str, list[int]] = {}
    for rank, fingerprint in enumerate(fingerprints):
        groups.setdefault(str(fingerprint)[:120], []).append(rank)
    if len(groups) < 2:
        return None
    parts = "; ".join(f"{_ranks(ranks)}: {fp}" for fp, ranks in groups.items())
    return (f"the ranks' settings differ ({parts}); every rank plans the indexer's chunks from "
            f"its budget, so they must match: set the same {SCOPE_VAR} and "
            f"{config_mod.ENV_VAR} (or {config_mod.VLLM_BUDGET_VAR}) on every node")


def gather(fingerprint: str, group=None) -> list[str] | None:
    """Every rank's fingerprint over ``group`` (the default group when None), or None where
    torch.distributed is not initialised."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, fingerprint, group=group)
    return out
