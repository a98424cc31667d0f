"""Tools beside the Python code interpreter (docs/byo-task.md): what a tool is (base.py), loading
the user's tools (loading.py), and running their calls off the event loop, each timed by its own
clock (toolbox.py, calls.py); verl's own tools as they are (verl.py)."""

from cleaner.tools.base import (
           CallContext,
           FunctionTool,
           Tool,
           ToolError,
           ToolResult,
           ToolUnavailable,
)
from cleaner.tools.calls import (
           CoroutineCalls,
           DaemonThreads,
           Hung,
           HungCalls,
           LoopBlocked,
           ThreadCalls,
           Timed,
)
from cleaner.tools.loading import load_tools
from cleaner.tools.toolbox import Toolbox, ToolOutcome, canonical_arguments

__all__ = ["CallContext", "CoroutineCalls", "DaemonThreads", "FunctionTool", "Hung", "HungCalls", "LoopBlocked", "ThreadCalls", "Timed",
           "Tool", "ToolError", "ToolOutcome", "ToolResult", "ToolUnavailable", "Toolbox", "canonical_arguments", "load_tools"]
