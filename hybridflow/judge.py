"""A generative judge's prompt and its verdict, without torch: the template and the score parser.

```
judge.template ("... {prompt} ... {response} ... {answer} ...")  ── render ──► the judge's user turn
the judge's reply ── judge.pattern (first group) ──► a number x judge.scale  (None: unparsable)
```

``template_problem`` finds a template without ``{response}`` (the judge would never see what it
judges) or with a placeholder it does not know; the config refuses it in one line naming the key.
"""

from __future__ import annotations

import re
import string
from typing import Any

__all__ = ["PLACEHOLDERS", "parse_score", "prompt_text", "render", "template_problem"]

PLACEHOLDERS = ("prompt", "response", "answer")
"""What a judging template may name: the prompt's text, the response judged, the row's answer."""


def template_problem(template: str) -> str | None:
    """What is wrong with a judging template (None: nothing): it must name ``{response}`` and
    only PLACEHOLDERS, and be a format string."""
    try:
        names = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    except ValueError as error:  # an unmatched brace
        return f"not a format string ({error}); write literal braces doubled"
    unknown = sorted(names - set(PLACEHOLDERS))
    if unknown:
        return f"names {{{unknown[0]}}}; a judging template may name {', '.join('{' + p + '}' for p in PLACEHOLDERS)}"
    if "response" not in names:
        return "has no {response} placeholder: the judge would never see the answer it judges"
    return None


def prompt_text(prompt: Any) -> str:
    """A data row's prompt as text: itself, or a chat's last user turn."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


def render(template: str, *, prompt: Any, response: str, answer: Any) -> str:
    """The judging request for one sample."""
    return template.format(prompt=prompt_text(prompt), response=response, answer="" if answer is None else answer)


def parse_score(reply: str, pattern: str, scale: float) -> float | None:
    """``scale`` x the number the first group of ``pattern`` finds in ``reply``; None when it
    finds none or the group is no number."""
    match = re.search(pattern, reply)
    if match is None:
        return None
    try:
        return float(match.group(1)) * scale
    except (IndexError, ValueError):
        return None
