"""The trace written to a file at exit (the trace_file key), as RMM's logging adaptor leaves its
log: on the host backend, in a fresh interpreter (the plugin is configured once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

from alloc.config import Config, from_env
from tests.support import ROOT

PROGRAM = """
import sys
from alloc._lib import ffi, lib
from alloc import ring as trace
c = ffi.new("ia_plugin_config_t *")
c.budget, c.alignment, c.unified, c.host_memory = 64 << 20, 256, 0, 1
assert lib.ia_plugin_configure(c) == lib.IA_OK
trace.write_at_exit(sys.argv[1], int(sys.argv[2]))

def alloc(size, stream=1):
    return lib.ia_torch_alloc(size, 0, ffi.cast("void *", stream), ffi.NULL)

for size in (4096, 3 << 20, 5 << 20):
    lib.ia_torch_free(alloc(size))
lib.ia_workspace_enter(); p = alloc(1 << 20); lib.ia_workspace_exit()
lib.ia_torch_free(p)
print("ok")
"""


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_the_key_is_a_path_and_off_by_default():
    assert Config().trace_file is None
    assert from_env({"INDEXER_ARENA_CONF": "trace_file:/tmp/t.csv"}).trace_file == "/tmp/t.csv"


def test_the_trace_is_written_at_exit_and_converts_to_a_snapshot(tmp_path):
    path = tmp_path / "trace.csv"
    done = run_python(PROGRAM, str(path), "0")
    assert done.returncode == 0 and done.stdout.strip() == "ok" and done.stderr == "", done.stderr
    lines = path.read_text().splitlines()
    assert lines[0] == "Thread,Time,Action,Pointer,Size,Stream,Device,Pool"
    actions = [(line.split(",")[2], int(line.split(",")[4]), line.split(",")[7]) for line in lines[1:]]
    assert actions == [("allocate", 4096, "small"), ("free", 4096, "small"),
                       ("allocate", 3 << 20, "large"), ("free", 3 << 20, "large"),
                       ("allocate", 5 << 20, "large"), ("free", 5 << 20, "large"),
                       ("allocate", 1 << 20, "workspace"), ("free", 1 << 20, "workspace")]
    snapshot = tmp_path / "trace.pickle"
    done = subprocess.run([sys.executable, "-m", "arena_tools", "convert", str(path), str(snapshot)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0 and snapshot.stat().st_size > 0, done.stderr


def test_a_full_ring_and_an_unwritable_file_are_said_once(tmp_path):
    done = run_python(PROGRAM, str(tmp_path / "trace.csv"), "3")
    assert done.returncode == 0
    [line] = done.stderr.splitlines()
    # 11 events: the 8 above and 3 region reservations, which RMM's CSV has no action for
    assert "the last 3 events; the ring dropped 8 older ones" in line
    done = run_python(PROGRAM, str(tmp_path / "missing" / "trace.csv"), "0")
    assert done.returncode == 0 and not os.path.exists(tmp_path / "missing")
    [line] = done.stderr.splitlines()
    assert "could not write the trace to" in line and "(trace_file)" in line
