"""Tool calls in generated text, behind a small parser interface.

:class:`HermesToolParser` reads the format Qwen2.5/Qwen3 chat templates teach (Hermes style): each call is a
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block; ``arguments`` may also be a JSON string.
What is outside the blocks is the message's text. A block that is not a valid call (bad JSON, no name,
arguments that are not an object) is reported as an error the model is told about, never raised; an unclosed
block at the end (the response was cut) is an error too.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedMessage:
    text: str  # the message without its tool-call blocks
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per malformed block, for the model to read


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedMessage: ...


class HermesToolParser:
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self):
        self._block = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.DOTALL)

    def parse(self, text: str) -> ParsedMessage:
        message = ParsedMessage(text="")
        kept, position = [], 0
        for match in self._block.finditer(text):
            kept.append(text[position:match.start()])
            position = match.end()
            call, error = self._call(match.group(1))
            if call is not None:
                message.calls.append(call)
            else:
                message.errors.append(error)
        rest = text[position:]
        if self.open_tag in rest:  # a block the response ended inside of
            cut = rest.index(self.open_tag)
            message.errors.append(f"unterminated {self.open_tag} block (no {self.close_tag})")
            rest = rest[:cut]
        kept.append(rest)
        message.text = "".join(kept).strip()
        return message

    @staticmethod
    def _call(body: str) -> tuple[ToolCall | None, str]:
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            return None, f"tool call is not valid JSON ({exc.msg} at char {exc.pos}): {body.strip()[:200]!r}"
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
            return None, f"tool call needs a JSON object with a string 'name': {body.strip()[:200]!r}"
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return None, f"tool call {payload['name']!r}: 'arguments' is a string that is not JSON"
        if not isinstance(arguments, dict):
            return None, f"tool call {payload['name']!r}: 'arguments' must be a JSON object"
        return ToolCall(payload["name"], arguments), ""


def build_tool_parser(format: str) -> ToolCallParser:
    """``hermes``, or a ``module.Class`` with a ``parse(text) -> ParsedMessage`` (built without arguments)."""
    if format == "hermes":
        return HermesToolParser()
    module_name, _, class_name = format.rpartition(".")
    try:
        parser = getattr(importlib.import_module(module_name), class_name)()
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={format!r}: cannot build the tool-call "
                         f"parser: {exc}") from exc
    if not callable(getattr(parser, "parse", None)):
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={format!r} has no parse(text) method")
    return parser
