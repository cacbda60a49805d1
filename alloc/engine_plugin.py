"""How the engine plugins load, route and report (the routes themselves: alloc/engines.py).

vLLM loads every ``vllm.general_plugins`` entry point in each process it starts (the API server,
the engine core, the model-inspection subprocess, every worker: ``load_general_plugins``) and does
not catch a plugin's exception; SGLang loads ``sglang.srt.plugins`` in its main, detokenizer and
scheduler processes (``load_plugins``) and logs and swallows any ``Exception``. This package
registers one entry point in each group, named ``indexer_arena``. Both read:

    INDEXER_ARENA_SCOPE   process or workspace: install the allocator in that scope
                          (unset or empty: the plugin installs nothing)
    INDEXER_ARENA_CONF, VLLM_SPARSE_INDEXER_MAX_LOGITS_MB: the configuration, as everywhere
    INDEXER_ARENA_DRIVER  the driver's settings, carried to the workers (alloc/engine_settings.py)

In every process the plugin checks the settings (a bad one ends the process with one line, which
neither engine can swallow: SystemExit), logs one line naming the process and its settings or why
it is off, and registers its routes, which wrap engine functions in place now or as soon as their
module is imported. Off, it registers only the routes marked ``always``: those that carry the
settings to the workers, and the worker's start, where settings that arrived after the plugin
loaded are taken up and the ranks compare theirs. Only a process that runs the model acts: the
route on the worker's start (vLLM ``Worker.init_device``, SGLang ``Scheduler.__init__``) installs
the allocator there, imports the routes' modules and logs once, at INFO, the engine's version and
the routes applied; after the engine made its process group, the ranks' settings are compared
(one line naming the rank, or one line naming the ranks that differ, which ends the process).
What the routes are, and the entry points, are in ``alloc.engines``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.metadata
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from . import config as config_mod
from . import engine_settings as settings_mod
from .engine_settings import SCOPE_VAR, Resolved, Settings, scope_from_env  # noqa: F401
from .errors import ArenaError, ConfigError


@dataclass(frozen=True)
class Route:
    """``module.attribute`` (or ``module.Class.method``) is replaced by ``wrap`` of it.

    ``versions``: the engine versions whose code has this target (empty: all). ``eager``: the
    worker imports ``module`` at its start, so the route is applied (and logged) then; a kernel
    library the engine imports lazily (deep_gemm) is routed when the engine imports it.
    ``always``: registered with the plugin off too (the settings' carriers, the worker's start)."""
    module: str
    attribute: str
    wrap: Callable[[Callable], Callable]
    versions: tuple[str, ...] = ()
    eager: bool = True
    always: bool = False

    def __str__(self) -> str:
        return f"{self.module}.{self.attribute}"


@dataclass(frozen=True)
class Engine:
    label: str                  # for messages: "vLLM"
    distribution: str           # whose version is read: "vllm"
    supported: tuple[str, ...]  # the versions the routes were read from, oldest first
    routes: tuple[Route, ...]
    logger: str                 # a logger under the engine's own, so its handlers print ours
    world_group: Callable[[], object] | None = None  # the engine's CPU group of all its ranks

    def version(self) -> str | None:
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def routes_for(self, version: str | None) -> tuple[Route, ...]:
        """The routes for ``version``; a version the routes were not read from gets the newest's."""
        chosen = version if version in self.supported else self.supported[-1]
        return tuple(r for r in self.routes if not r.versions or chosen in r.versions)


@dataclass
class _Active:
    engine: Engine
    version: str | None
    settings: Settings
    routes: tuple[Route, ...]
    started: bool = False   # this process runs the model: the allocator is installed
    lock: threading.Lock = field(default_factory=threading.Lock)


    @property
    def scope(self) -> str:
        return self.settings.scope

    @property
    def config(self) -> config_mod.Config:
        return self.settings.config


_active: _Active | None = None
_engine: Engine | None = None     # the engine whose entry point loaded the plugin here
_resolved: Resolved | None = None  # the settings this process took, and where from
_ranks_checked = False


def load(engine: Engine, environ: Mapping[str, str] | None = None) -> str | None:
    """What each entry point does: checks the settings, logs the process's one line and registers
    ``engine``'s routes for its installed version; returns the scope, or None when the plugin is
    off here (then only the routes marked ``always`` are registered). A bad setting ends the
    process with one line (``refuse``)."""
    global _engine
    environ = os.environ if environ is None else environ
    resolved = _resolve(engine.logger, environ)
    _engine = engine
    for route in engine.routes_for(engine.version()):
        if route.always:
            _after_import.apply(route)
    _log_settings(engine, resolved)
    return _activate(engine, resolved, environ)


def _resolve(logger: str, environ: Mapping[str, str]) -> Resolved:
    try:
        return settings_mod.resolve(environ)
    except ConfigError as e:
        refuse(logger, str(e))


def _log_settings(engine: Engine, resolved: Resolved, why: str = "") -> None:
    warn, line = resolved.line(settings_mod.role())
    log = logging.getLogger(engine.logger)
    (log.warning if warn else log.info)("indexer-arena: %s%s", line, why)


def _activate(engine: Engine, resolved: Resolved, environ) -> str | None:
    """Takes ``resolved`` as this process's settings: the driver's replace the node's in the
    environment, and with a scope the engine's routes are registered."""
    global _active, _resolved
    _resolved = resolved
    if resolved.driver is not None and resolved.driver != resolved.own:
        resolved.settings.apply(environ)
    if resolved.settings.scope is None:
        _active = None
        return None
    version = engine.version()
    _active = _Active(engine, version, resolved.settings, engine.routes_for(version))
    for route in _active.routes:
        _after_import.apply(route)
    return resolved.settings.scope


def current_settings() -> Settings:
    """This process's settings: those the plugin took, or the environment's where it has not
    loaded (a bad setting ends the process with one line)."""
    if _resolved is not None:
        return _resolved.settings
    return _resolve(_engine.logger if _engine else __name__, os.environ).settings


def refuse(logger: str, message: str):
    """Ends the process with one line: logged at ERROR through the engine's logger and raised as
    SystemExit, which vLLM does not catch and SGLang's ``except Exception`` does not swallow. The
    line is printed once: by the logger, or (logging switched off) by the interpreter, as the
    SystemExit's message, without a traceback."""
    line = f"indexer-arena: {message}"
    log = logging.getLogger(logger)
    if log.isEnabledFor(logging.ERROR):  # printed by the engine's handlers, or logging's last resort
        log.error(line)
        raise SystemExit(1)  # the line is out: the interpreter must not print it a second time
    raise SystemExit(line)


def _take_late_settings() -> None:
    """At a worker's start: settings that reached the environment after the plugin loaded (vLLM
    0.33's Ray workers get the driver's in ``initialize_worker``, after vLLM may have loaded its
    plugins) are taken, with one line."""
    engine = _engine
    if engine is None or (_active is not None and _active.started):
        return
    resolved = _resolve(engine.logger, os.environ)
    if _resolved is not None and resolved.settings == _resolved.settings:
        return
    _log_settings(engine, resolved, "; taken at the worker's start, after the plugin loaded")
    _activate(engine, resolved, os.environ)


def start_worker() -> None:
    """In a process that runs the model, once: takes settings that arrived late, installs the
    allocator, imports the routes' modules (so that every route is applied now) and logs the
    engine's version and the routes."""
    _take_late_settings()
    active = _active
    if active is None or active.started:
        return
    with active.lock:
        if active.started:
            return
        from . import plugin
        try:
            plugin.install(active.config, scope=active.scope)
        except ArenaError as e:
            refuse(active.engine.logger, f"the allocator was not installed: {e}")
        active.started = True
        for module in sorted({r.module for r in active.routes if r.eager}):
            try:
                importlib.import_module(module)
            except Exception:  # noqa: BLE001 -- reported below as routes that found nothing
                pass
    _log_routes(active)


def _log_routes(active: _Active) -> None:
    status = route_status()
    log = logging.getLogger(active.engine.logger)
    version = active.version or "(version unknown)"
    applied = [str(r) for r in active.routes if status.get(r) == "applied"]
    pending = [str(r) for r in active.routes if status.get(r) == "pending"]
    missing = [str(r) for r in active.routes if status.get(r) == "missing"]
    log.info("indexer-arena: %s %s, %s scope, budget %d MiB; routes applied: %s%s",
             active.engine.label, version, active.scope, active.config.budget_mb,
             ", ".join(applied) or "none",
             f"; routed when the engine imports them: {', '.join(pending)}" if pending else "")
    if active.version not in active.engine.supported:
        log.warning("indexer-arena: %s %s is not a version the routes were read from (%s); those "
                    "of %s are applied where they find their target", active.engine.label, version,
                    ", ".join(active.engine.supported), active.engine.supported[-1])
    if missing:
        log.warning("indexer-arena: %s %s lacks what these routes wrap, so they do nothing: %s",
                    active.engine.label, version, ", ".join(missing))


def active_settings() -> tuple[str, config_mod.Config] | None:
    """The scope and configuration the plugin was loaded with in this process, or None."""
    return (_active.scope, _active.config) if _active else None


def route_status() -> dict[Route, str]:
    """Each route registered in this process: "applied" (its target is wrapped), "pending" (its
    module is not imported yet) or "missing" (the module, or the attribute in it, is absent)."""
    return _after_import.status()


def _replace(module, route: Route) -> bool:
    """Wraps the route's target in ``module``; False when the module lacks it."""
    owner_path, _, name = route.attribute.rpartition(".")
    owner = module
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part, None)
    original = getattr(owner, name, None) if owner is not None else None
    if original is None:
        return False
    if getattr(original, "__indexer_arena_route__", None) != route:
        wrapped = route.wrap(original)
        wrapped.__indexer_arena_route__ = route
        if isinstance(owner, type) and isinstance(owner.__dict__.get(name), staticmethod):
            wrapped = staticmethod(wrapped)
        setattr(owner, name, wrapped)
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Applies routes to modules loaded already, and to the others right after they load."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[str, list[Route]] = {}
        self._status: dict[Route, str] = {}

    def status(self) -> dict[Route, str]:
        with self._lock:
            return dict(self._status)

    def apply(self, route: Route) -> None:
        with self._lock:
            module = sys.modules.get(route.module)
            if module is None:
                self._pending.setdefault(route.module, []).append(route)
                self._status[route] = "pending"
                if self not in sys.meta_path:
                    sys.meta_path.insert(0, self)
                return
        self._done(module, [route])

    def _done(self, module, routes) -> None:
        results = {route: "applied" if _replace(module, route) else "missing" for route in routes}
        with self._lock:
            self._status.update(results)

    def find_spec(self, name, path, target=None):
        # The routes stay pending until the module executes: importlib.util.find_spec asks for a
        # spec without loading it (vLLM's has_deep_gemm does), and the import asks again.
        with self._lock:
            routes = list(self._pending.get(name, ()))
        if not routes:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_route(module):
            exec_module(module)
            with self._lock:
                routes = self._pending.pop(name, [])
            self._done(module, routes)

        spec.loader.exec_module = exec_then_route
        return spec


_after_import = _AfterImport()


def check_ranks() -> None:
    """Once, in a model process whose engine has made its process group: every rank's settings
    (``Settings.fingerprint``) gathered over the engine's group of all its ranks; one INFO line
    naming this rank, or one line naming the ranks that differ, which ends the process on every
    rank alike (each sees the same gathered list), before any collective could hang on it."""
    global _ranks_checked
    engine = _engine
    if engine is None or _ranks_checked:
        return
    _ranks_checked = True
    group = None
    if engine.world_group is not None:
        try:
            group = engine.world_group()
        except Exception:  # noqa: BLE001 -- no engine group: the default group serves
            group = None
    mine = current_settings().fingerprint()
    gathered = settings_mod.gather(mine, group)
    if gathered is None:
        return
    import torch.distributed as dist
    who = settings_mod.role(dist.get_rank(), dist.get_world_size())
    bad = settings_mod.disagreement(gathered)
    if bad:
        _end_process_groups()
        refuse(engine.logger, f"{who}: {bad}")
    logging.getLogger(engine.logger).info("indexer-arena: %s: the %d ranks' settings agree: %s",
                                          who, len(gathered), mine)


def _end_process_groups() -> None:
    """Before a refusal ends the process: its process groups closed, since a gloo group's threads
    left running abort the interpreter's exit ("terminate called ...": status -6, a second line)."""
    import torch.distributed as dist
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- the line that follows matters, not the teardown
        pass


def starting_worker_first(fn: Callable) -> Callable:
    """``fn`` after ``start_worker()``, then ``check_ranks()``: the route on the call that starts
    a model process (and makes its process group)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        start_worker()
        done = fn(*args, **kwargs)
        check_ranks()
        return done
    return call


def carrying_settings(fn: Callable) -> Callable:
    """A function of the engine's that lists what the driver copies to its workers (names, or a
    mapping of names to values): this process's settings are set in DRIVER_VAR first, and the
    plugin's variables are added to the names (less those the caller excluded)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        os.environ[settings_mod.DRIVER_VAR] = current_settings().encode()
        copied = fn(*args, **kwargs)
        if isinstance(copied, dict):
            return copied  # the driver's whole environment, DRIVER_VAR included
        excluded = set(kwargs.get("exclude_vars") or ())
        return set(copied) | (set(settings_mod.CARRIED) - excluded)
    return call
