"""The tag format of tool calls in a turn's text, and the registry that runs them.

A call is ``<NAME>BODY</NAME>`` for a registered ``NAME`` (``<calculator>12*(3+4)</calculator>``,
``<python>print(1+2)</python>``); generation stops at an end tag (``ToolSet.stop_strings``), so
the engine's text (or the decoding of its output ids, which include the stop string) ends with
the call. Text after the end tag is not part of the call; a stop-trimmed text needs its matched
stop string appended before ``parse``.

``ToolSet.parse(text)``: calls are read left to right (an open tag, then the first matching end
tag); the result is the last complete call, or ``None`` when there is none or an open tag of a
registered tool after it is never closed (the turn ends inside a call).

``await ToolSet.run(call, seed)`` never raises for a tool's failure: the result's ``output`` is
the tool's text (``(no output)`` for a silent program), or ``error: ...`` with ``error`` the kind
(``"tool"`` for a refused input or an unknown name, else the sandbox's kinds).
``ToolResult.message()`` is the observation as a chat message:
``{"role": "tool", "content": "<result>\\nOUTPUT\\n</result>"}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from areal_async.tools.calculator import ToolError, calculate
from areal_async.tools.sandbox import SandboxLimits, run_python

__all__ = ["TOOL_NAMES", "ToolCall", "ToolResult", "ToolSet"]

TOOL_NAMES = ("calculator", "python")
_HELP = {
    "calculator": "<calculator>EXPRESSION</calculator> computes an arithmetic expression exactly "
                  "(numbers, + - * / // % **, parentheses), e.g. <calculator>12*(3+4)</calculator>",
    "python": "<python>CODE</python> runs Python code and shows what it prints, "
              "e.g. <python>print(sum(range(10)))</python>",
}
_ERROR_MESSAGES = {
    "timeout": "timed out after {timeout} s",
    "output_limit": "output over {max_output} bytes, the program was stopped",
    "memory": "out of memory (limit {memory} MiB)",
    "cpu_time": "CPU time limit exceeded",
    "killed": "the program was killed (exit status {status})",
    "code_size": "the code was not run",
    "start": "the program could not be started",
}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call in a turn's text: ``name``, ``body`` (between the tags, unstripped), and ``start``,
    ``end``: character offsets of the open tag's ``<`` and just past the end tag's ``>``."""

    name: str
    body: str
    start: int = 0
    end: int = 0


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """``name``: the tool called; ``output``: the observation's text; ``error``: ``None`` or the
    kind (module docstring); ``seconds``: wall time of the run."""

    name: str
    output: str
    error: str | None
    seconds: float

    def message(self) -> dict[str, str]:
        """``{"role": "tool", "content": "<result>\\n" + output + "\\n</result>"}``."""
        return {"role": "tool", "content": f"<result>\n{self.output}\n</result>"}


class ToolSet:
    """The tools ``names`` (each in ``TOOL_NAMES``; ``ValueError`` otherwise), the python tool
    limited by ``timeout_s`` wall seconds, ``memory_mb`` MiB and ``max_output_bytes``; the
    calculator runs in-process (its limits bound its time) with output cut at ``max_output_bytes``."""

    def __init__(self, names: list[str] | tuple[str, ...] = TOOL_NAMES, timeout_s: float = 10.0,
                 memory_mb: int = 512, max_output_bytes: int = 4096):
        unknown = [n for n in names if n not in TOOL_NAMES]
        if unknown or not names or len(set(names)) != len(names):
            raise ValueError(f"tool names must be distinct, from {list(TOOL_NAMES)}; got {list(names)}")
        self.names = tuple(names)
        self.limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb,
                                    max_output_bytes=max_output_bytes)

    @property
    def stop_strings(self) -> list[str]:
        """The end tags, ``</NAME>`` per tool, in ``names`` order."""
        return [f"</{n}>" for n in self.names]

    def system_prompt(self) -> str:
        """A short text for a task's system prompt: the tag format, one line per tool."""
        lines = ["You can call a tool by writing a tag; the result comes back as <result>...</result>.",
                 "Write one call at the end of your message and wait for its result."]
        lines += [f"- {_HELP[n]}" for n in self.names]
        return "\n".join(lines)

    def parse(self, text: str) -> ToolCall | None:
        """The last complete call in ``text`` (rule in the module docstring), or ``None``."""
        last, pos = None, 0
        while True:
            opening = self._next_open(text, pos)
            if opening is None:
                return last
            start, name = opening
            body_start = start + len(name) + 2
            close = text.find(f"</{name}>", body_start)
            if close < 0:
                return None  # the text ends inside a call
            end = close + len(name) + 3
            last, pos = ToolCall(name, text[body_start:close], start, end), end

    def _next_open(self, text: str, pos: int) -> tuple[int, str] | None:
        """The first open tag of a registered tool at or after ``pos``: ``(offset, name)``."""
        found = [(i, n) for n in self.names if (i := text.find(f"<{n}>", pos)) >= 0]
        return min(found) if found else None

    async def run(self, call: ToolCall, seed: int = 0) -> ToolResult:
        """Run ``call`` (the python tool with ``seed``); never raises for the tool's failure."""
        start = time.monotonic()
        if call.name not in self.names:
            return ToolResult(call.name, f"error: unknown tool {call.name!r}; available: "
                              f"{', '.join(self.names)}", "tool", 0.0)
        if call.name == "calculator":
            try:
                output, error = self._cut(calculate(call.body)), None
            except ToolError as e:
                output, error = f"error: {e}", "tool"
            await asyncio.sleep(0)
            return ToolResult(call.name, output, error, time.monotonic() - start)
        result = await run_python(call.body, seed, self.limits)
        output = result.stdout.rstrip("\n")
        if result.error is None:
            output = output or "(no output)"
        elif result.error == "raised":
            output = f"error: the program failed (exit status {result.exit_status})\n{output}".rstrip("\n")
        elif result.error is not None:
            text = _ERROR_MESSAGES.get(result.error, result.error).format(
                timeout=self.limits.timeout_s, max_output=self.limits.max_output_bytes,
                memory=self.limits.memory_mb, status=result.exit_status)
            output = f"error: {text}" + (f"\n{output}" if output else "")
        return ToolResult(call.name, output, result.error, result.seconds)

    def _cut(self, text: str) -> str:
        cap = self.limits.max_output_bytes
        return text if len(text) <= cap else text[:cap] + f"\n[output truncated at {cap} characters]"
