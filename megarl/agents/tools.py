"""Tools a policy can call, declared in YAML like verl's ``tools_config``, and their execution with limits.

A tools file lists entries ``{class_name: <module.Class>, config: {...}, tool_schema: {type: function,
function: {name, description, parameters}}}`` (the OpenAI function-schema form, which is what chat templates
render for the model). :func:`load_tools` imports each class, builds it with ``config`` and its schema, and
names the file and entry on any error. A tool subclasses :class:`Tool` and implements ``call(arguments) ->
str``.

:func:`run_tool` is how every call runs: unknown tools, arguments the schema does not allow (missing required
or unknown names), exceptions, results that are not text and calls past ``timeout_s`` all become a
:class:`ToolResult` whose text tells the model what went wrong (text past ``max_output_chars`` is cut by
:func:`truncate_text`); nothing a tool does raises into the rollout. A Python tool that hangs cannot be killed from its
thread: the call returns its timeout error and the thread is abandoned (the built-in code runner is a subprocess
and is killed). Each call runs on a daemon thread of its own, so an abandoned one never holds up the
interpreter's exit: a pool's worker threads are joined at exit, and one hung tool call then kept a finished run
(and its GPUs) alive until killed from outside.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml


@dataclass
class ToolResult:
    text: str
    error: bool
    seconds: float


class Tool:
    """Base class: ``schema`` is the OpenAI function schema; ``config`` the entry's own settings."""

    def __init__(self, schema: dict, config: Optional[dict] = None):
        self.schema = schema
        self.config = dict(config or {})

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def call(self, arguments: dict[str, Any]) -> str:
        raise NotImplementedError


class ToolError(ValueError):
    """A tools file or entry that cannot be loaded."""


def _check_schema(schema: Any, where: str) -> dict:
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolError(f"{where}: tool_schema must be {{type: function, function: {{name, description, "
                        f"parameters}}}}, got {schema!r:.200}")
    parameters = function.setdefault("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolError(f"{where}: tool_schema.function.parameters must be a JSON-schema object")
    return schema


def load_tools(path: str | Path) -> dict[str, Tool]:
    """The tools of a tools file, by name."""
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ToolError(f"tools file {path}: {exc}") from exc
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolError(f"tools file {path}: expected a non-empty 'tools' list")
    tools: dict[str, Tool] = {}
    for index, entry in enumerate(entries):
        where = f"tools file {path}, tools[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolError(f"{where}: needs class_name (module.Class)")
        module_name, _, class_name = entry["class_name"].rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ToolError(f"{where}: cannot import {entry['class_name']!r}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Tool)):
            raise ToolError(f"{where}: {entry['class_name']} is not a megarl.agents.tools.Tool")
        schema = _check_schema(entry.get("tool_schema"), where)
        tool = cls(schema, entry.get("config"))
        if tool.name in tools:
            raise ToolError(f"{where}: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def _argument_problem(tool: Tool, arguments: dict) -> Optional[str]:
    parameters = tool.schema["function"]["parameters"]
    known = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    unknown = [name for name in arguments if known and name not in known]
    if missing:
        return f"missing required argument(s) {missing}"
    if unknown:
        return f"unknown argument(s) {unknown}; {tool.name} takes {sorted(known)}"
    return None


def _call_on_daemon_thread(tool: "Tool", arguments: dict) -> concurrent.futures.Future:
    """``tool.call(arguments)`` on a daemon thread of its own (never joined at exit; see the module docstring)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def work() -> None:
        try:
            future.set_result(tool.call(arguments))
        except BaseException as exc:  # delivered to the caller as the call's failure
            future.set_exception(exc)

    threading.Thread(target=work, name=f"megarl-tool-{tool.name}", daemon=True).start()
    return future


TRUNCATE_SIDES = ("middle", "left", "right")


def truncate_text(text: str, max_chars: int, side: str = "middle") -> str:
    """``text`` cut to about ``max_chars`` characters, saying how much was cut: ``left`` keeps the start,
    ``right`` the end, ``middle`` both ends (3/4 and 1/4: how a program ended is at the end)."""
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side {side!r} is not one of {TRUNCATE_SIDES}")
    if len(text) <= max_chars:
        return text
    if side == "left":
        return f"{text[:max_chars]}\n... [{len(text) - max_chars} characters cut]"
    if side == "right":
        return f"[{len(text) - max_chars} characters cut] ...\n{text[-max_chars:]}"
    head, tail = max_chars * 3 // 4, max_chars // 4
    return f"{text[:head]}\n... [{len(text) - head - tail} characters cut] ...\n{text[len(text) - tail:]}"


def run_tool(tools: dict[str, Tool], name: str, arguments: dict, *, timeout_s: float = 10.0,
             max_output_chars: int = 4096, truncate_side: str = "middle") -> ToolResult:
    """Run one call; every failure is a result the model reads (see the module docstring)."""
    start = time.monotonic()

    def result(text: str, error: bool) -> ToolResult:
        return ToolResult(text=truncate_text(text, max_output_chars, truncate_side), error=error,
                          seconds=time.monotonic() - start)

    tool = tools.get(name)
    if tool is None:
        return result(f"Error: no tool named {name!r}; the tools are {sorted(tools)}", True)
    problem = _argument_problem(tool, arguments)
    if problem:
        return result(f"Error: {name}: {problem}", True)
    future = _call_on_daemon_thread(tool, arguments)
    try:
        text = future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        return result(f"Error: {name} did not answer within {timeout_s:g} s", True)
    except Exception as exc:  # a tool's failure is the model's information, not the run's end
        return result(f"Error: {name} failed: {type(exc).__name__}: {exc}", True)
    if not isinstance(text, str):
        return result(f"Error: {name} returned {type(text).__name__}, not text", True)
    return result(text, False)
