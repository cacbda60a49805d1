"""How the engine plugins load, route and report (the routes themselves: alloc/engines.py).

vLLM loads every ``vllm.general_plugins`` entry point in each process it starts (the API server,
the engine core, the model-inspection subprocess, every worker: ``load_general_plugins``) and does
not catch a plugin's exception; SGLang loads ``sglang.srt.plugins`` in its main, detokenizer and
scheduler processes (``load_plugins``) and logs and swallows any ``Exception``. This package
registers one entry point in each group, named ``indexer_arena``. Both read:

    INDEXER_ARENA_SCOPE   process or workspace: install the allocator in that scope
                          (unset or empty: the plugin does nothing)
    INDEXER_ARENA_CONF, VLLM_SPARSE_INDEXER_MAX_LOGITS_MB: the configuration, as everywhere

In every process the plugin checks the settings (a bad one ends the process with one line, which
neither engine can swallow: SystemExit) and registers its routes, which wrap engine functions in
place now or as soon as their module is imported. Only a process that runs the model acts: the
route on the worker's start (vLLM ``Worker.init_device``, SGLang ``Scheduler.__init__``) installs
the allocator there, imports the routes' modules and logs once, at INFO, the engine's version and
the routes applied. What the routes are, and the entry points, are in ``alloc.engines``.
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
from .errors import ArenaError, ConfigError

SCOPE_VAR = "INDEXER_ARENA_SCOPE"


@dataclass(frozen=True)
class Route:
    """``module.attribute`` (or ``module.Class.method``) is replaced by ``wrap`` of it.

    ``versions``: the engine versions whose code has this target (empty: all). ``eager``: the
    worker imports ``module`` at its start, so the route is applied (and logged) then; a kernel
    library the engine imports lazily (deep_gemm) is routed when the engine imports it."""
    module: str
    attribute: str
    wrap: Callable[[Callable], Callable]
    versions: tuple[str, ...] = ()
    eager: bool = True

    def __str__(self) -> str:
        return f"{self.module}.{self.attribute}"


@dataclass(frozen=True)
class Engine:
    label: str                  # for messages: "vLLM"
    distribution: str           # whose version is read: "vllm"
    supported: tuple[str, ...]  # the versions the routes were read from, oldest first
    routes: tuple[Route, ...]
    logger: str                 # a logger under the engine's own, so its handlers print ours

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
    scope: str
    config: config_mod.Config
    routes: tuple[Route, ...]
    started: bool = False   # this process runs the model: the allocator is installed
    lock: threading.Lock = field(default_factory=threading.Lock)


_active: _Active | None = None


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


def load(engine: Engine, environ: Mapping[str, str] | None = None) -> str | None:
    """What each entry point does: checks the settings and registers ``engine``'s routes for its
    installed version; returns the scope, or None (changing nothing) when INDEXER_ARENA_SCOPE is
    unset. A bad setting ends the process with one line (``refuse``)."""
    global _active
    environ = os.environ if environ is None else environ
    try:
        scope = scope_from_env(environ)
        if scope is None:
            return None
        config = config_mod.from_env(environ)
    except ConfigError as e:
        refuse(engine.logger, str(e))
    version = engine.version()
    _active = _Active(engine, version, scope, config, engine.routes_for(version))
    for route in _active.routes:
        _after_import.apply(route)
    return scope


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


def start_worker() -> None:
    """In a process that runs the model, once: installs the allocator, imports the routes' modules
    (so that every route is applied now) and logs the engine's version and the routes."""
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


def starting_worker_first(fn: Callable) -> Callable:
    """``fn`` after ``start_worker()``: the route on the call that starts a model process."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        start_worker()
        return fn(*args, **kwargs)
    return call
