"""The command line's boundary for the commands without options of their own: --help describes
them and does nothing else, anything else is refused with exit status 2, and a reader that goes
away early is not an error."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, env=None, **kw):
    module = "arena_tools" if args and args[0] in ("fit", "report", "replay") else "alloc"
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=300, **kw)


@pytest.mark.parametrize("command", ["keys", "devices", "build-shim"])
def test_help_describes_and_does_nothing_else(command, tmp_path):
    done = cli(command, "--help", env={"INDEXER_ARENA_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0 and done.stdout.startswith(f"usage: python -m alloc {command}")
    assert not (tmp_path / "cache").exists()  # build-shim --help builds nothing


@pytest.mark.parametrize("command", ["keys", "devices", "build-shim"])
def test_arguments_they_do_not_take_are_refused(command):
    done = cli(command, "--bogus")
    assert done.returncode == 2 and done.stdout == ""
    assert "unrecognized arguments: --bogus" in done.stderr and "Traceback" not in done.stderr


def test_a_reader_that_went_away_is_no_error():
    # `keys | head -1`: the reading end is closed before anything is written, so the first write
    # meets a broken pipe whatever the pipe's buffer holds.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "alloc", "keys"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, timeout=300)
    finally:
        os.close(write_end)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


@pytest.mark.parametrize("command", ["fit", "report", "replay"])
def test_a_tool_asked_of_the_runtime_names_its_new_command(command):
    done = subprocess.run([sys.executable, "-m", "alloc", command, "x"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert f"python -m arena_tools {command}" in done.stderr


def test_the_tools_command_line_offers_the_runtime_commands():
    done = cli_tools("keys")
    assert done.returncode == 0 and "budget_mb" in done.stdout, done.stderr
    done = cli_tools("keys", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m arena_tools keys")


def cli_tools(*args):
    return subprocess.run([sys.executable, "-m", "arena_tools", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_an_unknown_command_is_one_line_and_exit_two():
    done = cli("frobnicate")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "commands: keys" in done.stderr


CSV = ("Thread,Time,Action,Pointer,Size,Stream,Device,Pool\n"
       "1,00:00:00.000001,allocate,0x1000,4096,0,0,workspace\n1,00:00:00.000002,free,0x1000,4096,0,0,workspace\n")


@pytest.mark.parametrize("command, flag", [("report", "--json"), ("report", "--png"), ("report", "--text"),
                                           ("replay", "--json")])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, command, flag):
    trace = tmp_path / "trace.csv"
    trace.write_text(CSV)
    for out in (tmp_path / "missing" / "out", tmp_path):  # a folder that is not there; a folder
        args = [command, str(trace), flag, str(out)] + (["--allocators", "host"] if command == "replay" else [])
        done = cli(*args)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and flag in done.stderr, done.stderr
        assert done.stdout == "" and not (tmp_path / "missing").exists()


@pytest.mark.parametrize("command", ["report", "replay"])
def test_a_bad_configuration_is_one_line(tmp_path, command):
    trace = tmp_path / "trace.csv"
    trace.write_text(CSV.replace(",workspace\n", ",general\n"))  # no budget recorded: the configuration's
    done = cli(command, str(trace), *(["--allocators", "host"] if command == "replay" else []),
               env={"INDEXER_ARENA_CONF": "budget_mb:lots"})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "budget_mb" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("value", ["-5", "0"])
def test_report_refuses_a_budget_that_is_not_positive(tmp_path, value):
    trace = tmp_path / "trace.csv"
    trace.write_text(CSV)
    done = cli("report", str(trace), "--budget-mb", value)
    assert done.returncode == 2 and "--budget-mb" in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.parametrize("args", [["--prompt-tokens", "-5"], ["--budget-mb", "0"], ["--json", "/nonexistent/x.json"]])
def test_the_main_job_refuses_bad_flags_before_running(args):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "seed_workload.py"), *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "error:" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stdout == ""


def test_the_main_jobs_help_is_whole():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "seed_workload.py"), "--help"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "512 MiB budget)." in " ".join(done.stdout.split())


def test_fit_refuses_an_infinite_memory():
    done = cli("fit", "--available-mb", "inf")
    assert done.returncode == 2 and "--available-mb" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("columns", [80, 110])
def test_tables_fit_the_terminal(tmp_path, monkeypatch, capsys, columns):
    from arena_tools import replay, report
    trace = tmp_path / "trace.csv"
    trace.write_text(CSV)
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert report.main([str(trace)]) == 0
    assert replay.main([str(trace), "--allocators", "host", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(map(len, lines)) <= columns


def test_a_replay_with_failures_the_recording_did_not_have_exits_one(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(CSV.replace(",4096,", f",{3 << 20},"))  # 3 MiB workspaces
    assert cli("replay", str(trace), "--allocators", "host", "--budget-mb", "4", "--no-progress").returncode == 0
    done = cli("replay", str(trace), "--allocators", "host", "--budget-mb", "2", "--no-progress")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr


def _fake_snapshot(segments: int) -> dict:
    trace = []
    for i in range(segments):
        at = (1 << 30) + i * (1 << 24)
        trace += [{"action": action, "addr": at, "size": size, "stream": 0, "time_us": i,
                   "frames": [{"filename": "work.py", "line": 1, "name": "piece"}]}
                  for action, size in (("segment_alloc", 1 << 24), ("alloc", 1 << 20),
                                       ("free_requested", 1 << 20), ("free_completed", 1 << 20))]
    return {"segments": [], "device_traces": [trace]}


def test_the_memory_viz_example_draws_both_snapshots_and_says_which_is_missing(tmp_path):
    import pickle
    script = [sys.executable, os.path.join(ROOT, "examples", "memory_viz.py"), str(tmp_path), "--render"]
    with open(tmp_path / "default.pickle", "wb") as f:
        pickle.dump(_fake_snapshot(3), f)
    done = subprocess.run(script, capture_output=True, text=True)
    assert done.returncode == 2 and "no snapshot of arena" in done.stderr.splitlines()[-1], done.stderr
    with open(tmp_path / "arena.pickle", "wb") as f:
        pickle.dump(_fake_snapshot(1), f)
    done = subprocess.run(script, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for name in ("memory_viz.png", "default.html", "arena.html"):
        assert (tmp_path / name).stat().st_size > 500, name
