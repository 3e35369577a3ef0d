"""Tools that come with hybridflow: ``calculator`` (exact integer and decimal arithmetic) and
``python`` (a program run in the code sandbox, ``sandbox``)."""

from __future__ import annotations

import ast
import operator
from decimal import Decimal, DivisionByZero, InvalidOperation, localcontext

from hybridflow.agentic.sandbox import Sandbox
from hybridflow.agentic.tools import Tool, tool

__all__ = ["calculator", "python_tool"]

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_MAX_DIGITS = 200


def _value(node: ast.AST) -> Decimal:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Decimal(str(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        result = _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        result = _OPERATORS[type(node.op)](_value(node.operand))
    else:
        raise ValueError("only numbers, + - * / // % and parentheses are allowed")
    if result.is_finite() and result.adjusted() >= _MAX_DIGITS:
        raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
    return result


@tool(
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (123456 * 789) + 42"}},
        "required": ["expression"],
    },
    timeout_s=2.0,
)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly."""
    try:
        with localcontext(prec=2 * _MAX_DIGITS):  # integers stay exact up to the cap
            result = _value(ast.parse(expression, mode="eval").body)
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    except (DivisionByZero, InvalidOperation):
        raise ValueError("division by zero") from None
    return format(result.normalize(), "f") if result != result.to_integral() else str(int(result))


def python_tool(sandbox: Sandbox, *, timeout_s: float | None = None) -> Tool:
    """A ``python`` tool: the model's program runs in ``sandbox``; it sees what the program
    printed, or why it was stopped."""

    def run(code: str) -> str:
        result = sandbox.run(code)
        if not result.ok:
            raise RuntimeError(f"{result.describe()}\n{result.stdout[-2000:]}{result.stderr[-2000:]}".rstrip())
        return result.stdout

    limit = getattr(getattr(sandbox, "limits", None), "wall_seconds", 10.0)
    return Tool(
        "python",
        "Run a Python program; what it prints is returned.",
        {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        run,
        timeout_s if timeout_s is not None else limit + 5.0,
    )
