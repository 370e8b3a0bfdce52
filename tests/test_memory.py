"""Fresh-process measurements (helpers.measure.memory): the fork server against a new interpreter, its failures,
timeouts and environment."""

import os
import time

import pytest

from helpers.measure import memory
from helpers.measure.memory import can_fork_server, run_in_fresh_process

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(not can_fork_server(), reason="the fork server needs Linux's /proc/self/pagemap")]

TINY = dict(config=dict(vocab_size=256, context_length=32, d_model=64, n_heads=2, n_layers=2), micro_batch=2,
            accum_steps=2, seq=32)


def test_a_forked_child_measures_the_peak_a_new_interpreter_measures():
    """Without the server's resident library pages touched first, the forked peak came out ~12 MB higher."""
    function = "helpers.measure.batch_size:accumulation_peak_in_fresh_process"
    interpreter = run_in_fresh_process(function, fork=False, **TINY)
    forked = [run_in_fresh_process(function, fork=True, **TINY) for _ in range(2)]
    assert all(abs(peak - interpreter) < 2 * 2**20 for peak in forked), (interpreter, forked)


def test_a_failure_in_the_child_raises_with_its_traceback_and_the_server_serves_the_next_call(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("raise KeyError('no such strategy')\n")
    with pytest.raises(RuntimeError, match=r"runpy:run_path failed in a fresh process:(.|\n)*KeyError: 'no such"):
        run_in_fresh_process("runpy:run_path", path_name=str(script))
    assert run_in_fresh_process("os:getcwd") == os.getcwd()


def test_a_timeout_kills_the_child_and_the_next_call_starts_a_new_server(tmp_path):
    """The child writes its pid, then hangs. On a loaded machine it may not reach its first line within the timeout:
    then the run is tried again with a longer one."""
    script, pid_file = tmp_path / "hangs.py", tmp_path / "pid"
    script.write_text("import os, pathlib, time\n"
                      f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\ntime.sleep(600)\n")
    for timeout in (3, 12, 48):
        start = time.monotonic()
        with pytest.raises(memory.subprocess.TimeoutExpired):
            run_in_fresh_process("runpy:run_path", timeout=timeout, path_name=str(script))
        assert time.monotonic() - start < timeout + 30
        if pid_file.exists():
            break
    pid = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; the server reaps the child as it exits
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the child {pid} outlived its timeout")
    assert run_in_fresh_process("os:getpid") != pid


def test_the_child_sees_the_environment_of_the_call(monkeypatch):
    monkeypatch.setenv("COURSE_MEMORY_TEST", "first")
    assert run_in_fresh_process("os:getenv", key="COURSE_MEMORY_TEST") == "first"
    monkeypatch.setenv("COURSE_MEMORY_TEST", "second")
    assert run_in_fresh_process("os:getenv", key="COURSE_MEMORY_TEST") == "second"
    assert run_in_fresh_process("os:getenv", key="MALLOC_MMAP_THRESHOLD_") == "65536"
