"""``run_sglang``'s fork server (marker ``sglang_ref``).

- A call's exception comes back as AssertionError with its traceback.
- A call past its timeout raises TimeoutExpired, and its child and the child's subprocess are killed.
- Two calls from two threads run at once and both return.
- A call sees nothing an earlier call left: module attributes, ``__main__`` globals, ``os.environ``.
- Output a subprocess writes to fd 1 is the call's output; a call ending in ``os._exit`` still answers.
- ``PYTHONPATH`` reaches ``sys.path``; an import-time variable that differs gets a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from tests.support.sglang_ref import needs_sglang, run_sglang, sglang_env

pytestmark = [pytest.mark.sglang_ref, needs_sglang]


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_raising_call_comes_back_as_an_assertion_error_with_its_traceback():
    with pytest.raises(AssertionError) as err:
        run_sglang("def boom():\n    raise ValueError('boom-42')\nboom()")
    assert "Traceback" in str(err.value) and "in boom" in str(err.value) and "ValueError: boom-42" in str(err.value)


def test_a_call_past_its_timeout_is_killed_with_its_subprocess(tmp_path):
    assert run_sglang("print(1)") == 1  # the server's imports out of the timed call
    code = ("import json, os, subprocess, sys, time\n"
            "sub = subprocess.Popen(['sleep', '600'])\n"
            "open(json.load(sys.stdin), 'w').write(f'{os.getpid()} {sub.pid}')\n"
            "time.sleep(600)")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_sglang(code, str(tmp_path / "pids"), timeout=5)
    assert time.monotonic() - start < 30
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 10
    while not all(_dead(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_dead(p) for p in pids), pids


def test_two_calls_from_two_threads_run_at_once(tmp_path):
    code = ("import json, os, sys, time\n"
            "me, other = json.load(sys.stdin)\n"
            "open(me, 'w').close()\n"
            "deadline = time.monotonic() + 60\n"
            "while not os.path.exists(other):\n"
            "    assert time.monotonic() < deadline, 'the other call never ran beside this one'\n"
            "    time.sleep(0.05)\n"
            "print(json.dumps(os.path.basename(me)))")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(a=run_sglang(code, [a, b], timeout=120)))
    thread.start()
    out["b"] = run_sglang(code, [b, a], timeout=120)
    thread.join(timeout=120)
    assert out == {"a": "a", "b": "b"}


def test_a_call_does_not_see_what_an_earlier_call_left():
    assert run_sglang("import json, os\njson.leaked = 1\nos.environ['LEAKED'] = '1'\nleaked = 1\nprint(1)") == 1
    seen = run_sglang("import json, os, sys\n"
                      "print(json.dumps([hasattr(json, 'leaked'), 'LEAKED' in os.environ, 'leaked' in globals(),\n"
                      "                  'sglang.srt.server_args' in sys.modules]))")
    assert seen == [False, False, False, True]  # and SGLang was imported before the call


def test_a_subprocess_writing_to_fd_1_is_the_calls_output():
    code = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'print([7])'], check=True)"
    assert run_sglang(code) == [7]


def test_pythonpath_and_an_import_time_variable(tmp_path):
    (tmp_path / "probe_mod.py").write_text("VALUE = 3\n")
    code = ("import json, os, sys\nimport probe_mod\n"
            "print(json.dumps([probe_mod.VALUE, os.environ.get('PROBE'), 'torch' in sys.modules]))")
    assert run_sglang(code, env=sglang_env(PYTHONPATH=str(tmp_path), PROBE="x")) == [3, "x", True]  # forked
    fresh = sglang_env(PYTHONPATH=str(tmp_path), PROBE="y", SGLANG_REF_PROBE="1")
    assert run_sglang(code, env=fresh) == [3, "y", False]  # a fresh process: nothing imported yet
    assert os.environ.get("PROBE") is None


def test_a_call_ending_in_os_exit_still_answers():
    assert run_sglang("import os\nprint(5, flush=True)\nos._exit(0)") == 5
    with pytest.raises(AssertionError, match=r"failed \(3\)"):
        run_sglang("import os, sys\nprint('bye', file=sys.stderr, flush=True)\nos._exit(3)")


def test_a_variable_set_in_this_process_later_does_not_unfork_the_calls(monkeypatch):
    # a test that left an import-time variable (HF_*, TORCH*, ...) in os.environ sent every later
    # call of its process to a fresh interpreter: no SGLang preloaded, no process-group kill
    assert run_sglang("print(1)") == 1  # the server started
    monkeypatch.setenv("HF_SET_BY_ANOTHER_TEST", "1")
    assert run_sglang("import json, sys\nprint(json.dumps('torch' in sys.modules))") is True
