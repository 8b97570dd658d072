"""The tools of agentic episodes: the exact calculator, the limited Python runner and the tag
format's parse and run (``areal_async/tools``). Sandbox limits are small (1 s, 128 MiB) so the
file runs in seconds."""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import socket
import time
from fractions import Fraction

import pytest

from areal_async.tools import (SandboxLimits, ToolCall, ToolError, ToolResult, ToolSet, calculate,
                               run_python)
from areal_async.tools.calculator import MAX_DIGITS, MAX_EXPONENT, MAX_EXPR_CHARS, evaluate

FAST = SandboxLimits(timeout_s=1.0, memory_mb=128, max_output_bytes=1000)


def sandbox(code: str, seed: int = 0, limits: SandboxLimits = FAST):
    return asyncio.run(run_python(code, seed, limits))


# --- calculator ---------------------------------------------------------------------------------

@pytest.mark.parametrize("expression,expected", [
    ("0.1+0.2", "0.3"),                                   # exact, not 0.30000000000000004
    ("0.1*3", "0.3"),
    ("12*(3+4)", "84"),
    ("1/3", "1/3"),                                       # non-terminating: a fraction
    ("-7/6", "-7/6"),
    ("1/8", "0.125"),                                     # terminating: a decimal
    ("-1/4", "-0.25"),
    ("7/2", "3.5"),
    ("1.5*2", "3"),                                       # an integer value prints as digits
    ("2**-3", "0.125"),
    ("2**100", str(2**100)),
    ("12345678901234567890*98765432109876543210", str(12345678901234567890 * 98765432109876543210)),
    ("10//3", "3"),
    ("-7 % 3", "2"),                                      # Python's floor semantics
    ("7.5 // 2", "3"),
    ("-(-2)", "2"),
    ("+5", "5"),
    ("1e3", "1000"),
    ("1_000 + 1", "1001"),
    ("1/3 + 1/6", "0.5"),
    (" \n 2 * 3 \n", "6"),
    ("(" * 150 + "1" + ")" * 150, "1"),                   # parentheses alone add no depth
    ("1/2**1100", f"1/{2**1100}"),                        # terminates, but past MAX_DIGITS places
])
def test_calculator_is_exact(expression, expected):
    assert calculate(expression) == expected


def test_calculator_values_are_fractions():
    assert evaluate("0.1") == Fraction(1, 10)
    assert evaluate("2/6") == Fraction(1, 3)


@pytest.mark.parametrize("expression,message", [
    ("__import__('os')", "call"),
    ("x + 1", "name 'x'"),
    ("(1).real", "attribute 'real'"),
    ("abs(-1)", "call"),
    ("'a' * 3", "literal"),
    ("1j", "literal"),
    ("True + 1", "literal"),
    ("1 < 2", "comparison"),
    ("2 ^ 3", "use ** for powers"),
    ("[1, 2]", "unsupported expression"),
    ("1 +", "syntax error"),
    ("", "empty"),
    ("1/0", "division by zero"),
    ("5 // 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 0.5", "non-integer exponent"),
    (f"2 ** {MAX_EXPONENT + 1}", "exponent too big"),
    ("9 ** 9999", "result too big"),
    ("10**999 * 10**999", "result too big"),
    ("2 ** 2 ** 2 ** 2 ** 2", "exponent too big"),
    ("1e100000000", "number too big"),
    ("1e-5000", "too big"),
    (f"10**{MAX_DIGITS // 2} * 10**{MAX_DIGITS // 2}", "result too big"),
    ("1+" * (MAX_EXPR_CHARS // 2) + "1", "expression too long"),
    ("-" * 200 + "1", "nested too deeply"),
    ("-(" * 150 + "1" + ")" * 150, "nested too deeply"),
])
def test_calculator_refuses_with_a_clear_error(expression, message):
    start = time.monotonic()
    with pytest.raises(ToolError, match=re.escape(message)):
        calculate(expression)
    assert time.monotonic() - start < 0.5


def test_calculator_never_executes_code(tmp_path):
    marker = tmp_path / "hit"
    with pytest.raises(ToolError):
        calculate(f"__import__('pathlib').Path({str(marker)!r}).touch()")
    assert not marker.exists()


# --- sandbox ------------------------------------------------------------------------------------

def test_sandbox_runs_code_and_reports_a_raise():
    ok = sandbox("print(sum(range(10)))")
    assert (ok.stdout, ok.error, ok.exit_status) == ("45\n", None, 0)
    bad = sandbox("print('before')\nx = 1 / 0")
    assert bad.error == "raised" and bad.exit_status == 1
    assert bad.stdout.startswith("before\n")
    assert 'File "<code>", line 2' in bad.stdout and "x = 1 / 0" in bad.stdout
    assert bad.stdout.rstrip().endswith("ZeroDivisionError: division by zero")


def processes_left(pid: int) -> list[str]:
    """Processes whose pid, process group or session id is ``pid`` (the child leads a new group
    and session), from ``/proc``."""
    left = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # fields[2]: pgid, fields[3]: sid
        except OSError:
            continue
        if stat.parent.name == str(pid) or int(fields[2]) == pid or int(fields[3]) == pid:
            left.append(stat.parent.name)
    return left


def test_sandbox_kills_a_hanging_process_group_on_timeout():
    result = sandbox("import os, time\nprint(os.getpid(), flush=True)\nwhile True: time.sleep(0.01)")
    assert result.error == "timeout"
    assert result.seconds < FAST.timeout_s + 1.0
    assert processes_left(int(result.stdout.split()[0])) == []


def test_sandbox_cuts_an_output_flood():
    one_write = sandbox("print('y' * 10**6)")  # a pipe left full must not delay the result
    assert one_write.error == "output_limit" and one_write.seconds < FAST.timeout_s
    result = sandbox("while True: print('x' * 100)")
    assert result.error == "output_limit"
    assert result.seconds < FAST.timeout_s  # stopped by the cap, not the clock
    assert result.stdout.endswith(f"\n[output truncated at {FAST.max_output_bytes} bytes]")
    assert result.stdout.startswith("x" * 100 + "\n")
    assert len(result.stdout) < FAST.max_output_bytes + 100


def test_sandbox_limits_memory():
    result = sandbox("b = bytearray(512 << 20)\nprint('allocated')")
    assert result.error == "memory"
    assert "allocated" not in result.stdout and "MemoryError" in result.stdout


def test_sandbox_refuses_network():
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        port = listener.getsockname()[1]
        code = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
                "print('connected')")
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()  # reachable from here
        result = sandbox(code)
    finally:
        listener.close()
    assert result.error == "raised"
    assert "connected" not in result.stdout
    assert "refused in the sandbox: socket." in result.stdout or "unreachable" in result.stdout


def test_sandbox_refuses_processes_and_signals():
    for code in ("import os; os.system('true')", "import subprocess", "import os; os.fork()",
                 "import os; os.kill(os.getpid(), 0)"):  # signal 0: harmless if it got through
        result = sandbox(code)
        assert result.error == "raised" and "refused in the sandbox" in result.stdout, code


def test_sandbox_is_deterministic_per_seed():
    code = ("import random\n"
            "print(random.random(), random.randint(0, 10**9), hash('abc'), list({'a', 'b', 'c', 'd'}))")
    first, again, other = sandbox(code, seed=3), sandbox(code, seed=3), sandbox(code, seed=4)
    assert first.error is None and first.stdout == again.stdout
    assert other.stdout != first.stdout


def test_sandbox_isolation(monkeypatch):
    monkeypatch.setenv("AREAL_TOOLS_SECRET", "x")
    result = sandbox("import os, sys\nprint(os.getcwd())\nprint(sorted(os.environ))\n"
                     "open('f.txt', 'w').write('hi')\nprint(sys.flags.no_user_site, sys.flags.safe_path)")
    cwd, env, flags = result.stdout.splitlines()
    assert "AREAL_TOOLS_SECRET" not in env and "PYTHONHASHSEED" in env
    assert flags == "1 True"
    assert not os.path.exists(cwd)  # the working directory is removed afterwards
    big = sandbox("open('f', 'wb').write(b'x' * (2 << 20))",
                  limits=SandboxLimits(timeout_s=1, max_file_bytes=1 << 20))
    assert big.error == "raised" and "File too large" in big.stdout


def test_sandbox_kills_on_cancellation(tmp_path):
    pid_file = tmp_path / "pid"

    async def cancel():
        code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(30)"
        task = asyncio.create_task(run_python(code, 0, SandboxLimits(timeout_s=30)))
        while not pid_file.exists() or not pid_file.read_text():
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    start = time.monotonic()
    asyncio.run(cancel())
    assert time.monotonic() - start < 5
    assert processes_left(int(pid_file.read_text())) == []


# --- the tag format and the registry ------------------------------------------------------------

TOOLS = ToolSet(names=["calculator", "python"], timeout_s=1.0, memory_mb=128, max_output_bytes=1000)


def test_stop_strings_and_system_prompt():
    assert TOOLS.stop_strings == ["</calculator>", "</python>"]
    prompt = TOOLS.system_prompt()
    assert "<calculator>12*(3+4)</calculator>" in prompt and "<python>" in prompt and "<result>" in prompt
    assert ToolSet(names=["calculator"]).stop_strings == ["</calculator>"]
    assert "<python>" not in ToolSet(names=["calculator"]).system_prompt()
    with pytest.raises(ValueError):
        ToolSet(names=["search"])


@pytest.mark.parametrize("text,expected", [
    ("Let me compute. <calculator>12*(3+4)</calculator>", ("calculator", "12*(3+4)")),
    ("<python>\nprint(1+2)\n</python>", ("python", "\nprint(1+2)\n")),
    ("<python>print(1)</python>\nand then more text", ("python", "print(1)")),       # after the end tag
    ("<calculator>1+1</calculator> <python>print(2)</python>.", ("python", "print(2)")),  # the last one
    ("<python>print('<calculator>')</python>", ("python", "print('<calculator>')")),    # a tag in a body
    ("<calculator></calculator>", ("calculator", "")),
    ("The answer is 4.", None),
    ("<calculator>1+", None),                                                        # unclosed
    ("<python>print(1)</python> then <calculator>2+", None),                         # ends inside a call
    ("<calculator>1+2</python>", None),                                              # mismatched
    ("<calculator 1+2</calculator>", None),                                          # malformed open tag
    ("<b>bold</b> <search>x</search>", None),                                        # not registered
])
def test_parse(text, expected):
    call = TOOLS.parse(text)
    assert (None if call is None else (call.name, call.body)) == expected
    if call is not None:
        assert text[call.start:call.end] == f"<{call.name}>{call.body}</{call.name}>"


def test_parse_ignores_tools_outside_the_set():
    assert ToolSet(names=["calculator"]).parse("<python>print(1)</python>") is None


def run(call: ToolCall, seed: int = 0) -> ToolResult:
    return asyncio.run(TOOLS.run(call, seed))


def test_run_calculator_and_message():
    result = run(TOOLS.parse("<calculator> 1/3 + 1/6 </calculator>"))
    assert (result.name, result.output, result.error) == ("calculator", "0.5", None)
    assert result.message() == {"role": "tool", "content": "<result>\n0.5\n</result>"}
    bad = run(ToolCall("calculator", "__import__('os')"))
    assert bad.error == "tool" and bad.output.startswith("error: unsupported function call")


def test_run_python_results_become_observations():
    assert run(ToolCall("python", "print(1+2)")).output == "3"
    assert run(ToolCall("python", "x = 1")).output == "(no output)"
    raised = run(ToolCall("python", "raise ValueError('boom')"))
    assert raised.error == "raised"
    assert raised.output.startswith("error: the program failed (exit status 1)")
    assert raised.output.endswith("ValueError: boom")
    hung = run(ToolCall("python", "while True: pass"))
    assert hung.error == "timeout" and hung.output == "error: timed out after 1.0 s"
    flood = run(ToolCall("python", "print('y' * 10**6)"))
    assert flood.error == "output_limit" and flood.output.startswith("error: output over 1000 bytes")
    same = [run(ToolCall("python", "import random; print(random.random())"), seed=9).output for _ in range(2)]
    assert same[0] == same[1]


def test_run_unknown_tool_is_an_error_observation():
    result = run(ToolCall("search", "cats"))
    assert result.error == "tool"
    assert result.output == "error: unknown tool 'search'; available: calculator, python"
    assert result.message()["content"].startswith("<result>\nerror: unknown tool")
