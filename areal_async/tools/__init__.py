"""Tools of agentic episodes: an exact calculator, a limited Python runner, and the tag format and
registry (``ToolSet``) that parse a turn's call and run it into an observation."""

from areal_async.tools.calculator import ToolError, calculate
from areal_async.tools.sandbox import SandboxLimits, SandboxResult, run_python
from areal_async.tools.toolset import TOOL_NAMES, ToolCall, ToolResult, ToolSet

__all__ = ["TOOL_NAMES", "SandboxLimits", "SandboxResult", "ToolCall", "ToolError", "ToolResult", "ToolSet",
           "calculate", "run_python"]
