"""The command line's boundary for the commands without options of their own: --help describes
them and does nothing else, anything else is refused with exit status 2, and a reader that goes
away early is not an error."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "alloc", *args], capture_output=True, text=True, cwd=ROOT,
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


def test_an_unknown_command_is_one_line_and_exit_two():
    done = cli("frobnicate")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "commands: keys" in done.stderr
