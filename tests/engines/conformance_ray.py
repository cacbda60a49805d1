"""The plugin's settings across the nodes of a real Ray cluster, with vLLM's own executor code
(tests/engines/suite.py starts it in each vLLM environment):

    python tests/engines/conformance_ray.py

prints one JSON object. It starts a Ray cluster on the loopback (ray.cluster_utils, three raylets
on 127.0.0.1, stopped at the end and bounded by an alarm): node ``a`` runs with the driver's
settings (as when ``ray start --head`` ran where ``vllm serve`` runs), node ``b`` without any
INDEXER_ARENA_* variable, node ``c`` with settings of its own that differ from the driver's.
The driver, started with the settings, loads the plugin through vLLM's own loader; then for each
of vLLM's Ray paths it builds what the workers get with vLLM's own code and starts one worker on
each node:

- vLLM 0.13 ``RayDistributedExecutor``: the copy list its ``_init_workers_ray`` builds
  (``get_env_vars_to_copy`` with the executor's exclusions and additions), vLLM's
  ``RayWorkerWrapper`` actors, their ``update_environment_variables`` and the ``init_worker``
  path's ``load_general_plugins``;
- vLLM 0.33 ``RayExecutorV2``: ``get_driver_env_vars`` and ``_build_runtime_env``, vLLM's
  ``RayWorkerProc`` actors and their ``initialize_worker`` (the driver's variables applied with
  ``setdefault``); once with the plugin loaded by the worker's init, once with it loaded when the
  actor started, before the driver's variables arrive;
- both: the data-parallel engine-core actors' runtime environment (``CoreEngineActorManager``'s
  ``get_env_vars_to_copy`` list), where the engine core loads the plugins and runs the worker.

Each worker then calls vLLM's ``Worker.init_device`` (the plugin's route on the worker's start; the
rest of it needs a GPU) with the allocator's install recorded instead of made, and reports the
scope and budget the plugin runs with there and the plugin's log lines. vLLM's full executor start
stops short of this: it needs a GPU per worker and one IP address per node.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import types

SCOPE, CONF = "INDEXER_ARENA_SCOPE", "INDEXER_ARENA_CONF"
DRIVER = {SCOPE: "workspace", CONF: "budget_mb:256"}
NODE_C = {SCOPE: "process", CONF: "budget_mb:1024"}
NODES = {"a": DRIVER, "b": {}, "c": NODE_C}
DEADLINE_S = 900


def _clean(environ) -> dict:
    return {k: v for k, v in environ.items() if not k.startswith("INDEXER_ARENA_")}


def observe(early: bool = False) -> dict:
    """Inside a worker, after vLLM applied the driver's variables and loaded the plugins: the
    worker's start as the route sees it, and what the plugin then runs with."""
    import vllm.logger  # noqa: F401 -- configures vLLM's loggers, which resets their children
    import alloc
    from alloc import engines, plugin
    lines = []
    _collect(lines)
    plugin.install = lambda config=None, *, devices=(), scope="process": config  # no GPU here
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # a no-op where vLLM's init path loaded them already
    from vllm.v1.worker import gpu_worker
    try:
        gpu_worker.Worker.init_device(types.SimpleNamespace())
    except Exception:  # noqa: BLE001 -- the rest of init_device needs a GPU
        pass
    settings = engines.active_settings()
    return {"node_env": {k: os.environ.get(k) for k in (SCOPE, CONF)},
            "scope": settings[0] if settings else None,
            "budget_mb": settings[1].budget_mb if settings else None,
            # a load before observe() was collected from then on: those lines hold these
            "log": getattr(sys.modules.get("__indexer_arena_early__"), "lines", None) or lines,
            "alloc": os.path.dirname(alloc.__file__)}


def _collect(lines: list) -> None:
    """The plugin's records under vLLM's logger, as vLLM's handlers would print them."""
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: lines.append(f"{r.levelname} {r.getMessage()}")
    logger = logging.getLogger("vllm.indexer_arena")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _early_log():
    """Collects the plugin's lines from now on, for a load before observe() runs."""
    import vllm.logger  # noqa: F401
    mod = types.ModuleType("__indexer_arena_early__")
    mod.lines = []
    _collect(mod.lines)
    sys.modules[mod.__name__] = mod


def _placed(ray, node: str, **options):
    return dict(num_cpus=0, resources={f"node_{node}": 1}, **options)


def v13_executor(ray) -> dict:
    from vllm.platforms import current_platform
    from vllm.v1.executor import ray_executor
    from vllm.v1.executor.ray_utils import RayWorkerWrapper
    E = ray_executor.RayDistributedExecutor
    names = ray_executor.get_env_vars_to_copy(  # as E._init_workers_ray calls it
        exclude_vars=E.WORKER_SPECIFIC_ENV_VARS,
        additional_vars=set(current_platform.additional_env_vars).union(E.ADDITIONAL_ENV_VARS),
        destination="workers")
    args = {name: os.environ[name] for name in names if name in os.environ}
    out = {}
    for node in NODES:
        worker = ray.remote(**_placed(ray, node))(RayWorkerWrapper).remote(
            vllm_config=types.SimpleNamespace(model_config=None), rpc_rank=0)
        ray.get(worker.update_environment_variables.remote([args]))
        out[node] = ray.get(worker.execute_method.remote(lambda self: observe()))
        ray.kill(worker)
    return out


def v33_executor(ray, early: bool) -> dict:
    from vllm.v1.executor import multiproc_executor, ray_executor_v2
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS
    driver_env = ray_executor_v2.get_driver_env_vars(worker_specific_vars=WORKER_SPECIFIC_ENV_VARS)
    fake = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        ray_runtime_env=None, ray_workers_use_nsight=False))
    runtime_env = ray_executor_v2.RayExecutorV2._build_runtime_env(fake)

    class Probe(ray_executor_v2.RayWorkerProc):
        """vLLM's RayWorkerProc; WorkerProc.__init__ (the GPU worker) is replaced by its first
        step that concerns the plugin: the worker wrapper's init_worker loads vLLM's plugins."""

        def __init__(self, early):
            if early:
                _early_log()
                from vllm.plugins import load_general_plugins
                load_general_plugins()
            config = types.SimpleNamespace(parallel_config=types.SimpleNamespace())
            super().__init__(vllm_config=config, rank=0, input_shm_handle=None,
                             is_driver_worker=True)

        def start(self, driver_env):
            from vllm.plugins import load_general_plugins
            if "__indexer_arena_early__" not in sys.modules:
                _early_log()  # the load in initialize_worker logs before observe() runs

            def init_worker(proc, **kwargs):
                load_general_plugins()
            multiproc_executor.WorkerProc.__init__ = init_worker
            self.initialize_worker(0, {}, "tcp://127.0.0.1:1", driver_env)
            return observe()

    out = {}
    for node in NODES:
        proc = ray.remote(**_placed(ray, node, runtime_env=runtime_env))(Probe).remote(early)
        out[node] = ray.get(proc.start.remote(driver_env))
        ray.kill(proc)
    return out


def dp_engine_cores(ray, version: str) -> dict:
    """The data-parallel engine-core actors' runtime environment, as CoreEngineActorManager
    builds it; the actor's EngineCore loads the plugins and runs the worker in its process."""
    from ray.runtime_env import RuntimeEnv
    from vllm.v1.engine import utils
    if version.startswith("0.13"):
        names = utils.get_env_vars_to_copy(destination="DPEngineCoreActor")
    else:
        from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS
        names = utils.get_env_vars_to_copy(destination="EngineCoreActor",
                                           exclude_vars=WORKER_SPECIFIC_ENV_VARS)
    env = RuntimeEnv(env_vars={n: os.environ[n] for n in names if n in os.environ})

    class EngineCore:
        def start(self):
            return observe()

    out = {}
    for node in NODES:
        core = ray.remote(**_placed(ray, node, runtime_env=env))(EngineCore).remote()
        out[node] = ray.get(core.start.remote())
        ray.kill(core)
    return out


def _attempt(run) -> dict:
    try:
        return run()
    except Exception as e:  # noqa: BLE001 -- reported, and counted as a failure by the suite
        return {"error": f"{type(e).__name__}: {str(e)[-600:]}"}


def driver(address: str) -> dict:
    import ray
    import vllm
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # the driver's plugin, as vllm serve loads it
    from alloc import engines
    settings = engines.active_settings()
    # Ray turns a loopback address into the host's own, where nothing listens: the cluster is on
    # 127.0.0.1 alone.
    import ray._private.services as services
    services.resolve_ip_for_localhost = lambda host: host
    ray.init(address=address, log_to_driver=False, _node_ip_address="127.0.0.1")
    paths = {"DP engine-core actors": lambda: dp_engine_cores(ray, vllm.__version__)}
    if vllm.__version__.startswith("0.13"):
        paths["RayDistributedExecutor"] = lambda: v13_executor(ray)
    else:
        paths["RayExecutorV2"] = lambda: v33_executor(ray, early=False)
        paths["RayExecutorV2, plugin loaded at actor start"] = lambda: v33_executor(ray, early=True)
    result = {"version": vllm.__version__, "ray": ray.__version__,
              "driver": {"scope": settings[0] if settings else None,
                         "budget_mb": settings[1].budget_mb if settings else None},
              "paths": {name: _attempt(run) for name, run in paths.items()}}
    ray.shutdown()
    return result


def cluster() -> int:
    """Starts the three raylets, runs the driver in a process with the driver's settings, stops
    the raylets (by the cluster's own record of its processes)."""
    from ray.cluster_utils import Cluster
    def stop(signum, frame):
        raise SystemExit(f"stopped by signal {signum}")
    for signum in (signal.SIGALRM, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)  # the raylets are stopped on the way out (finally below)
    signal.alarm(DEADLINE_S)  # bounded: a hung start ends the run, and the raylets with it
    os.environ.clear()
    os.environ.update(_clean(BASE))
    nodes = Cluster(initialize_head=True, head_node_args=dict(
        node_ip_address="127.0.0.1", num_cpus=8, num_gpus=0, resources={"node_a": 8},
        include_dashboard=False, env_vars=dict(DRIVER)))
    try:
        nodes.add_node(node_ip_address="127.0.0.1", num_cpus=8, resources={"node_b": 8})
        nodes.add_node(node_ip_address="127.0.0.1", num_cpus=8, resources={"node_c": 8},
                       env_vars=dict(NODE_C))
        nodes.wait_for_nodes()
        env = {**_clean(BASE), **DRIVER, "RAY_USAGE_STATS_ENABLED": "0"}
        done = subprocess.run([sys.executable, __file__, "driver", nodes.address], env=env,
                              capture_output=True, text=True, timeout=DEADLINE_S - 60, cwd="/")
        sys.stderr.write(done.stderr[-6000:])
        sys.stdout.write(done.stdout)
        return done.returncode
    finally:
        nodes.shutdown()


BASE = dict(os.environ)

if __name__ == "__main__":
    if sys.argv[1:2] == ["driver"]:
        started = time.monotonic()
        out = driver(sys.argv[2])
        out["seconds"] = round(time.monotonic() - started)
        print(json.dumps(out))
    else:
        sys.exit(cluster())
