"""Tool calls out of a model's turn, by the format its family was trained on.

The Hermes format (Qwen2.5, Qwen3, Hermes, many others) wraps each call in tags, one JSON object
each, several in one turn for parallel calls:

    Let me compute that.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123456 * 789"}}
    </tool_call>

A call that is not valid JSON, lacks a name, or has arguments that are not an object is kept as
a malformed call: the environment answers it with the error, so the policy learns from it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PARSERS", "ParsedTurn", "ToolCall", "parse_hermes"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    index: int
    """Its place among the turn's calls (the order their results are given back)."""


@dataclass(frozen=True)
class ParsedTurn:
    content: str
    """The turn's text outside the calls."""
    calls: tuple[ToolCall, ...]
    malformed: tuple[str, ...]
    """Why each call that could not be read failed, one line each."""

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.malformed)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    calls, malformed = [], []
    for index, match in enumerate(_HERMES.finditer(text)):
        body = match.group(1).strip()
        if not match.group(0).endswith("</tool_call>"):
            malformed.append("a <tool_call> without its closing </tool_call>")
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            malformed.append(f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            malformed.append('a tool call must be a JSON object with a "name"')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models send the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            malformed.append(f'the "arguments" of {call["name"]!r} must be a JSON object')
            continue
        calls.append(ToolCall(call["name"], arguments, index))
    return ParsedTurn(_HERMES.sub("", text).strip(), tuple(calls), tuple(malformed))


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes, "qwen": parse_hermes}
"""Tool-call formats by name (``agentic.tool_parser``)."""
