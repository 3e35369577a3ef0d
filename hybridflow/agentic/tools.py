"""Tools a policy may call: a name, an OpenAI function schema, and a Python function.

```
@tool(parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                  "required": ["expression"]})
def calculator(expression: str) -> str: ...

TOOLS["calculator"].schema()   {"type": "function", "function": {"name", "description", "parameters"}}
                               (what the chat template shows the model)
resolve_tool("calculator") / resolve_tool("my_pkg.tools:lookup")   a registered or importable tool
```

A tool's arguments are checked against its schema before it runs; a call that does not match
is answered with the error instead (``env.ToolEnvironment``), never a crash.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema

__all__ = ["TOOLS", "Tool", "check_parameters_schema", "check_tool_schema", "import_named", "resolve_tool", "tool"]


@dataclass(frozen=True)
class Tool:
    """One callable tool."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON schema of the arguments object."""
    fn: Callable[..., Any] = field(compare=False)
    timeout_s: float = 10.0
    """A call that takes longer is answered with a timeout error (the call itself is abandoned)."""

    def __post_init__(self) -> None:
        check_tool_schema(self.name, self.description, self.parameters)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema chat templates render in the system prompt."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }

    def argument_errors(self, arguments: Any) -> str | None:
        """Why ``arguments`` do not fit the schema (one line), or None."""
        try:
            jsonschema.validate(arguments, self.parameters)
        except jsonschema.ValidationError as error:
            where = "/".join(str(p) for p in error.absolute_path) or "the arguments"
            return f"{where}: {error.message}"
        return None


TOOLS: dict[str, Tool] = {}
"""Tools by name (``tool`` registers them)."""


def check_parameters_schema(parameters: Any, where: str) -> None:
    """ValueError (one line naming ``where``) unless ``parameters`` is a JSON schema of an object."""
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise ValueError(
            f'{where}: a tool\'s parameters must be a JSON schema with "type": "object", got {parameters!r}'
        )
    try:
        jsonschema.Draft202012Validator.check_schema(dict(parameters))
    except jsonschema.SchemaError as error:
        raise ValueError(f"{where}: not a valid JSON schema: {error.message}") from None


_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""What the function-calling formats accept as a name (the model writes it back in its call)."""


def check_tool_schema(name: Any, description: Any, parameters: Any) -> None:
    """ValueError (one line naming the tool) unless the tool is one a chat template can show and a
    model can call: a name of letters, digits, ``_`` and ``-`` (at most 64), a description that
    says what it does (the model chooses tools by it), parameters a JSON schema of an object whose
    ``required`` names are among its ``properties``."""
    where = f"tool {name!r}"
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}: a tool's name must be 1-64 letters, digits, '_' or '-'; rename it")
    check_parameters_schema(parameters, where)
    if not isinstance(description, str) or not description.strip():
        raise ValueError(
            f"{where}: no description; the model picks its tools by what their descriptions say: pass "
            "description= or give the function a docstring"
        )
    missing = set(parameters.get("required", ())) - set(parameters.get("properties", {}))
    if missing:
        raise ValueError(f"{where}: required {sorted(missing)} not among the schema's properties; declare them")


def tool(
    name: str | None = None, *, parameters: Mapping[str, Any], description: str | None = None, timeout_s: float = 10.0
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a function as a tool (its docstring's first line is the description by default)."""

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        key = name or fn.__name__
        doc = description or (inspect.getdoc(fn) or "").partition("\n")[0]
        TOOLS[key] = Tool(key, doc, dict(parameters), fn, timeout_s)
        return fn

    return add


def import_named(spec: str) -> Any:
    """What ``module:name`` names (a tool's function, an environment class); LookupError saying
    why it does not import."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise LookupError(str(error)) from None


def resolve_tool(spec: str) -> Tool:
    """A tool by its registered name, or ``module:function`` for one registered on import (the
    module is imported and the function's registration looked up). ValueError in one line when
    neither works."""
    if spec in TOOLS:
        return TOOLS[spec]
    module, _, attribute = spec.partition(":")
    if not attribute:
        known = ", ".join(sorted(TOOLS)) or "none"
        raise ValueError(f"unknown tool {spec!r}: registered tools are {known}; or name one as module:function")
    try:
        fn = import_named(spec)
    except LookupError as error:
        raise ValueError(f"tool {spec!r} does not import: {error}") from None
    found = [t for t in TOOLS.values() if t.fn is fn]
    if not found:
        raise ValueError(f"{spec} is not a tool: decorate it with hybridflow.agentic.tools.tool(parameters=...)")
    return found[0]
