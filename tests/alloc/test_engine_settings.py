"""The engine plugin's settings across the processes and nodes of a distributed engine, on the CPU
(alloc/engine_settings.py; the routes in alloc/engine_plugin.py): what the driver adds to what the
engine copies to its workers, a worker started with only what was copied (on a node without the
variables), settings that arrive after the plugin loaded, a node whose own settings differ, the
one line each process logs, and ranks whose settings differ named at start over a real gloo group
(the plugin's check and tp.launch's). A stand-in module copies by vLLM 0.13's rule (the names it
registers, plus the caller's); tests/engines/conformance_ray.py runs vLLM's own code on a Ray
cluster."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alloc import engine_settings as es
from tests.support import ROOT, fake_package, run_python

DRIVER = {es.SCOPE_VAR: "workspace", "INDEXER_ARENA_CONF": "budget_mb:256"}
NODE_OWN = {es.SCOPE_VAR: "process", "INDEXER_ARENA_CONF": "budget_mb:1024"}

RAY_ENV = '''
import os
REGISTERED = {"VLLM_HOST_IP", "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"}

def get_env_vars_to_copy(exclude_vars=None, additional_vars=None, destination=None):
    """vLLM 0.13's rule: the names vLLM registers and the caller's, less the excluded."""
    return {v for v in REGISTERED | set(additional_vars or ()) if v not in (exclude_vars or ())}
'''

WORKER = '''
class Worker:
    def init_device(self):
        return "device"
'''

PRELUDE = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
sys.path.insert(0, {path!r})
from alloc import engines, plugin
from tests.support.host_plugin import install_on_host
plugin.install = lambda config, scope: install_on_host(config, scope)
fake = engines.Engine("Fake", "indexer-arena", ("0.1.0",), (
    engines.Route("fake_engine.worker", "Worker.init_device", engines.starting_worker_first,
                  always=True),
    engines.Route("fake_engine.ray_env", "get_env_vars_to_copy", engines.carrying_settings,
                  eager=False, always=True),
), "fake.indexer_arena")
"""

DRIVER_SIDE = """
engines.load(fake)
from fake_engine import ray_env
names = ray_env.get_env_vars_to_copy(exclude_vars={"VLLM_HOST_IP"}, destination="workers")
print("COPIED", json.dumps({n: os.environ[n] for n in sorted(names) if n in os.environ}))
"""

WORKER_SIDE = """
early = json.loads(os.environ.pop("LATE", "{}"))
engines.load(fake)
for k, v in early.items():  # the driver's variables applied after the plugin loaded,
    os.environ.setdefault(k, v)  # as vLLM 0.33's RayExecutorV2.initialize_worker applies them
from fake_engine.worker import Worker
Worker().init_device()
print("RUNS", plugin.installed_scope() if plugin.is_installed() else None,
      plugin.installed_config().budget_mb if plugin.is_installed() else None,
      os.environ.get("INDEXER_ARENA_SCOPE"))
"""


@pytest.fixture
def fake_path(tmp_path):
    return str(fake_package(tmp_path, {"ray_env": RAY_ENV, "worker": WORKER}))


def _node_env(own: dict) -> dict:
    """A node's environment: this one's without any INDEXER_ARENA_* variable, plus ``own``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INDEXER_ARENA_")
           and k != "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, **own}


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=120, cwd=ROOT)


def _plugin_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "indexer-arena:" in line]


def _copied(fake_path) -> dict:
    done = _run(PRELUDE.format(path=fake_path) + DRIVER_SIDE, _node_env(DRIVER))
    assert done.returncode == 0, done.stderr[-3000:]
    copied = json.loads(done.stdout.split("COPIED ", 1)[1].splitlines()[0])
    lines = _plugin_lines(done.stdout)
    assert len(lines) == 1 and lines[0].startswith("INFO indexer-arena: ") and lines[0].endswith(
        ": workspace scope, budget 256 MiB (from this node's environment)"), done.stdout
    return copied


def test_the_driver_adds_its_settings_to_what_the_engine_copies(fake_path):
    copied = _copied(fake_path)
    assert {k: copied.get(k) for k in (*DRIVER, es.DRIVER_VAR)} == {
        **DRIVER, es.DRIVER_VAR: "workspace;budget_mb:256"}
    assert "VLLM_HOST_IP" not in copied  # what the caller excluded stays out


def _worker(fake_path, own: dict, copied: dict, late: bool = False):
    env = _node_env(own)
    if late:
        env["LATE"] = json.dumps(copied)
    else:  # at the process's start, a node's own value winning (vLLM 0.33's setdefault)
        for k, v in copied.items():
            env.setdefault(k, v)
    done = _run(PRELUDE.format(path=fake_path) + WORKER_SIDE, env)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = done.stdout.split("RUNS ", 1)[1].split()
    return runs, _plugin_lines(done.stdout)


def test_a_worker_on_a_node_without_the_variables_runs_with_the_drivers(fake_path):
    runs, lines = _worker(fake_path, {}, _copied(fake_path))
    assert runs == ["workspace", "256", "workspace"]
    assert len(lines) == 2 and lines[0].endswith(
        ": workspace scope, budget 256 MiB (from the driver's)"), lines
    assert "Fake" in lines[1] and "routes applied" in lines[1]  # the worker's start


def test_settings_that_arrive_after_the_plugin_loaded_are_taken_at_the_workers_start(fake_path):
    runs, lines = _worker(fake_path, {}, _copied(fake_path), late=True)
    assert runs == ["workspace", "256", "workspace"]
    assert lines[0].startswith("INFO indexer-arena: ") and lines[0].endswith(
        ": off: INDEXER_ARENA_SCOPE unset on this node"), lines
    assert lines[1].endswith(": workspace scope, budget 256 MiB (from the driver's); taken at "
                             "the worker's start, after the plugin loaded"), lines
    assert len(lines) == 3


def test_without_the_variables_anywhere_the_worker_says_it_is_off(fake_path):
    runs, lines = _worker(fake_path, {}, {})
    assert runs == ["None", "None", "None"]
    assert len(lines) == 1 and lines[0].endswith(": off: INDEXER_ARENA_SCOPE unset on this node")


@pytest.mark.parametrize("late", [False, True])
def test_a_node_whose_own_settings_differ_says_so_in_one_line_and_takes_the_drivers(fake_path,
                                                                                      late):
    runs, lines = _worker(fake_path, NODE_OWN, _copied(fake_path), late=late)
    assert runs == ["workspace", "256", "workspace"]
    differ = [line for line in lines if "differ from the driver's" in line]
    assert len(differ) == 1 and differ[0].startswith("WARNING indexer-arena: "), lines
    assert ("this node's settings (process scope, budget 1024 MiB) differ from the driver's "
            "(workspace scope, budget 256 MiB); the driver's are used") in differ[0]


def _refusal(done: subprocess.CompletedProcess) -> str:
    """The one line a refused process printed (through the engine's logger, set to print
    ``LEVEL message`` here), once, without a traceback; status 1."""
    assert done.returncode == 1 and "went on" not in done.stdout, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines()
             if line.startswith("ERROR indexer-arena: ")]
    assert len(lines) == 1, done.stdout + done.stderr
    return lines[0].removeprefix("ERROR ")


def test_a_malformed_driver_variable_ends_the_process_with_one_line(fake_path):
    done = _run(PRELUDE.format(path=fake_path) + "engines.load(fake)\nprint('went on')",
                _node_env({es.DRIVER_VAR: "everywhere"}))
    assert _refusal(done).startswith(
        "indexer-arena: invalid value 'everywhere' for 'INDEXER_ARENA_DRIVER'")


@given(st.lists(st.sampled_from(["off", "workspace scope, budget_mb 256, alignment 256",
                                 "workspace scope, budget_mb 512, alignment 256",
                                 "process scope, budget_mb 256, alignment 256"]),
                min_size=1, max_size=40))
def test_disagreement_names_every_distinct_setting_or_none(fingerprints):
    line = es.disagreement(fingerprints)
    if len(set(fingerprints)) == 1:
        assert line is None
        return
    assert line is not None and "\n" not in line and len(line) < 1200
    for fp in set(fingerprints):
        first = fingerprints.index(fp)
        assert f": {fp}" in line
        assert str(first) in line  # the first rank of each group is named


@given(st.sampled_from([None, "process", "workspace"]), st.integers(1, 4096),
       st.sampled_from([16, 256, 4096]))
def test_settings_round_trip_through_the_drivers_variable(scope, budget_mb, alignment):
    from alloc import config
    settings = es.Settings(scope, config.Config(budget_mb=budget_mb, alignment=alignment)
                           if scope else None)
    assert es.Settings.decode(settings.encode()) == settings


# --- ranks over a real gloo group -------------------------------------------------------------

RANK_CHECK = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
import torch.distributed as dist
from alloc import engines
fake = engines.Engine("Fake", "indexer-arena", ("0.1.0",), (), "fake.indexer_arena")
engines.load(fake)
dist.init_process_group("gloo", init_method="env://")
engines.check_ranks()
print("went on")
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(argv: list[str], envs: list[dict]) -> list[subprocess.CompletedProcess]:
    port = str(_free_port())
    procs = [subprocess.Popen(argv, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={
                                  **_node_env(own), "RANK": str(rank), "WORLD_SIZE": "2",
                                  "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for rank, own in enumerate(envs)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(argv, p.returncode, stdout, stderr))
    return out


@pytest.mark.parametrize("second", [DRIVER, {**DRIVER, "INDEXER_ARENA_CONF": "budget_mb:512"}, {}])
def test_the_plugins_ranks_compare_their_settings_at_start(second):
    ranks = _two_ranks([sys.executable, "-c", RANK_CHECK], [DRIVER, second])
    if second == DRIVER:
        for rank, done in enumerate(ranks):
            assert done.returncode == 0, done.stderr[-2000:]
            line = _plugin_lines(done.stdout)[-1]
            assert line.startswith(f"INFO indexer-arena: rank {rank} of 2, ") and line.endswith(
                ": the 2 ranks' settings agree: workspace scope, budget_mb 256, alignment 256")
        return
    theirs = "off" if not second else "workspace scope, budget_mb 512, alignment 256"
    for rank, done in enumerate(ranks):  # every rank stops, with the same one line
        last = _refusal(done)
        assert last.startswith(f"indexer-arena: rank {rank} of 2, ") and (
            "the ranks' settings differ (rank 0: workspace scope, budget_mb 256, alignment 256; "
            f"rank 1: {theirs}); every rank plans the indexer's chunks") in last, last


def test_tp_launch_names_ranks_started_with_another_budget(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("print('went on')\n")
    argv = [sys.executable, "-m", "tp.launch", "--allocator", "none", str(script)]
    ranks = _two_ranks(argv, [DRIVER, {"INDEXER_ARENA_CONF": "budget_mb:512"}])
    for rank, done in enumerate(ranks):
        assert done.returncode == 2 and "went on" not in done.stdout, done.stderr[-2000:]
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"tp.launch: rank {rank} of 2: the ranks' settings differ (rank 0: "
                               "allocator none, budget_mb 256, alignment 256; rank 1: allocator "
                               "none, budget_mb 512, alignment 256)"), last
    same = _two_ranks(argv, [DRIVER, DRIVER])
    assert all(d.returncode == 0 and "went on" in d.stdout for d in same), same[0].stderr[-2000:]
