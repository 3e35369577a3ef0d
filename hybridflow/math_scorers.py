"""Math rewards for the data sets people post-train on, scored as verl scores them.

```
data_source (verl's names)            reward.math_equivalence=verl (default)   =math_verify
openai/gsm8k                          gsm8k: the last "#### <number>"            math_verify
lighteval/MATH, DigitalLearningGmbH/  math_boxed: the last \\boxed{} under the     math_verify
  MATH-lighteval, HuggingFaceH4/      MATH answer normalisation
  MATH-500
math_dapo, aime*                      dapo_math: the last "Answer:" under        math_verify
                                      Minerva's normalisation (1 or -1)
```

A user reproducing a verl recipe must see the reward curve verl would draw, so the default
scorers accept exactly what verl's accept: GSM8K's strict check reads only a ``#### 72`` the
model wrote (in the response's last 300 characters), drops thousands commas and ``$``, and
compares the text with the ground truth; MATH's check compares the last boxed answer with the
ground truth after the string canonicalisation of Hendrycks et al.'s MATH evaluation (``\\dfrac``
-> ``\\frac``, units and ``\\left`` dropped, ``0.5`` -> ``\\frac{1}{2}``, ...), which verl's MATH
check uses. ``math_verify`` (the ``math-verify`` package's symbolic equivalence) is the more
lenient choice: ``1/2`` = ``0.5`` = ``\\frac12``, ``x=3`` = ``3``, sets and intervals in any order.
Each returns 1.0 or 0.0, but for DAPO's check: 1.0 or -1.0, as the DAPO recipe rewards.
"""

from __future__ import annotations

import re
import threading
from typing import Any

__all__ = [
    "ANSWER_FINDERS",
    "DAPO_SOURCES",
    "GSM8K_SOURCES",
    "MATH_SOURCES",
    "dapo_math",
    "gsm8k_strict",
    "is_verl_math_source",
    "last_boxed",
    "math_boxed",
    "math_verify_score",
    "minerva_normalise",
    "normalise_math_answer",
]

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo",)
"""With every data_source starting with ``aime`` (``is_verl_math_source``)."""


def is_verl_math_source(data_source: str | None) -> bool:
    """Whether verl scores ``data_source`` with one of the checks reproduced here."""
    return data_source is not None and (
        data_source in GSM8K_SOURCES + MATH_SOURCES + DAPO_SOURCES or data_source.startswith("aime")
    )


_GSM8K_TAIL_CHARS = 300  # verl reads the end of the response only (its regex is slow on long text)
_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def gsm8k_answer_found(response: str) -> bool:
    """Whether ``gsm8k_strict`` finds a ``#### <number>`` to compare (False: the model did not write
    one where verl reads, which no correct number can make up for)."""
    return bool(_GSM8K_ANSWER.search(response[-_GSM8K_TAIL_CHARS:]))


def gsm8k_strict(response: str, answer: Any, **kwargs: Any) -> float:
    """1.0 when the last ``#### <number>`` near the end of ``response`` is the ground truth."""
    found = _GSM8K_ANSWER.findall(response[-_GSM8K_TAIL_CHARS:])
    if not found:
        return 0.0
    return float(found[-1].replace(",", "").replace("$", "") == str(answer))


# ------------------------------------------------------------------------------------ MATH


def last_boxed(text: str) -> str | None:
    """The answer verl's MATH check reads: with any ``\\boxed `` (a space) in the text, what follows
    the last one up to a ``$``; else the content of the last ``\\boxed{...}`` (braces balanced).
    None if there is none, or the last box is an ``\\fbox`` (which verl's check scores 0)."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                whole = text[start : index + 1]
                return whole[len("\\boxed{") : -1] if whole.startswith("\\boxed{") else None
    return None  # unbalanced: no answer


class _Unparsable(Exception):
    """A step of the normalisation cannot read the text: the raw strings are compared instead."""


def _without_right_units(text: str) -> str:
    """``5 \\text{ cm}`` -> ``5 `` ("\\text{ " with a space marks a unit in MATH's answers)."""
    if "\\text{ " not in text:
        return text
    parts = text.split("\\text{ ")
    if len(parts) != 2:
        raise _Unparsable(text)
    return parts[0]


def _braced_sqrt(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (the first character only)."""
    head, *rest = text.split("\\sqrt")
    out = [head]
    for part in rest:
        if not part:
            raise _Unparsable(text)
        out.append("\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:]))
    return "".join(out)


def _braced_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}`` (single-character operands)."""
    head, *rest = text.split("\\frac")
    out = [head]
    for part in rest:
        if not part:
            raise _Unparsable(text)
        if part[0] == "{":
            out.append("\\frac" + part)
            continue
        if len(part) < 2:
            return text  # "\\frac1": left as written
        first, second, tail = part[0], part[1], part[2:]
        out.append("\\frac{" + first + "}" + ("{" + second + "}" if second != "{" else second) + tail)
    return "".join(out)


def _slash_fraction(text: str) -> str:
    """``3/4`` (integers written plainly, the whole answer) -> ``\\frac{3}{4}``."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    return f"\\frac{{{a}}}{{{b}}}" if text == f"{a}/{b}" else text


def normalise_math_answer(text: str) -> str:
    """The MATH evaluation's canonical form of an answer; ``_Unparsable`` when a step cannot read it."""
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        text = text.replace(old, new)
    text = _without_right_units(text).replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5", "x=3": the value
        text = sides[1]
    text = _braced_fracs(_braced_sqrt(text).replace(" ", ""))
    if text == "0.5":
        text = "\\frac{1}{2}"
    text = _slash_fraction(text)
    return _no_leading_zeros(text)


def _no_leading_zeros(text: str) -> str:
    match = re.fullmatch(r"([-+]?)(\d+)", text)
    return match.group(1) + (match.group(2).lstrip("0") or "0") if match else text


def math_boxed(response: str, answer: Any, **kwargs: Any) -> float:
    """1.0 when the last boxed answer equals the ground truth under ``normalise_math_answer``
    (the raw strings when either cannot be normalised)."""
    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    truth = str(answer)
    try:
        return float(normalise_math_answer(boxed) == normalise_math_answer(truth))
    except _Unparsable:
        return float(boxed == truth)


# -------------------------------------------------------------------------------- DAPO-Math

# Minerva's answer normalisation (Lewkowycz et al. 2022, appendix D.1), which DAPO's math check
# applies to the text after the last "Answer:" and to the ground truth.
_MINERVA_REPLACED = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_MINERVA_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
_DAPO_TAIL_CHARS = 300
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def minerva_normalise(answer: str) -> str:
    """Minerva's canonical form of a final answer (compare two with ``==``)."""
    answer = answer.split("=")[-1]
    for old, new in _MINERVA_REPLACED:
        answer = answer.replace(old, new)
    for removed in _MINERVA_REMOVED:
        answer = answer.replace(removed, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)  # the first $...$ only
    for command in ("text", "textbf", "overline"):
        answer = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)  # \fracab -> \frac{a}{b}
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_answer_found(response: str) -> bool:
    """Whether ``dapo_math`` finds an "Answer:" line in the response's last 300 characters."""
    return bool(_DAPO_ANSWER.search(response[-_DAPO_TAIL_CHARS:]))


def dapo_math(response: str, answer: Any, **kwargs: Any) -> float:
    """DAPO-Math's check: 1.0 when the text after the last "Answer:" in the response's last 300
    characters equals the ground truth under ``minerva_normalise``, else -1.0."""
    found = _DAPO_ANSWER.findall(response[-_DAPO_TAIL_CHARS:])
    guess = minerva_normalise(found[-1] if found else "[INVALID]")
    return 1.0 if guess == minerva_normalise(str(answer)) else -1.0


def math_verify_score(response: str, answer: Any, **kwargs: Any) -> float:
    """1.0 when math-verify finds the response's answer equivalent to the ground truth."""
    from math_verify import parse, verify

    # math-verify bounds its sympy work with SIGALRM, which only the main thread may set
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_latex(str(answer)), parsing_timeout=limit)
    guess = parse(response, parsing_timeout=limit)
    return float(bool(gold) and bool(guess) and verify(gold, guess, timeout_seconds=limit))


def _as_latex(answer: str) -> str:
    """A bare ground truth (``72``, ``\\frac{1}{2}``) in the ``$...$`` math-verify's parser expects."""
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


ANSWER_FINDERS = {
    gsm8k_strict: gsm8k_answer_found,
    math_boxed: lambda response: last_boxed(response) is not None,
    dapo_math: dapo_answer_found,
}
"""Scorer -> whether a response holds an answer in the format that scorer reads: a zero reward
then says "no answer in the format" rather than "a wrong answer" (``rewards.score_rows``)."""
